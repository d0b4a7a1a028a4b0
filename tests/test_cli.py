"""The command lines refuse bad input before any work: one sentence, exit 1, nothing written (the stages' `jagg …`
commands and scripts/results_page.py; params themselves: tests/test_config.py; path arguments: tests/test_paths.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_module
from fault_helpers import _one_sentence
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


# --- scripts/results_page.py ---------------------------------------------------------------------------------------


def _script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})


def _refused(out: subprocess.CompletedProcess, *words: str) -> str:
    assert out.returncode != 0, out.stdout[-2000:]
    text = _one_sentence(out.stderr)
    assert all(w in text for w in words), text
    return text


SUMMARY = REPO / "docs" / "results" / "summary.json"  # toy-full's, as `jagg report --copy-to docs/results` wrote it


def _page_inputs(tmp_path: Path) -> dict[str, Path]:
    """toy-full's summary and variants of it, and report READMEs of toy-full and of ci (their first line)."""
    s = json.loads(SUMMARY.read_text())
    files = {"toy-full": SUMMARY}
    (tmp_path / "cut.json").write_text(SUMMARY.read_text()[:3000])
    files["cut"] = tmp_path / "cut.json"
    (tmp_path / "ci.json").write_text(json.dumps({**s, "profile": "ci"}))
    files["ci"] = tmp_path / "ci.json"
    no_jagg = {**s, "final": [r for r in s["final"] if r["method"] != "jagg"],
               "paired": [p for p in s["paired"] if "jagg" not in (p["a"], p["b"])]}
    (tmp_path / "no-jagg.json").write_text(json.dumps(no_jagg))
    files["no-jagg"] = tmp_path / "no-jagg.json"
    for profile in ("toy-full", "ci"):
        (tmp_path / f"{profile}.md").write_text(f"# jagg report — profile `{profile}`\n\nThe report's tables.\n")
        files[f"{profile}.md"] = tmp_path / f"{profile}.md"
    return files


@pytest.mark.parametrize("summary, report, words", [
    ("missing", "toy-full.md", ["does not exist", "jagg report --profile toy-full"]),
    ("cut", "toy-full.md", ["is not whole JSON"]),
    ("ci", "ci.md", ["profile 'ci'", "toy-full"]),
    ("no-jagg", "toy-full.md", ["has no jagg result"]),
    ("toy-full", "ci.md", ["report of profile 'ci'", "toy-full's"]),
])
def test_m6_results_page_refuses_a_summary_or_report_it_cannot_write_from(tmp_path, summary, report, words):
    """scripts/results_page.py: a missing, cut or ci summary and one without jagg ended in tracebacks
    (FileNotFoundError, JSONDecodeError, KeyError); toy-full's summary with ci's README wrote a mixed page, rc 0. Now
    one sentence, exit 1, and no page written."""
    files = _page_inputs(tmp_path)
    page = tmp_path / "results.md"
    out = _script("results_page.py", "--summary", str(files.get(summary, tmp_path / "none.json")), "--report",
                  str(files[report]), "--wall", "1 min", "--date", "2026-01-01", "--commit", "abc", "--out", str(page),
                  cwd=tmp_path)
    _refused(out, *words)
    assert not page.exists()


def test_m6_results_page_still_writes_toy_full_s_page(tmp_path):
    files = _page_inputs(tmp_path)
    page = tmp_path / "results.md"
    out = _script("results_page.py", "--summary", str(files["toy-full"]), "--report", str(files["toy-full.md"]),
                  "--wall", "1 min", "--date", "2026-01-01", "--commit", "abc", "--out", str(page), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "**The verdict.**" in page.read_text() and "The report's tables." in page.read_text()
