"""Where every stage reads and writes, per profile (the same layout for dvc.yaml, the flows and the CLI)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from jagg_core.errors import UserError

__all__ = ["Layout", "PathRuleError", "RunNameError", "held", "hold", "inside", "parse_run_name", "run_name"]

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
    hold(root)
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


# The project roots this process reads and writes in (each Layout's, each root a path argument was checked against),
# as given and resolved: a path lexically inside one must resolve inside it (:func:`held`).
_ROOTS: dict[Path, Path] = {}


def hold(root: str | Path) -> None:
    """Hold the process's reads and writes under ``root`` inside it: :func:`held` (the storage door's writers call it)
    refuses a path below ``root`` that a symbolic link leads out of."""
    given = Path(os.path.abspath(root))
    _ROOTS.setdefault(given, Path(os.path.realpath(given)))


def held(path: str | Path) -> Path:
    """``path`` itself where it is not below a held project root (:func:`hold`: a temporary folder, the user's cache)
    or resolves inside the root it is below; else one :class:`PathRuleError` naming the link that leads out
    (`ln -s /elsewhere checkpoints/ci-lnk` then `--set outputs=ci-lnk` wrote the weights outside the project)."""
    p = Path(os.path.abspath(path))
    for given, real in list(_ROOTS.items()):
        base = given if p.is_relative_to(given) else real if p.is_relative_to(real) else None
        if base is None or Path(os.path.realpath(p)).is_relative_to(real):
            continue
        link = next((base / Path(*p.relative_to(base).parts[:k]) for k in range(1, len(p.relative_to(base).parts) + 1)
                     if (base / Path(*p.relative_to(base).parts[:k])).is_symlink()), p)
        raise PathRuleError(f"{link} is a symbolic link leading outside the project ({real}), to "
                            f"{os.path.realpath(link)}; jagg reads and writes only inside the project: remove the "
                            f"link or choose another folder.")
    return Path(path)


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
        hold(self.root)
        # every folder a stage writes into, held inside the project before any stage reads or writes (its deeper
        # folders: by the accessors below and storage's writers)
        for top in ("data", "models"):
            held(self.root / top / self.profile)
        for top in ("checkpoints", "runs", "eval", "eval-validation", "reports"):
            held(self.root / top / self.outputs)

    @classmethod
    def of(cls, params, root: Path) -> "Layout":  # noqa: ANN001  (Params; paths stays free of config imports)
        return cls(Path(root), params.profile, params.outputs or params.profile, params.eval.split)

    @property
    def prompts(self) -> Path:
        return held(self.root / "data" / self.profile / "prompts")

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
        return held(self.root / "models" / self.profile / "base")

    def checkpoints(self, run: str) -> Path:
        return held(self.root / "checkpoints" / self.outputs / run)

    def run_dir(self, run: str) -> Path:
        return held(self.root / "runs" / self.outputs / run)

    def curve(self, run: str) -> Path:
        return self.run_dir(run) / "curve.tsv"

    @property
    def speed(self) -> Path:
        """Every method's update stage timed side by side (the `speed` stage; the report's speed table)."""
        return held(self.root / "runs" / self.outputs / "speed.json")

    def eval_dir(self, run: str) -> Path:
        return held(self.root / ("eval-validation" if self.split == "validation" else "eval") / self.outputs / run)

    @property
    def report_dir(self) -> Path:
        return held(self.root / "reports" / self.outputs)
