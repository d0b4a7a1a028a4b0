"""Where every stage reads and writes, per profile (the same layout for dvc.yaml, the flows and the CLI)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Layout", "run_name", "parse_run_name"]

_RUN = re.compile(r"^(?P<method>[a-z0-9][a-z0-9_-]*)-s(?P<seed>\d+)$")


def run_name(method: str, seed: int) -> str:
    """The name of one training run: ``<method>-s<seed>``."""
    return f"{method}-s{seed}"


def parse_run_name(name: str) -> tuple[str, int]:
    m = _RUN.match(name)
    if not m:
        raise ValueError(f"{name!r} is not a run name of the form <method>-s<seed>.")
    return m.group("method"), int(m.group("seed"))


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
