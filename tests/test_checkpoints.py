"""A checkpoint proves itself or is not used (jagg_core/trainer/checkpoint.py): a damaged one (truncated, altered, a
manifest that does not prove it, a huge manifest) is skipped and resume falls back to the one before, a writer killed
mid-swap loses nothing, no usable checkpoint is an error and never a silent restart; what is saved is finite, a full
disk keeps the previous one, and what is loaded runs no code."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_module
from fault_helpers import _ckpts, ci
from jagg_core.trainer import CheckpointError, latest_checkpoint, list_checkpoints, train
from jagg_core.trainer.checkpoint import save_checkpoint


# --- a damaged checkpoint: skipped, resume falls back, never a silent restart --------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "alter", "no-manifest"])
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(ci_project, damage, caplog):
    params = ci(ci_project, **{"train.iterations": 2, "train.checkpoint_every": 1})
    train(params, "jagg", 0, root=ci_project, progress=False)
    last = _ckpts(ci_project) / "checkpoint-000002"
    f = last / "trainable.safetensors"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "alter":
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))
    else:
        (last / "manifest.json").unlink()
    with caplog.at_level("WARNING"):
        found = latest_checkpoint(_ckpts(ci_project))
    assert found is not None and found.iteration == 1
    assert "damaged checkpoint" in caplog.text
    # training resumes from the good one and rewrites iteration 2
    res = train(params, "jagg", 0, root=ci_project, progress=False)
    assert [h["iteration"] for h in res.history] == [2]
    assert latest_checkpoint(_ckpts(ci_project)).iteration == 2


def test_a_writer_killed_mid_swap_leaves_nothing_lost_or_stale(ci_project, caplog):
    """A kill between the swap's two renames leaves the only copy of a checkpoint in ``.trash-*``; a kill mid-write
    leaves ``.tmp-*``. The next start puts the copy back, deletes the partial write, and resumes from the former."""
    import os as _os

    params = ci(ci_project, **{"train.iterations": 2, "train.checkpoint_every": 1, "train.keep_checkpoints": 5})
    train(params, "jagg", 0, root=ci_project, progress=False)
    root = _ckpts(ci_project)
    _os.replace(root / "checkpoint-000002", root / ".trash-checkpoint-000002-4242")  # swap killed after rename 1
    partial = root / ".tmp-checkpoint-000003-x1y2"
    partial.mkdir()
    (partial / "trainable.safetensors").write_bytes(b"half")
    spare = root / ".trash-checkpoint-000001-77"  # a finished swap whose trash was never deleted
    shutil.copytree(root / "checkpoint-000001", spare)
    with caplog.at_level("WARNING"):
        res = train(params, "jagg", 0, root=ci_project, progress=False)
    assert not res.history  # already at iteration 2: nothing to redo
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-000001", "checkpoint-000002"]
    assert latest_checkpoint(root).iteration == 2
    assert "restored checkpoint-000002" in caplog.text and "deleted the interrupted write" in caplog.text


def test_no_usable_checkpoint_is_a_clear_error_not_a_silent_restart(ci_project):
    params = ci(ci_project, **{"train.iterations": 1})
    train(params, "jagg", 0, root=ci_project, progress=False)
    (_ckpts(ci_project) / "checkpoint-000001" / "optimizer.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        train(params, "jagg", 0, root=ci_project, progress=False)


def _checkpoints(root: Path):
    import torch

    from jagg_core.trainer.checkpoint import save_checkpoint

    for it in (1, 2):
        save_checkpoint(root, it, trainable={"w": torch.full((4, 4), float(it))}, optimizer={"step": it},
                        state={"run_key": "k"}, keep=4)
    return root / "checkpoint-000002"


def _rematch(ckpt: Path, drop: str | None = None) -> None:
    """Rewrite the manifest to match the folder as it is now (an attacker's or a bug's matching manifest)."""
    import json

    from jagg_core.trainer.checkpoint import file_sha256

    manifest = {}
    for p in sorted(ckpt.iterdir()):
        if p.name in ("manifest.json", drop):
            continue
        manifest[p.name] = {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _damage(ckpt: Path, how: str) -> None:
    import torch
    from safetensors.torch import save

    w = ckpt / "trainable.safetensors"
    if how == "list":
        (ckpt / "manifest.json").write_text("[]")
    elif how == "empty":
        (ckpt / "manifest.json").write_text("{}")
    elif how == "no-weights-entry":
        w.write_bytes(save({"w": torch.full((4, 4), 7.0)}))
        _rematch(ckpt, drop="trainable.safetensors")
    elif how == "huge-header":
        w.write_bytes((2 ** 62).to_bytes(8, "little") + b"{}")
        _rematch(ckpt)
    elif how == "symlink-passwd":
        w.unlink()
        w.symlink_to("/etc/passwd")
        _rematch(ckpt)
    elif how == "nan-weights":
        w.write_bytes(save({"w": torch.full((4, 4), float("nan"))}))
        _rematch(ckpt)
    elif how == "unlisted-file":
        (ckpt / "extra.bin").write_bytes(b"x")
    elif how == "entry-without-digest":
        import json

        (ckpt / "manifest.json").write_text(json.dumps({"state.json": {}, "trainable.safetensors": {}}))
    elif how == "dev-zero":  # a listed entry that is a symlink to /dev/zero (size 0 by stat): hashing never ended
        import hashlib
        import json

        o = ckpt / "optimizer.pt"
        o.unlink()
        o.symlink_to("/dev/zero")
        manifest = json.loads((ckpt / "manifest.json").read_text())
        manifest["optimizer.pt"] = {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}
        (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("how", ["list", "empty", "no-weights-entry", "huge-header", "symlink-passwd", "nan-weights",
                                 "unlisted-file", "entry-without-digest", "dev-zero"])
def test_a_checkpoint_whose_manifest_does_not_prove_it_is_skipped_and_resume_falls_back(how, tmp_path):
    from jagg_core.trainer.checkpoint import latest_checkpoint, verify_checkpoint

    ckpt = _checkpoints(tmp_path / "ckpts")
    assert verify_checkpoint(ckpt) is None
    _damage(ckpt, how)
    problem = verify_checkpoint(ckpt)
    assert problem, how
    assert "\n" not in problem
    assert latest_checkpoint(tmp_path / "ckpts").iteration == 1  # the previous one, never a traceback


def test_m2_a_huge_sparse_manifest_is_refused_before_it_is_read(tmp_path):
    """`manifest.json` was read whole and then cut at 16 MiB (a 2 GB sparse file cost 2.7 GB of memory). Now its
    size is checked on the open file first: a 64 MiB sparse manifest costs no memory and is "unreadable"."""
    import tracemalloc

    from jagg_core.trainer.checkpoint import verify_checkpoint

    ckpt = tmp_path / "checkpoint-000001"
    ckpt.mkdir()
    with open(ckpt / "manifest.json", "wb") as f:
        f.truncate(64 << 20)  # sparse: no disk used
    tracemalloc.start()
    try:
        why = verify_checkpoint(ckpt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert why is not None and why.startswith("unreadable manifest") and "larger than" in why, why
    assert peak < 4 << 20, peak


# --- what is saved, and how it is loaded ---------------------------------------------------------------------------


def test_nan_weights_are_never_saved(tmp_path):
    with pytest.raises(CheckpointError, match="not finite"):
        save_checkpoint(tmp_path, 1, trainable={"w": torch.tensor([1.0, float("nan")])}, optimizer=None, state={})
    assert list(tmp_path.iterdir()) == []


def test_disk_full_while_checkpointing_keeps_the_previous_checkpoint(ci_project, monkeypatch):
    params = ci(ci_project, **{"train.iterations": 2, "train.checkpoint_every": 1})
    monkeypatch.setenv("JAGG_FAULT", "checkpoint@2:oserror")
    with pytest.raises(CheckpointError, match="No space left on device.*earlier checkpoints are intact"):
        train(params, "jagg", 0, root=ci_project, progress=False)
    root = _ckpts(ci_project)
    assert [c.iteration for c in list_checkpoints(root)] == [1]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]  # no half-written folder left


@pytest.mark.slow
def test_a_real_full_filesystem(ci_project, tmp_path):
    """A 1 MiB tmpfs mounted as the checkpoint folder (needs root to mount; skipped elsewhere). Mounted there, not
    linked from there: a link leading out of the project is refused (paths.held)."""
    mnt = _ckpts(ci_project)
    mnt.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a size-limited tmpfs here (not root); the injected ENOSPC test covers the logic")
    try:
        params = ci(ci_project, **{"train.iterations": 1})
        with pytest.raises(CheckpointError, match="No space left on device"):
            train(params, "jagg", 0, root=ci_project, progress=False)
        assert not list(mnt.iterdir())
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


class _Exploit:
    """A pickle that runs code when loaded."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_with_a_malicious_pickle_runs_no_code(ci_project, tmp_path):
    """An optimizer.pt that would run a command when unpickled, with a manifest that matches it: loading refuses
    it (weights_only), no code runs, and the run says which file, in one sentence."""
    import hashlib

    params = ci(ci_project, **{"train.iterations": 1})
    train(params, "jagg", 0, root=ci_project, progress=False)
    ckpt = _ckpts(ci_project) / "checkpoint-000001"
    marker = tmp_path / "pwned"
    torch.save({"state": _Exploit(str(marker))}, ckpt / "optimizer.pt")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["optimizer.pt"] = {"bytes": (ckpt / "optimizer.pt").stat().st_size,
                                "sha256": hashlib.sha256((ckpt / "optimizer.pt").read_bytes()).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--worker", "--set",
                     "train.iterations=2", "--set", "reward.weights={jpeg_compressibility: 1.0}", root=ci_project)
    assert not marker.exists()  # no code ran
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("jagg: error:")]
    assert out.returncode == 1 and len(lines) == 1 and "optimizer.pt" in lines[0], out.stderr[-2000:]


def test_weights_are_loaded_only_with_safetensors_or_weights_only():
    offenders = []
    for path in (REPO / "jagg_core").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"torch\.load\(", line) and "weights_only=True" not in line:
                offenders.append(f"{path.relative_to(REPO)}:{n}")
            if re.search(r"\bpickle\.load|\bnp\.load\(.*allow_pickle=True", line):
                offenders.append(f"{path.relative_to(REPO)}:{n}")
    assert offenders == []
