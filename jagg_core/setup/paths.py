"""Where every stage reads and writes, per profile (the same layout for dvc.yaml, the flows and the CLI)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from jagg_core.errors import UserError

__all__ = ["Layout", "PathRuleError", "RunNameError", "inside", "parse_run_name", "run_name"]

# A run name as `run_name` makes it and nothing else: a method name of at most 64 characters, a seed from 0 to
# 2**31 - 1 in ASCII digits without leading zeros, no trailing newline (fullmatch, not `$`), no '/' or '..'.
_RUN = re.compile(r"(?P<method>[a-z0-9][a-z0-9_-]{0,63})-s(?P<seed>0|[1-9][0-9]{0,9})", re.ASCII)
_MAX_SEED = 2**31 - 1


class RunNameError(UserError, ValueError):
    """An argument that should name a training run (``--run``) does not."""


class PathRuleError(UserError, ValueError):
    """A path argument points outside the project, or at something other than what it names."""


def run_name(method: str, seed: int) -> str:
    """The name of one training run: ``<method>-s<seed>``."""
    return f"{method}-s{seed}"


def parse_run_name(name: str, flag: str = "--run") -> tuple[str, int]:
    """``(method, seed)`` of a run name, the one reading of it (`jagg evaluate --run`, `jagg export --run`): exactly
    what :func:`run_name` writes for a method and a seed that ``run.methods`` and ``--seed`` accept, or one sentence."""
    m = _RUN.fullmatch(name) if isinstance(name, str) else None
    if m is None or int(m.group("seed")) > _MAX_SEED:
        shown = repr(name)[:80]
        raise RunNameError(f"{flag} {shown} is not a run name: it must be <method>-s<seed>, a method name of at most "
                           f"64 characters [a-z0-9_-] and a seed from 0 to {_MAX_SEED} in digits, e.g. jagg-s0.")
    return m.group("method"), int(m.group("seed"))


def inside(root: str | Path, given: str | Path, flag: str, *, kind: str) -> Path:
    """The one rule for a path argument: ``given`` (relative to the project ``root``) resolves inside the project, and
    is of ``kind`` — ``"dir"`` (a folder, or nothing yet) or ``"file"`` (a file, or nothing yet, in a folder or where
    one can be made) — else one sentence naming the argument. Returns the resolved path."""
    root = Path(root).resolve()
    path = (root / given).resolve()
    if not path.is_relative_to(root) or path == root and kind == "file":
        raise PathRuleError(f"{flag} {str(given)[:200]!r} leads outside the project ({root}); pass a path inside it.")
    if kind == "dir" and path.exists() and not path.is_dir():
        raise PathRuleError(f"{flag} {str(given)[:200]!r} is a file, not a folder; pass a folder.")
    if kind == "file" and path.exists() and not path.is_file():
        raise PathRuleError(f"{flag} {str(given)[:200]!r} is not a regular file (a folder?); pass a file name.")
    for parent in path.parents:
        if parent == root:
            break
        if parent.exists() and not parent.is_dir():
            raise PathRuleError(f"{flag} {str(given)[:200]!r} goes through {parent.relative_to(root)}, a file, not a "
                                f"folder; pass another path.")
    return path


@dataclass(frozen=True)
class Layout:
    """The profile's prompt set and base model under ``<profile>``; its runs, checkpoints, evaluations and report under
    ``outputs`` (the profile's name, or a sweep point's own name when a flow ran with parameter overrides)."""

    root: Path
    profile: str
    outputs: str = ""
    split: str = "test"  # eval.split: the held-out split evaluations read and write (validation: eval-validation/)

    def __post_init__(self) -> None:
        if not self.outputs:
            object.__setattr__(self, "outputs", self.profile)

    @classmethod
    def of(cls, params, root: Path) -> "Layout":  # noqa: ANN001  (Params; paths stays free of config imports)
        return cls(Path(root), params.profile, params.outputs or params.profile, params.eval.split)

    @property
    def prompts(self) -> Path:
        return self.root / "data" / self.profile / "prompts"

    @property
    def train_prompts(self) -> Path:
        return self.prompts / "train.jsonl"

    @property
    def benchmark(self) -> Path:
        return self.prompts / "benchmark"

    @property
    def validation_prompts(self) -> Path:
        """The toy world's validation split, in the test split's layout (``benchmark/``, ``test.json``)."""
        return self.prompts / "validation"

    @property
    def held_out(self) -> Path:
        """The prompt folder of the split evaluations read: the test split's, or validation's."""
        return self.validation_prompts if self.split == "validation" else self.prompts

    @property
    def base_model(self) -> Path:
        return self.root / "models" / self.profile / "base"

    def checkpoints(self, run: str) -> Path:
        return self.root / "checkpoints" / self.outputs / run

    def run_dir(self, run: str) -> Path:
        return self.root / "runs" / self.outputs / run

    def curve(self, run: str) -> Path:
        return self.run_dir(run) / "curve.tsv"

    @property
    def speed(self) -> Path:
        """Every method's update stage timed side by side (the `speed` stage; the report's speed table)."""
        return self.root / "runs" / self.outputs / "speed.json"

    def eval_dir(self, run: str) -> Path:
        return self.root / ("eval-validation" if self.split == "validation" else "eval") / self.outputs / run

    @property
    def report_dir(self) -> Path:
        return self.root / "reports" / self.outputs
