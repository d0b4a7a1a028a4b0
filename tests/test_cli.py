"""The command lines refuse bad input before any work: one sentence, exit 1, nothing written (the stages' `jagg …`
commands and scripts/results_page.py; params themselves: tests/test_config.py; path arguments: tests/test_paths.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import run_module
from jagg_core.setup.paths import Layout


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("override,fragment", [
    ("run.methods=[baseline, fast]", "run.methods names 'fast'"),
    ("methods.jagg.mode=fast", "methods.jagg.mode = 'fast' is invalid"),
    ("jagg.jagg_frac=-0.1", "jagg_frac must be a number in [0, 1] or 'auto'"),
    ("jagg.anchors=5", "anchors (5) cannot exceed the window (3)"),
    ("sample.group_size=1", "sample.group_size = 1 is invalid"),
    ("train.lr=-1", "train.lr = -1 is invalid"),
    ("eval.metrics=[fid]", "unknown metric 'fid'"),
    ("model.lora={rank: two}", "model.lora.rank = 'two' is invalid"),
])
def test_bad_params_are_refused_before_any_work(ci_project, override, fragment):
    before = _files(ci_project)
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--set", override, root=ci_project)
    assert out.returncode == 1, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], out.stderr
    assert _files(ci_project) == before


def test_an_unknown_method_or_profile_is_refused(ci_project):
    for args, fragment in ([("--method", "fast"), "unknown method 'fast'"], [("--profile", "nope", "--method", "jagg"),
                                                                             "unknown profile 'nope'"]):
        out = run_module("tasks.train", *(args if args[0] == "--profile" else ("--profile", "ci", *args)),
                         root=ci_project)
        assert out.returncode == 1 and fragment in out.stderr, out.stderr


def test_missing_or_incomplete_model_weights_are_one_sentence(ci_project):
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--set", "model.path=/nowhere",
                     root=ci_project)
    assert out.returncode == 1 and "the toy-flux model folder /nowhere does not exist" in out.stderr, out.stderr
    shutil.rmtree(ci_project / "models/ci/base/transformer")
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", root=ci_project)
    assert out.returncode == 1 and "transformer/config.json is missing" in out.stderr, out.stderr
    assert not Layout(ci_project, "ci").checkpoints("jagg-s0").exists()
