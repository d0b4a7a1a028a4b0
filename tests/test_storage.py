"""The project's one reader and one writer of files (jagg_core/setup/storage.py) where the stages use them: prompt files
bounded, regular and whole; a FIFO, a device, a folder or a cut file where a stage reads is one sentence at once (or
no marker), never a hang; a link planted where a stage writes is replaced, never written through; a base model's
digest is its content; the folders it makes have their files' permissions. tests/test_storage_door.py checks that
every file touch goes through it; tests/test_fifo_and_link_doors.py has issue 61's instances."""

from __future__ import annotations

import os

import pytest

from conftest import run_module
from fault_helpers import _one_sentence


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
