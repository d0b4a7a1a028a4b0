"""The project's one reader and one writer of files (jagg_core/setup/storage.py) where the stages use them: prompt files
bounded, regular and whole; a FIFO, a device, a folder or a cut file where a stage reads is one sentence at once (or
no marker), never a hang; a link planted where a stage writes is replaced, never written through; a base model's
digest is its content; the folders it makes have their files' permissions. tests/test_storage_door.py checks that
every file touch goes through it; tests/test_fifo_and_link_doors.py has issue 61's instances."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import REPO, run_module
from fault_helpers import PARAMS, _one_sentence
from jagg_core.setup.params_io import load_params


# --- prompt files --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content,fragment", [
    ("{not json", "is not valid JSON"),
    ('{"a": 1}', "must hold a non-empty JSON list of prompt strings"),
    ("[]", "must hold a non-empty JSON list of prompt strings"),
    ('["ok", 3]', "must hold a non-empty JSON list of prompt strings"),
])
def test_bad_prompt_files_are_refused_and_nothing_is_written(ci_project, content, fragment):
    (ci_project / "data/ci/prompts/benchmark/single.json").write_text(content)
    out = run_module("tasks.evaluate", "--profile", "ci", "--run", "base", root=ci_project)
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("jagg: error:")]
    assert len(lines) == 1 and fragment in lines[0], out.stderr
    assert not (ci_project / "eval").exists()


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "folder", "huge"])
def test_c5_prompt_files_are_bounded_regular_files(kind, tmp_path):
    """`train.jsonl` as a symlink to /dev/zero was read until killed (memory growing), a FIFO hung, a folder was an
    IsADirectoryError traceback. Now one sentence each, at once."""
    import time

    from jagg_core.setup.storage import MAX_READ_BYTES, PromptFileError, read_prompts

    path = tmp_path / "train.jsonl"
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        with open(path, "wb") as f:
            f.truncate(MAX_READ_BYTES + 1)  # sparse: no disk used
    t0 = time.monotonic()
    with pytest.raises(PromptFileError) as e:
        read_prompts(path)
    assert time.monotonic() - t0 < 5
    text = _one_sentence(str(e.value))
    assert str(path) in text and ("regular file" in text or "folder" in text or "larger than" in text), text


# --- every file a stage reads is bounded and regular ---------------------------------------------------------------


def _write_eval(root: Path, outputs: str, run: str, value: float, step: int = 4) -> Path:
    """An evaluation of ``run`` as `jagg evaluate` writes it (images, scores.jsonl, metrics.json); returns the step's
    folder."""
    from PIL import Image

    step_dir = root / "eval" / outputs / run / "steps" / f"{step:06d}"
    rows = []
    for style in ("count", "single"):
        (step_dir / "images" / style).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (24, 24), (200, 10 * i, 0)).save(step_dir / "images" / style / f"{i:05d}.jpg")
            rows.append({"style": style, "index": i, "prompt": f"a red {style} {i}", "toy_fidelity": value})
    (step_dir / "scores.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    card = {"run": run, "step": step, "metrics": {"toy_fidelity": {"benchmark": value, "styles": {}}},
            "curve": [{"step": step, "eval/toy_fidelity": value}], "images": str((step_dir / "images").relative_to(root))}
    (root / "eval" / outputs / run / "metrics.json").write_text(json.dumps(card))
    return step_dir


REP = {"profile": "rep", "run.methods": ["jagg"], "run.seeds": [0], "eval.metrics": ["toy_fidelity"]}


REP_ARGS = ["--profile", "toy", "--set", "profile=rep", "--set", "run.methods=[jagg]", "--set", "run.seeds=[0]",
            "--set", "eval.metrics=[toy_fidelity]"]


def _evaluated_project(root: Path) -> Path:
    """A project with the base model's and one run's evaluations of the scratch profile ``rep`` (no training)."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(PARAMS, root / "params.yaml")
    _write_eval(root, "rep", "base", 0.2, step=0)
    _write_eval(root, "rep", "jagg-s0", 0.3)
    curve = root / "runs" / "rep" / "jagg-s0" / "curve.tsv"
    curve.parent.mkdir(parents=True)
    curve.write_text("iteration\ttime/update\ttime/iteration\treward/mean\n" +
                     "".join(f"{i}\t1.5\t3.0\t0.{i}\n" for i in range(1, 5)))
    return root


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind, says", [
    ("fifo", "not a regular file"),
    ("dev-zero", "not a regular file"),
    ("cut", "line 4 is not one image's scores"),
    ("folder", "is a folder, not a file"),
])
def test_m2_an_evaluations_scores_jsonl_is_read_bounded_and_whole(kind, says, tmp_path):
    """`eval/…/steps/N/scores.jsonl` as a FIFO hung `report`, as a link to /dev/zero read until a MemoryError (4.9
    GB), cut short was a JSONDecodeError traceback, a folder an IsADirectoryError. Now one sentence naming the file
    and what to run, at once, from the report's every reader of it (the intervals over prompts, the image grid)."""
    import time

    from jagg_core.pipeline.report import ReportError, _Run, read_eval
    from jagg_core.pipeline.report_figures import comparison_grid
    from jagg_core.pipeline.report_stats import prompt_intervals
    from jagg_core.setup.paths import Layout

    root = _evaluated_project(tmp_path / "project")
    scores = root / "eval" / "rep" / "base" / "steps" / "000000" / "scores.jsonl"
    text = scores.read_text()
    scores.unlink()
    if kind == "fifo":
        os.mkfifo(scores)
    elif kind == "dev-zero":
        scores.symlink_to("/dev/zero")
    elif kind == "cut":
        scores.write_text(text[: len(text) - 20])
    else:
        scores.mkdir()
    params = load_params(PARAMS, "toy", REP)
    lay = Layout.of(params, root)
    runs = [_Run("jagg", 0, [], read_eval(lay.eval_dir("jagg-s0") / "metrics.json"))]
    t0 = time.monotonic()
    for read in (lambda: prompt_intervals(lay, runs, ["toy_fidelity"], params.eval.protocol, []),
                 lambda: comparison_grid(params, lay, runs, tmp_path / "grid.png")):
        with pytest.raises(ReportError) as e:
            read()
        text = _one_sentence(e.value)
        assert str(scores) in text and says in text and "jagg evaluate --run base" in text, text
    assert time.monotonic() - t0 < 10


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["fifo", "cut"])
def test_m2_a_damaged_generation_json_is_no_marker_not_a_hang_or_a_traceback(kind, ci_project):
    """`steps/N/generation.json` (what a step's images were made from) as a FIFO hung `evaluate`; cut short it was a
    JSONDecodeError traceback. A marker that cannot be read vouches for nothing: the images are made again and the
    marker rewritten whole."""
    marker = ci_project / "eval" / "ci" / "base" / "steps" / "000000" / "generation.json"
    marker.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(marker)
    else:
        marker.write_text('{"weights": null, "base_model": "0123')
    out = run_module("tasks.evaluate", "--profile", "ci", "--run", "base", "--set", "eval.num_images_logged=0",
                     root=ci_project, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    assert marker.is_file() and not marker.is_symlink() and json.loads(marker.read_text())["num_steps"] == 4


@pytest.mark.timeout(30)
def test_m2_a_fifo_at_the_base_models_card_does_not_hang_pretrain(tmp_path):
    """`models/<p>/base/card.json` as a FIFO hung `pretrain` (it reads the card to decide whether the saved base is
    of the same recipe). A card that cannot be read is no card: not the same recipe, so the base is made again and
    its card written whole (replacing the FIFO)."""
    from tasks.pretrain import _same_recipe

    card = tmp_path / "models" / "ci" / "base" / "card.json"
    card.parent.mkdir(parents=True)
    os.mkfifo(card)
    assert _same_recipe(card, load_params(PARAMS, "ci")) is False


@pytest.mark.timeout(30)
def test_m2_a_fifo_at_speed_json_does_not_hang_jagg_run_after_done(tmp_path):
    """`runs/<p>/speed.json` as a FIFO hung `jagg run` after it printed "done" (its speed line read the file with a
    plain `read_text`). Now the line says there is no measurement, at once."""
    from flows.run import _speed_line
    from jagg_core.setup.paths import Layout

    lay = Layout(tmp_path, "ci")
    lay.speed.parent.mkdir(parents=True)
    os.mkfifo(lay.speed)
    assert "no side-by-side speed measurement" in _speed_line(load_params(PARAMS, "ci"), lay)


def test_m2_params_are_read_by_the_projects_one_bounded_reader(tmp_path):
    """`params_io` had its own bounded read beside `storage.read_regular`; they are one function now: no other
    module of the project opens a file without blocking, and a params FIFO is that function's sentence."""
    import re

    own = [str(p.relative_to(REPO)) for d in ("jagg_core", "tasks", "flows") for p in (REPO / d).rglob("*.py")
           if re.search(r"O_NONBLOCK", p.read_text(encoding="utf-8"))]
    assert own == ["jagg_core/setup/storage.py"], own
    fifo = tmp_path / "params.yaml"
    os.mkfifo(fifo)
    from jagg_core.setup.config import ParamsError

    with pytest.raises(ParamsError) as e:
        load_params(fifo, "ci")
    assert "is not a regular file (a device, a FIFO or a socket); pass --params" in _one_sentence(e.value)


# --- writes follow no planted link ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_m1_report_copy_to_replaces_a_planted_link_instead_of_writing_through_it(tmp_path):
    """`report --copy-to reports/cp` with `reports/cp/summary.json` a symlink to a file elsewhere: the copy was
    written through the link into its target (the path rule checks the folder only). Now the link is replaced by
    the copy, its target untouched."""
    root = _evaluated_project(tmp_path / "project")
    victim = tmp_path / "victim.json"  # outside the project, inside the test's folder
    victim.write_text("precious\n")
    (root / "reports" / "cp").mkdir(parents=True)
    (root / "reports" / "cp" / "summary.json").symlink_to(victim)
    out = run_module("tasks.report", *REP_ARGS, "--copy-to", "reports/cp", root=root, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert victim.read_text() == "precious\n"
    copied = root / "reports" / "cp" / "summary.json"
    assert not copied.is_symlink() and copied.read_bytes() == (root / "reports" / "rep" / "summary.json").read_bytes()


# --- content digests; the folders storage makes --------------------------------------------------------------------


def test_the_base_models_digest_is_its_content_not_its_file_times(tmp_path, monkeypatch):
    from jagg_core.setup.storage import folder_digest

    monkeypatch.setenv("JAGG_DIGEST_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "a.safetensors").write_bytes(b"a" * 100)
    (model / "config.json").write_text("{}")
    for limit in (1 << 30, 10):  # hashed as one stream, and file by file (a large model)
        before = folder_digest(model, content_limit=limit)
        os.utime(model / "a.safetensors", (1, 1))  # `touch`
        assert folder_digest(model, content_limit=limit) == before
        (model / "a.safetensors").write_bytes(b"b" * 100)  # same size, other content, then the old time again
        os.utime(model / "a.safetensors", (1, 1))
        assert folder_digest(model, content_limit=limit) != before
        (model / "a.safetensors").write_bytes(b"a" * 100)


def _umask() -> int:
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_m7_checkpoint_folders_have_the_permissions_of_their_files(tmp_path):
    """A checkpoint's folder was 0700 (``mkdtemp``'s) while its files were 0644: another user allowed to read the files
    could not open the folder. Now a folder gets what any folder the process makes gets (0755 under umask 022)."""
    import stat

    import torch

    from jagg_core.trainer.checkpoint import save_checkpoint

    ckpt = save_checkpoint(tmp_path / "ckpts", 1, trainable={"w": torch.zeros(2)}, optimizer=None,
                           state={"run_key": "k"})
    mask = _umask()
    assert stat.S_IMODE(ckpt.path.stat().st_mode) == 0o777 & ~mask
    assert {stat.S_IMODE(f.stat().st_mode) for f in ckpt.path.iterdir()} == {0o666 & ~mask}


def test_m7_the_base_model_folder_has_the_permissions_of_its_files(ci_base):
    """`jagg pretrain`'s models/<profile>/base was 0700 with 0644 files inside (as a checkpoint's)."""
    import stat

    base = ci_base / "models" / "ci" / "base"
    mask = _umask()
    assert stat.S_IMODE(base.stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE((base / "card.json").stat().st_mode) == 0o666 & ~mask
