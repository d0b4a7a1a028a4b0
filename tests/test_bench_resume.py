"""`jagg bench` keeps each timed round on disk as it ends, and a rerun of the same settings continues from them.

The smallest bench the suite runs (the toy model, W = 2, 2 steps, a micro-batch of 1: 4 cells), stopped after its
second round (an exception raised the moment round 2's file is written, in-process; and a real process killed with
SIGKILL once its first round's file appears). Times are never asserted; the rounds timed are counted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from jagg_core.bench import BenchConfig, RoundStore
from jagg_core.bench import timing
from jagg_core.setup.params_io import load_params
from tasks.bench import bench

REPEATS = 4
CELLS = 4  # exact, exact-batched/W2, jagg-joint/W2/frac1, jagg-sequential/W2/frac1


def config(**kw) -> BenchConfig:
    return BenchConfig(**{"windows": (2,), "fracs": (1.0,), "repeats": REPEATS, "batch": 1, "steps": 2,
                          "threads": 1, "memory": False, "comm": False, **kw})


class Stop(Exception):
    """Stands for a bench stopped the moment a round's file is on disk."""


@pytest.fixture(scope="module")
def params():
    return load_params(REPO / "params.yaml")


@pytest.fixture
def counted(monkeypatch):
    """The keys of the cells timed (in order) and the round numbers saved, of every bench run while it is active;
    ``stop_after``: raise :class:`Stop` once that round's file is written."""
    seen = {"updates": [], "saved": [], "stop_after": None}
    time_update, save = timing._CellTimer._time_update, RoundStore.save

    def counting_update(self, key):
        seen["updates"].append(key)
        return time_update(self, key)

    def counting_save(self, number, data):
        path = save(self, number, data)
        seen["saved"].append(number)
        if number == seen["stop_after"]:
            raise Stop(path)
        return path

    monkeypatch.setattr(timing._CellTimer, "_time_update", counting_update)
    monkeypatch.setattr(RoundStore, "save", counting_save)
    return seen


def run(params, root, cfg, progress=False):
    (path,) = bench(params, cfg, models=["toy"], root=root, mlflow=False, progress=progress)
    return path, json.loads(path.read_text())


def test_stopped_bench_keeps_its_rounds_and_a_rerun_finishes_from_them(params, tmp_path, counted, caplog):
    rounds = tmp_path / "bench" / "rounds" / "toy"
    counted["stop_after"] = 2
    with pytest.raises(Stop):
        run(params, tmp_path, config())
    # Rounds 1 and 2 are on disk, each whole, with every cell and primitive; no result was written.
    assert sorted(p.name for p in rounds.glob("round-*.json")) == ["round-001.json", "round-002.json"]
    assert not list((tmp_path / "bench").glob("*.json"))
    kept = [json.loads((rounds / f"round-00{n}.json").read_text()) for n in (1, 2)]
    assert [k["round"] for k in kept] == [1, 2] and all(len(k["seconds"]) == CELLS for k in kept)
    assert all({"rollout", "optimizer_step", "forward_grad", "backward"} <= set(k["primitives"]) for k in kept)
    first_order = counted["updates"][:2 * CELLS]

    # The rerun times rounds 3 and 4 only, and its result holds all four.
    counted.update(updates=[], saved=[], stop_after=None)
    with caplog.at_level("INFO", logger="jagg"):
        path, r = run(params, tmp_path, config(), progress=True)
    assert counted["saved"] == [3, 4] and len(counted["updates"]) == 2 * CELLS
    assert r["resumed_rounds"] == 2 and len(r["cells"]) == CELLS
    for c in r["cells"]:
        assert c["time"]["n"] == REPEATS
        assert c["time"]["samples"][:2] == [k["seconds"][c["key"]] for k in kept]
        assert c["backward_time"]["samples"][:2] == [k["backward_seconds"][c["key"]] for k in kept]
        assert c["totals"] == kept[0]["totals"][c["key"]]
    assert r["primitives"]["rollout"]["samples"][:2] == [k["primitives"]["rollout"] for k in kept]
    assert all(r["primitives"][p]["n"] == REPEATS for p in timing.ROUND_PRIMITIVES)
    text = caplog.text
    assert f"continuing from the 2 round(s) kept in {rounds}" in text
    assert "toy: timing round 3/4 done in" in text and "toy: timing round 1/4" not in text
    assert "jagg-joint over exact this round: W 2 " in text and "left" in text
    # The result saved, the rounds go: a finished bench reruns afresh.
    assert not rounds.exists() and not (tmp_path / "bench" / "rounds").exists()

    # The rounds after the kept ones run in the order of a bench never stopped.
    counted.update(updates=[], saved=[])
    run(params, tmp_path / "fresh", config())
    assert counted["saved"] == [1, 2, 3, 4] and counted["updates"][:2 * CELLS] == first_order


def test_other_settings_start_fresh_in_one_line(params, tmp_path, counted, caplog):
    counted["stop_after"] = 1
    with pytest.raises(Stop):
        run(params, tmp_path, config())
    counted.update(updates=[], saved=[], stop_after=None)
    with caplog.at_level("INFO", logger="jagg"):
        _, r = run(params, tmp_path, config(batch=2), progress=True)
    assert counted["saved"] == [1, 2, 3, 4] and r["resumed_rounds"] == 0
    said = [m for m in caplog.messages if "starting fresh" in m]
    assert said == [f"toy: the 1 round(s) kept in {tmp_path / 'bench' / 'rounds' / 'toy'} were timed with other "
                    f"settings (timing.batch 1, now 2); starting fresh"]


def test_more_repeats_keep_the_rounds(params, tmp_path, counted):
    """--repeats is not a setting of a round: a rerun asking for more rounds adds to the kept ones."""
    counted["stop_after"] = 2
    with pytest.raises(Stop):
        run(params, tmp_path, config(repeats=3))
    counted.update(updates=[], saved=[], stop_after=None)
    _, r = run(params, tmp_path, config(repeats=REPEATS))
    assert counted["saved"] == [3, 4] and r["resumed_rounds"] == 2
    assert all(c["time"]["n"] == REPEATS for c in r["cells"])


def test_damaged_round_is_timed_again(tmp_path):
    """A round file that is not whole (edited, damaged) and those after it are timed again; the ones before kept."""
    cells, prims = ["exact"], list(timing.ROUND_PRIMITIVES)
    record = {"seconds": {"exact": 1.0}, "backward_seconds": {"exact": 0.5}, "totals": {"exact": {}},
              "primitives": {p: 0.1 for p in prims}}
    lines = []
    store = RoundStore(tmp_path / "toy", {"a": 1}, name="toy", say=lines.append)
    assert store.open(cells, prims) == []
    for n in (1, 2, 3):
        store.save(n, record)
    store.close()
    (tmp_path / "toy" / "round-002.json").write_text('{"round": 2, "seconds"')
    store = RoundStore(tmp_path / "toy", {"a": 1}, name="toy", say=lines.append)
    kept = store.open(cells, prims)
    assert [k["round"] for k in kept] == [1]
    assert sorted(p.name for p in (tmp_path / "toy").glob("round-*")) == ["round-001.json"]
    assert lines[0] == ("toy: round-002.json is not round 2 (damaged, or a gap before it); timing round 2 and after "
                        "again")
    assert lines[1].startswith(f"toy: continuing from the 1 round(s) kept in {tmp_path / 'toy'} (started 20")
    assert len(lines) == 2
    # A second writer of the same folder is refused while the first holds it.
    from jagg_core.setup.storage import LockedError

    with pytest.raises(LockedError, match="bench rounds of toy"):
        RoundStore(tmp_path / "toy", {"a": 1}, name="toy").open(cells, prims)
    store.close()


DRIVER = """
import sys
from pathlib import Path
from jagg_core.bench import BenchConfig
from jagg_core.setup.params_io import load_params
from tasks.bench import bench
cfg = BenchConfig(windows=(2,), fracs=(1.0,), repeats=int(sys.argv[2]), batch=1, steps=2, threads=1, memory=False,
                  comm=False)
bench(load_params("params.yaml"), cfg, models=["toy"], root=Path(sys.argv[1]), mlflow=False)
"""


@pytest.mark.slow
def test_sigkill_mid_bench_then_rerun(params, tmp_path, counted):
    """A real `jagg bench` process killed with SIGKILL once its first round is on disk; the rerun finishes from it."""
    rounds = tmp_path / "bench" / "rounds" / "toy"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path), "400"], cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (rounds / "round-001.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the bench ended before its first round"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    kept = sorted(rounds.glob("round-*.json"))
    assert kept and not list((tmp_path / "bench").glob("*.json"))  # the rounds on disk, no result
    want = len(kept) + 2
    _, r = run(params, tmp_path, config(repeats=want))
    assert r["resumed_rounds"] == len(kept) and counted["saved"] == [len(kept) + 1, len(kept) + 2]
    assert len(counted["updates"]) == 2 * CELLS and all(c["time"]["n"] == want for c in r["cells"])


def test_progress_line_names_round_method_window_and_time_left():
    """Off a terminal, a line through the logger (here at every piece): the round, the piece, tqdm's estimate."""
    from jagg_core.bench.progress import RoundsProgress, piece_label

    lines = []
    meter = RoundsProgress("toy", {"exact": 1.0, "jagg-joint/W8/frac1": 0.5, "rollout": 2.0}, repeats=3, done=1,
                           bar=False, say=lines.append, interval=0.0)
    meter.piece(2, piece_label("jagg-joint/W8/frac1"))
    meter.done("jagg-joint/W8/frac1")
    time.sleep(0.01)
    meter.piece(2, piece_label("exact"))
    meter.close()
    assert lines[0].startswith("round 2/3, jagg-joint W 8, jagg_frac 1; 33% of the timed rounds, 00:00 so far")
    assert lines[1].startswith("round 2/3, exact; 38% of the timed rounds") and lines[1].endswith(" left")
    assert "about ? left" not in lines[1] and piece_label("optimizer") == "optimizer step"
