"""Paths and names a user gives: one parser for run names, one rule for path arguments (inside the project; a folder or
a file as the argument names), checked before any work; a profile's stages write only that profile's folders."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from conftest import run_module
from fault_helpers import PARAMS, _one_sentence


# --- run names and style names -------------------------------------------------------------------------------------


def test_style_names_cannot_escape_the_output_folder(tmp_path):
    from jagg_core.evaluation import load_hps_benchmark

    (tmp_path / "benchmark").mkdir()
    for style in ("../evil", "a/b", "..", "UPPER"):
        with pytest.raises(ValueError, match="style name"):
            load_hps_benchmark(tmp_path, styles=[style])


@pytest.mark.parametrize("name", ["jagg-s0\n", "jagg-s\u0663", "jagg-s" + "9" * 20, "jagg-s2147483648",
                                  "../../../esc/x-s0", "jagg-s007", "JAGG-s0", "x" * 65 + "-s0", "jagg-s-1", ""])
def test_c4_one_parser_for_run_names(name):
    """`evaluate --run` and `export --run` read a run name with one parser, which takes exactly what `run_name` writes
    for a method and a seed that run.methods and --seed accept (a trailing newline, non-ASCII digits and 20-digit
    seeds passed Python's `$` and `\\d`; `../../../esc/x-s0` exported a checkpoint from outside the project)."""
    from jagg_core.errors import UserError
    from jagg_core.setup.paths import parse_run_name

    with pytest.raises(UserError, match="is not a run name") as e:
        parse_run_name(name)
    _one_sentence(str(e.value))
    assert parse_run_name("jagg-s0") == ("jagg", 0)
    assert parse_run_name("ablate-matched-s2147483647") == ("ablate-matched", 2**31 - 1)


def test_c4_evaluate_and_export_refuse_what_is_not_a_run_and_open_no_mlflow_run(tmp_path):
    """Before any work and before an MLflow run exists (evaluate made a FAILED run for each such name)."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(PARAMS, root / "params.yaml")
    for module, name in [("tasks.evaluate", "jagg-s0\n"), ("tasks.evaluate", "jagg-s" + "1" * 20),
                         ("tasks.export", "../../../esc/x-s0")]:
        out = run_module(module, "--profile", "ci", "--run", name, root=root, timeout=300)
        assert out.returncode == 1, out.stderr[-2000:]
        assert "is not a run name" in _one_sentence(out.stderr.removeprefix("jagg: error: ")), out.stderr
    assert sorted(p.name for p in root.iterdir()) == ["params.yaml"]  # no mlflow.db, no exports/, nothing


# --- path arguments follow one rule, before any work ---------------------------------------------------------------


@pytest.mark.parametrize("args, says", [
    (["tasks.report", "--base-grid", "/tmp/jagg-r5-grid.png"], "--base-grid '/tmp/jagg-r5-grid.png' leads outside"),
    (["tasks.report", "--base-grid", "../grid.png"], "leads outside the project"),
    (["tasks.report", "--base-grid", "data"], "is not a regular file"),
    (["tasks.report", "--base-grid", "params.yaml/x.png"], "goes through params.yaml, a file"),
    (["tasks.report", "--copy-to", "params.yaml"], "--copy-to 'params.yaml' is a file, not a folder"),
    (["tasks.report", "--copy-to", "/"], "leads outside the project"),
    (["tasks.bench", "--no-mlflow", "--main-job", "/etc"], "--main-job '/etc' leads outside the project"),
    (["tasks.bench", "--no-mlflow", "--main-job", "reports/damaged"], "is not a report's summary"),
    (["tasks.bench", "--no-mlflow", "--main-job", "reports/fifo"], "not a regular file"),
])
def test_c4_path_arguments_follow_one_rule(args, says, tmp_path):
    """`report --copy-to` and `--base-grid` wrote anywhere (`--base-grid` made a folder at the filesystem root) and
    gave tracebacks onto a file or a folder; `bench --main-job` read any folder and gave a traceback on a damaged
    summary.json. One rule (inside the project; a folder or a file as the argument names), one sentence, exit 1,
    nothing written."""
    root = tmp_path / "project"
    (root / "data").mkdir(parents=True)
    shutil.copy(PARAMS, root / "params.yaml")
    (root / "reports" / "damaged").mkdir(parents=True)
    (root / "reports" / "damaged" / "summary.json").write_text('[{"iteration_breakdown": 1}]')
    (root / "reports" / "fifo").mkdir()
    os.mkfifo(root / "reports" / "fifo" / "summary.json")
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    out = run_module(*args[:1], "--profile", "ci", *args[1:], root=root, timeout=120)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert says in _one_sentence(out.stderr.removeprefix("jagg: error: ")), out.stderr
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
    assert not Path("/tmp/jagg-r5-grid.png").exists()


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


BENCH_FAST = ["--no-mlflow", "--windows", "2", "--fracs", "1", "--repeats", "1", "--steps", "2", "--batch", "1",
              "--no-memory", "--no-comm", "--threads", "1"]


@pytest.mark.parametrize("args, says", [
    (["--out", "../b"], "--out '../b' leads outside the project"),
    (["--write-docs", "../b.md"], "--write-docs '../b.md' leads outside the project"),
    (["--write-docs", "docs"], "--write-docs 'docs' is not a regular file (a folder?)"),
])
def test_m1_bench_out_and_write_docs_follow_the_path_rule_before_the_benchmark(args, says, tmp_path):
    """`bench --out ../b --write-docs ../b.md` wrote outside the project (exit 0); `--write-docs docs` (a folder) was
    an IsADirectoryError after the whole benchmark. Now one sentence, exit 1, before the benchmark runs: nothing
    written inside or outside the project."""
    root = tmp_path / "project"
    (root / "docs").mkdir(parents=True)
    shutil.copy(PARAMS, root / "params.yaml")
    before = _tree(tmp_path)
    out = run_module("tasks.bench", *BENCH_FAST, *args, root=root, timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert says in _one_sentence(out.stderr.removeprefix("jagg: error: ")), out.stderr
    assert _tree(tmp_path) == before  # no bench/ results, no ../b, no ../b.md


@pytest.mark.parametrize("args, says", [
    (["--out", "../s.json"], "--out '../s.json' leads outside the project"),
    (["--write-docs", "../p.md"], "--write-docs '../p.md' leads outside the project"),
])
def test_m1_smoke_out_and_write_docs_follow_the_path_rule_before_the_run(args, says, tmp_path):
    """`jagg smoke --out` and `--write-docs` took any path (the JSON and its markdown written anywhere after the
    run); the same rule as every path argument now, before the run."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(PARAMS, root / "params.yaml")
    before = _tree(tmp_path)
    out = run_module("tasks.smoke", "--device", "cpu", "--iterations", "2", *args, root=root, timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert says in _one_sentence(out.stderr.removeprefix("jagg: error: ")), out.stderr
    assert _tree(tmp_path) == before


# --- a profile's folders are its own -------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["tasks.prepare", "tasks.pretrain", "tasks.train", "tasks.evaluate"])
def test_c3_a_profile_override_cannot_write_into_another_profiles_folders(stage, tmp_path):
    """`jagg prepare --profile ci --set profile=toy` exited 0 and rewrote data/toy/prompts with ci's prompts (train,
    pretrain and evaluate took the same path; only the flows refused a `profile` override). One sentence, exit 1,
    nothing written."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(PARAMS, root / "params.yaml")
    extra = {"tasks.train": ["--method", "jagg"], "tasks.evaluate": ["--run", "jagg-s0"]}.get(stage, [])
    out = run_module(stage, "--profile", "ci", "--set", "profile=toy", *extra, root=root, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "would write profile 'ci'" in _one_sentence(out.stderr.removeprefix("jagg: error: "))
    assert sorted(p.name for p in root.iterdir()) == ["params.yaml"]


# --- no folder a stage writes into leads out of the project (issue 71, item 2) -------------------------------------

# (stage and its arguments, the link planted, relative to the project): each output root every stage writes, at each
# depth a stage names it (the profile's or outputs' folder, a run's, a bench model's rounds)
_CI = ["--profile", "ci", "--set", "outputs=ci-lnk"]
OUTPUT_ROOTS = [
    (["tasks.prepare", "--profile", "ci"], "data/ci/prompts"),
    (["tasks.pretrain", "--profile", "ci"], "models/ci/base"),
    (["tasks.train", *_CI, "--method", "jagg", "--seed", "0"], "checkpoints/ci-lnk"),
    (["tasks.train", *_CI, "--method", "jagg", "--seed", "0"], "runs/ci-lnk"),
    (["tasks.train", "--profile", "ci", "--method", "jagg", "--seed", "0"], "checkpoints/ci/jagg-s0"),
    (["tasks.evaluate", *_CI, "--run", "base"], "eval/ci-lnk"),
    (["tasks.evaluate", "--profile", "ci", "--run", "jagg-s0"], "eval/ci/jagg-s0"),
    (["tasks.speed", *_CI], "runs/ci-lnk"),
    (["tasks.report", *_CI], "reports/ci-lnk"),
    (["tasks.bench", "--profile", "ci", *BENCH_FAST, "--out", "bench-out"], "bench-out/rounds"),
    (["tasks.export", "--profile", "ci", "--run", "jagg-s0", "--out", "exports/lnk"], "exports/lnk"),
]


@pytest.mark.parametrize("command, planted", OUTPUT_ROOTS, ids=[f"{c[0]}:{p}" for c, p in OUTPUT_ROOTS])
def test_a_link_at_any_output_root_leading_out_is_refused_and_nothing_is_written_outside(command, planted, tmp_path):
    """`ln -s <outside> checkpoints/ci-lnk` then `jagg train --set outputs=ci-lnk` wrote the weights outside the
    project (rc 0), and so did an evaluation's images, a report and a bench's rounds; only export checked its folder.
    Now every folder a stage reads or writes is held inside the project (paths.held, at Layout's folders and in
    storage's writers): one sentence naming the link, exit 1, nothing written outside."""
    root, outside = tmp_path / "project", tmp_path / "outside"
    outside.mkdir()
    (root / planted).parent.mkdir(parents=True)
    shutil.copy(PARAMS, root / "params.yaml")
    os.symlink(outside, root / planted)
    out = run_module(*command, root=root, timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    said = _one_sentence(out.stderr.removeprefix("jagg: error: "))
    assert "leads outside the project" in said or "leading outside the project" in said, said
    assert list(outside.iterdir()) == []


def test_storage_writers_refuse_a_folder_a_link_leads_out_of_at_any_depth(tmp_path):
    """Below a stage's output roots (a step's images folder, a checkpoint's), storage's writers hold a project's
    paths inside it: a write, an append, a lock, a temporary folder, a rename and a copied tree through a link that
    leads out are one sentence, nothing made outside; a link that stays inside is followed, a path outside every
    project (a temporary file, the user's cache) is written as before."""
    from jagg_core.setup import storage
    from jagg_core.setup.paths import Layout, PathRuleError

    root, outside = tmp_path / "project", tmp_path / "outside"
    outside.mkdir()
    lay = Layout(root, "ci")
    deep = root / "eval" / "ci" / "base" / "step-000000"
    deep.mkdir(parents=True)
    os.symlink(outside, deep / "images")
    (root / "src").mkdir()
    (root / "src" / "f").write_bytes(b"x")
    for write in (lambda: storage.atomic_write_bytes(deep / "images" / "anime" / "00000.jpg", b"x"),
                  lambda: storage.append_bytes(deep / "images" / "log", b"x", OSError),
                  lambda: storage.open_lock_file(deep / "images" / ".lock", OSError),
                  lambda: storage.temp_dir(deep / "images", ".tmp-"),
                  lambda: storage.move(root / "src" / "f", deep / "images" / "f"),
                  lambda: storage.copy_tree(root / "src", deep / "images" / "copy", OSError),
                  lambda: lay.eval_dir("base") and storage.atomic_write_text(deep / "images" / "x.json", "{}")):
        with pytest.raises(PathRuleError, match=r"step-000000/images is a symbolic link leading outside the project"):
            write()
    assert list(outside.iterdir()) == []
    os.symlink(root / "src", deep / "inner")  # inside the project: followed
    storage.atomic_write_bytes(deep / "inner" / "g", b"y")
    assert (root / "src" / "g").read_bytes() == b"y"
    storage.atomic_write_bytes(outside / "free", b"z")  # outside every project: not the rule's
