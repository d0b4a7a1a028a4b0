"""Issue 61, mechanism 1: each place a planted link was written through, or a FIFO (or an unbounded file) was read
until it hung, now goes through storage.py and answers in one sentence. Each test calls the library function itself,
in a daemon thread with a deadline: a call that blocks fails the test instead of hanging the suite."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

import pytest

from test_storage_door import within

REPO = Path(__file__).resolve().parents[1]


def _precious(tmp_path: Path) -> Path:
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    target.write_text("precious\n")
    return target


def test_folder_lock_refuses_a_planted_link_and_a_fifo(tmp_path):
    """`ln -s <elsewhere> runs/lk/jagg-s0/.lock`: the lock truncated the link's target and wrote "pid … on …" in it."""
    from jagg_core.setup.storage import FolderLock, LockedError

    target = _precious(tmp_path)
    run = tmp_path / "runs" / "lk" / "jagg-s0"
    run.mkdir(parents=True)
    os.symlink(target, run / ".lock")
    with pytest.raises(LockedError, match=r"\.lock is a symbolic link, which jagg does not write through; remove it"):
        FolderLock(run, "run jagg-s0").acquire()
    assert target.read_text() == "precious\n"
    (run / ".lock").unlink()
    os.mkfifo(run / ".lock")
    with pytest.raises(LockedError, match="not a regular file"):
        within(5, lambda: FolderLock(run, "run jagg-s0").acquire())
    (run / ".lock").unlink()
    with FolderLock(run, "run jagg-s0"):  # an ordinary lock still works
        assert (run / ".lock").read_text().startswith(f"pid {os.getpid()} on ")


def test_worker_log_refuses_a_planted_link(tmp_path, monkeypatch):
    """`.services/worker-<name>.log` a link: the worker's output was appended to its target. Now nothing starts."""
    from tasks import services
    from tasks.common import ServiceError

    target = _precious(tmp_path)
    monkeypatch.setattr(services, "STATE", tmp_path / ".services")
    (tmp_path / ".services").mkdir()
    os.symlink(target, tmp_path / ".services" / "worker-w1.log")
    with pytest.raises(ServiceError, match=r"worker-w1\.log is a symbolic link.*remove it"):
        services._spawn("worker-w1", [sys.executable, "-c", "print('worker output')"], dict(os.environ))
    assert target.read_text() == "precious\n"
    pid = services._spawn("worker-w2", [sys.executable, "-c", "print('worker output')"], dict(os.environ))
    os.waitpid(pid, 0)
    assert (tmp_path / ".services" / "worker-w2.log").read_text() == "worker output\n"


def test_pids_json_fifo_is_one_sentence(tmp_path, monkeypatch):
    """A FIFO at `.services/pids.json`: `jagg services status`, `down` and `up` hung reading it."""
    from tasks import services
    from tasks.common import ServiceError

    monkeypatch.setattr(services, "STATE", tmp_path)
    os.mkfifo(tmp_path / "pids.json")
    with pytest.raises(ServiceError, match=r"pids\.json is not a regular file .*; remove it"):
        within(5, services._load)
    (tmp_path / "pids.json").unlink()
    assert services._load() == {}  # absent: nothing started
    (tmp_path / "pids.json").write_text("{not json")
    assert services._load() == {}  # damaged: as before


def test_curve_tsv_fifo_on_resume_is_one_sentence(tmp_path):
    """A FIFO at `runs/<o>/<run>/curve.tsv`: `jagg train` hung after "resuming" (TsvCurve read it with read_text)."""
    from jagg_core.trainer.curve import TsvCurve
    from jagg_core.trainer.errors import TrainingError

    os.mkfifo(tmp_path / "curve.tsv")
    with pytest.raises(TrainingError, match=r"curve\.tsv is not a regular file"):
        within(5, lambda: TsvCurve(tmp_path / "curve.tsv", resume_from=1))


def test_toy_flux_json_fifo_is_one_sentence(tmp_path):
    """A FIFO at `models/<p>/base/toy_flux.json`: `jagg evaluate` hung loading the base model."""
    import torch

    from jagg_core.policies.base import PolicyError
    from jagg_core.policies.toy_flux import load_toy_flux

    base = tmp_path / "models" / "ci" / "base"
    for rel in ("transformer/config.json", "text_encoder/config.json", "tokenizer/tokenizer.json"):
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_text("{}")
    os.mkfifo(base / "toy_flux.json")
    with pytest.raises(PolicyError, match=r"toy_flux\.json is not a regular file .*jagg pretrain"):
        within(10, lambda: load_toy_flux(str(base), device=torch.device("cpu"), dtype=torch.float32, options={}))


def test_mlflow_pending_fifo_and_link_are_one_sentence(tmp_path):
    """A FIFO at `mlflow-pending.jsonl` while the store is down: training hung after iteration 1 (appended with
    `open(…, "a")`); a link there had its target appended to."""
    from jagg_core.pipeline.mlflow_store import TrackingError
    from jagg_core.pipeline.tracking import MlflowLogger

    record = {"kind": "metrics", "run_id": "r", "step": 1, "time": 0, "metrics": {"reward/mean": 0.5}}
    os.mkfifo(tmp_path / "mlflow-pending.jsonl")
    logger = MlflowLogger(None, "r", buffer=tmp_path / "mlflow-pending.jsonl")
    with pytest.raises(TrackingError, match=r"mlflow-pending\.jsonl is not a regular file .*move it aside"):
        within(5, lambda: logger._append(record))
    target = _precious(tmp_path)
    os.symlink(target, tmp_path / "linked.jsonl")
    with pytest.raises(TrackingError, match="is a symbolic link"):
        MlflowLogger(None, "r", buffer=tmp_path / "linked.jsonl")._append(record)
    assert target.read_text() == "precious\n"
    good = MlflowLogger(None, "r", buffer=tmp_path / "good.jsonl")
    good._append(record)
    good._append(record)
    assert good._records() == [record, record]


def test_mlflow_stream_fifo_and_link_are_one_sentence(tmp_path):
    """The run's record stream (`mlflow-stream.jsonl`: the worker appends what it logs, the launcher reads it as it
    grows): a FIFO there is one sentence on both sides, not a hang; a link there does not have its target appended
    to."""
    from jagg_core.pipeline.mlflow_store import TrackingError
    from jagg_core.pipeline.tracking import RecordStream, StreamForwarder

    os.mkfifo(tmp_path / "mlflow-stream.jsonl")
    with pytest.raises(TrackingError, match=r"mlflow-stream\.jsonl is not a regular file .*move it aside"):
        within(5, lambda: RecordStream(tmp_path / "mlflow-stream.jsonl", "r").log_metrics({"reward/mean": 0.5}, 1))
    forwarder = StreamForwarder(type("L", (), {"run_id": "r"})(), tmp_path / "mlflow-stream.jsonl")
    with pytest.raises(TrackingError, match=r"mlflow-stream\.jsonl is not a regular file .*move it aside"):
        within(5, forwarder.forward)
    target = _precious(tmp_path)
    os.symlink(target, tmp_path / "linked.jsonl")
    with pytest.raises(TrackingError, match="is a symbolic link"):
        RecordStream(tmp_path / "linked.jsonl", "r").log_metrics({"reward/mean": 0.5}, 1)
    assert target.read_text() == "precious\n"


def test_mlflow_db_lock_fifo_is_one_sentence(tmp_path):
    """A FIFO at `mlflow.db.lock`: `jagg train` hung before printing anything."""
    from jagg_core.pipeline.mlflow_store import TrackingError, store_creation_lock

    os.mkfifo(tmp_path / "mlflow.db.lock")

    def enter():
        with store_creation_lock(f"sqlite:///{tmp_path / 'mlflow.db'}"):
            pass

    with pytest.raises(TrackingError, match=r"mlflow\.db\.lock is not a regular file .*remove it"):
        within(5, enter)


def test_mlflow_db_header_fifo_is_one_sentence(tmp_path):
    """The store's header check reads 16 bytes of the database through storage (read_head), not open()."""
    from jagg_core.pipeline.mlflow_store import TrackingError, check_sqlite_store

    (tmp_path / "mlflow.db").write_bytes(b"not a database at all")
    with pytest.raises(TrackingError, match="is not a SQLite database"):
        check_sqlite_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (tmp_path / "ok.db").write_bytes(b"SQLite format 3\x00" + b"\0" * 84)
    check_sqlite_store(f"sqlite:///{tmp_path / 'ok.db'}")


def test_dvc_pipelines_check_with_a_fifo_params_is_one_sentence(tmp_path):
    """`python -m tasks.dvc_pipelines --check --params <fifo>` hung."""
    from tasks.dvc_pipelines import main

    os.mkfifo(tmp_path / "params.yaml")
    def check():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            return main(["--check", "--params", str(tmp_path / "params.yaml")]), err.getvalue()

    rc, err = within(10, check)
    assert rc == 1 and "params.yaml is not a regular file" in err, err


def test_plugin_file_is_read_bounded(tmp_path):
    """A 2 GB sparse plugin `.py` was read whole (16 s, 2.8 GB of memory) before its sentence: now refused by its
    size before a byte is read."""
    import time

    from jagg_core.setup.registry import PluginError, load_plugins

    big = tmp_path / "huge_plugin.py"
    with big.open("wb") as f:  # sparse: no disk used
        f.truncate(2 << 30)
    start = time.monotonic()
    with pytest.raises(PluginError, match=r"huge_plugin\.py is larger than 4,194,304 bytes"):
        within(30, lambda: load_plugins((big,)))
    assert time.monotonic() - start < 10


def test_plugin_file_still_imports(tmp_path):
    """Read by storage and compiled from those bytes, a plugin still runs as a module of its own (its __file__,
    its name in sys.modules for dataclasses)."""
    from jagg_core.setup.registry import load_plugins

    plugin = tmp_path / "door_plugin.py"
    plugin.write_text("import dataclasses, sys\n@dataclasses.dataclass\nclass P:\n    x: int = 1\n"
                      "LOADED_FROM = __file__\nsys.modules['door_plugin_seen'] = sys.modules[__name__]\n")
    load_plugins((plugin,))
    module = sys.modules.pop("door_plugin_seen")
    assert module.LOADED_FROM == str(plugin) and module.P().x == 1


@pytest.mark.parametrize("given", ["../../outside.token", "/dev/zero", "fifo.token"])
def test_pool_unit_shared_token_file_is_a_file_inside_the_project(tmp_path, given):
    """A pool unit's `shared` token file could be any path (`../../…`, a FIFO, /dev/zero): the unit stayed RUNNING
    and held the worker's only slot. Now one sentence, before MLflow is asked anything."""
    from jagg_core.errors import UserError
    from jagg_core.setup.params_io import load_params
    from tasks.dispatch import check_shared

    root = tmp_path / "project"
    root.mkdir()
    os.mkfifo(root / "fifo.token")
    (tmp_path / "outside.token").write_text("t" * 32)
    params = load_params(REPO / "params.yaml", "ci")
    shared = {"file": given, "token": "t" * 32, "root": str(root), "host": "h"}
    with pytest.raises(UserError, match=r"the unit's sweep token file .*(leads outside the project|not a regular)"):
        within(10, lambda: check_shared(params, root, "s", shared))


# --- issue 71, item 1: images, weights and archives at the door ----------------------------------------------------

def _png_declaring(width: int, height: int) -> bytes:
    """A PNG of a header and nothing else (45 bytes): what a decompression bomb declares before a pixel is read."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


@pytest.mark.parametrize("plant, says", [
    ("fifo", "is not a regular file"),  # `jagg report` hung on it
    ("bomb", "declares more pixels than PIL decodes"),  # 30000 x 30000: a DecompressionBombError traceback
    ("large", r"declares 9000 x 9000 pixels, more than the 67,108,864 pixels an image may have"),
    ("dev-zero", "is a symbolic link, which jagg does not read through"),  # a ValueError traceback
    ("outside", "is a symbolic link, which jagg does not read through"),  # scored as the model's own, rc 0
    ("linked-folder", "is a symbolic link leading outside the project"),
    ("not-an-image", "is not a readable image"),
])
def test_an_evaluation_image_is_read_through_the_door(plant, says, tmp_path):
    """Every reader of an evaluation's images (the report's grids and evaluation's scoring: `load_image`; evaluation's
    score cache: `image_digests`) reads through storage.open_image / open_regular: one sentence, never a
    hang, a traceback, or a file outside the project scored as the model's own."""
    from PIL import Image

    from jagg_core.evaluation.benchmark import ImageFileError, image_path, load_image
    from jagg_core.evaluation.score_cache import image_digests
    from jagg_core.setup.paths import Layout, PathRuleError

    images = Layout(tmp_path / "project", "ci").eval_dir("base") / "step-000000" / "images"
    path = image_path(images, "anime", 0)
    path.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    Image.new("RGB", (8, 8)).save(elsewhere / "00000.jpg")
    if plant == "fifo":
        os.mkfifo(path)
    elif plant == "bomb":
        path.write_bytes(_png_declaring(30000, 30000))
    elif plant == "large":
        path.write_bytes(_png_declaring(9000, 9000))
    elif plant == "dev-zero":
        os.symlink("/dev/zero", path)
    elif plant == "outside":
        os.symlink(elsewhere / "00000.jpg", path)
    elif plant == "linked-folder":
        path.parent.rmdir()
        os.symlink(elsewhere, path.parent)
    else:
        path.write_bytes(b"GIF89a not really")
    readers = [lambda: load_image(path)]
    if plant not in ("bomb", "large", "not-an-image"):  # the score cache hashes an image's bytes, never decodes them
        readers.append(lambda: image_digests(images, {"anime": ["a cat"]}, None))
    for read in readers:
        with pytest.raises((ImageFileError, PathRuleError), match=says) as e:
            within(10, read)
        assert "\n" not in str(e.value) and len(str(e.value)) < 600


def test_a_checkpoints_optimizer_state_and_a_scorers_weights_are_read_through_the_door(tmp_path):
    """`torch.load(path)` of a checkpoint's optimizer.pt and of a CLIP scorer's weights blocked on a FIFO and read a
    link to /dev/zero until memory ran out: now storage.open_regular hands torch.load the open file, one sentence."""
    from jagg_core.rewards.base import RewardError
    from jagg_core.rewards.clip_models import _read_state_dict
    from jagg_core.trainer.checkpoint import Checkpoint, CheckpointError

    ckpt = tmp_path / "checkpoint-000001"
    ckpt.mkdir()
    os.mkfifo(ckpt / "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"optimizer\.pt is not a regular file .*move checkpoint 1 aside"):
        within(10, lambda: Checkpoint(ckpt, 1).optimizer_state())
    os.mkfifo(tmp_path / "open_clip.bin")
    with pytest.raises(RewardError, match=r"open_clip\.bin is not a regular file"):
        within(10, lambda: _read_state_dict(tmp_path / "open_clip.bin"))
    os.symlink("/dev/zero", tmp_path / "zero.bin")
    with pytest.raises(RewardError, match=r"zero\.bin is not a regular file"):
        within(10, lambda: _read_state_dict(tmp_path / "zero.bin"))


def test_the_shipped_base_model_is_copied_through_the_door(tmp_path):
    """`shutil.copytree` of the shipped base model blocked on a FIFO in it; storage.copy_tree refuses it, a link in it
    too, and copies a regular folder whole."""
    from jagg_core.errors import UserError
    from jagg_core.setup.storage import copy_tree

    src = tmp_path / "src"
    (src / "transformer").mkdir(parents=True)
    (src / "transformer" / "config.json").write_text("{}")
    copy_tree(src, tmp_path / "copy", UserError)
    assert (tmp_path / "copy" / "transformer" / "config.json").read_text() == "{}"
    os.mkfifo(src / "transformer" / "weights.safetensors")
    with pytest.raises(UserError, match="is not a regular file"):
        within(10, lambda: copy_tree(src, tmp_path / "copy2", UserError))
    (src / "transformer" / "weights.safetensors").unlink()
    os.symlink("/dev/zero", src / "transformer" / "weights.safetensors")
    with pytest.raises(UserError, match="is a symbolic link, which jagg does not read through"):
        copy_tree(src, tmp_path / "copy3", UserError)
