"""A stage entry runs only in the project's environment (tasks/__init__.py): DVC runs `python -m tasks.<stage>` with
whichever `python` is first on PATH, and a system Python that held numpy and PyYAML rewrote the prompts and the base
model before failing on MLflow's import (issue 70). Another interpreter is refused in one sentence that says how to
run the stage, before anything is written; this suite's own interpreter (the project's .venv) runs every stage."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# every stage a DVC pipeline runs (pipelines/template.yaml), with the arguments its command gives it
STAGES = [["tasks.prepare"], ["tasks.pretrain"], ["tasks.train", "--method", "jagg", "--seed", "0"],
          ["tasks.evaluate", "--run", "base"], ["tasks.speed"], ["tasks.report"]]


def _fresh_venv(folder: Path) -> str:
    """A Python environment of this very interpreter without the project installed in it (no pip: seconds)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    return str(folder / "bin" / "python")


def _snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


@pytest.mark.parametrize("python", ["/usr/bin/python3", "a fresh venv"])
def test_a_stage_started_by_another_python_is_refused_in_one_sentence_with_nothing_written(python, tmp_path):
    if python == "a fresh venv":
        python = _fresh_venv(tmp_path / "venv")
    elif not Path(python).is_file() or Path(python).resolve() == Path(sys.executable).resolve():
        pytest.skip(f"{python} is not another interpreter here")
    root = tmp_path / "project"
    root.mkdir()
    (root / "params.yaml").write_bytes((REPO / "params.yaml").read_bytes())
    before = _snapshot(root)
    env = dict(os.environ, JAGG_ROOT=str(root), PYTHONPATH=str(REPO))  # the checkout's stages importable there
    for stage in STAGES:
        out = subprocess.run([python, "-m", *stage, "--profile", "ci"], cwd=root, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 1, (stage, out.stderr[-2000:])
        assert out.stdout == "" and out.stderr.count("\n") == 1, (stage, out.stderr[-2000:])
        line = out.stderr.strip()
        assert line.startswith(f"jagg: error: {python} is not the project's Python") and line.endswith(
            "activate the project's environment (`source .venv/bin/activate`, built by `make setup`) or run the "
            "pipeline with `make repro`."), line
        assert line.count(". ") == 0, line  # one sentence
    assert _snapshot(root) == before  # nothing written


def test_the_projects_python_passes_the_check():
    """The suite's interpreter (what CI, `make repro`, Prefect's and accelerate's workers run) imports the stages."""
    out = subprocess.run([sys.executable, "-c", "import tasks.common"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
