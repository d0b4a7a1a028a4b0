"""`jagg bench` on a tiny setting: the JSON's structure and the exact work and communication counts of each variant.

Times are never asserted (a shared CPU); counts are: they come from GroupStats, AllReduceSync and a counter of the
collectives FSDP2 issues, and say whether each variant does the work the cost model assumes.
"""

from __future__ import annotations

import json
import math

import pytest

from conftest import REPO
from jagg_core.bench import BenchConfig, model_spec
from jagg_core.bench.timing import plan_cells
from jagg_core.setup.params_io import load_params
from tasks.bench import bench, main

T, WINDOWS, FRACS = 8, (2, 4), (0.5, 1.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One tiny benchmark run of the toy model (no memory, no communication, no MLflow) and its docs page."""
    root = tmp_path_factory.mktemp("bench")
    params = load_params(REPO / "params.yaml")
    cfg = BenchConfig(windows=WINDOWS, fracs=FRACS, repeats=2, batch=2, steps=T, threads=1, memory=False, comm=False)
    (path,) = bench(params, cfg, models=["toy"], root=root, write_docs="docs/benchmarks.md", mlflow=False,
                    progress=False)
    return root, path, json.loads(path.read_text())


def cell(result, variant, window, frac):
    return next(c for c in result["cells"] if c["variant"] == variant and c["window"] == window
                and c["jagg_frac"] == frac)


def test_json_structure(tiny):
    root, path, r = tiny
    assert path.parent == root / "bench" and path.name.endswith("-toy.json")
    assert {"schema", "created", "model", "config", "machine", "primitives", "cells", "fidelity", "memory",
            "comm"} <= set(r)
    assert r["machine"]["threads"] == 1 and r["machine"]["cpu"] and r["machine"]["torch"]
    assert r["model"]["spec"]["geometry"]["image_size"] == 24 and r["model"]["weights"] == "random"
    assert set(r["primitives"]) == {"forward_nograd", "forward_grad", "backward", "forward_grad_batched",
                                    "backward_batched", "rollout", "optimizer_step", "batched_steps"}
    assert r["primitives"]["batched_steps"] == max(WINDOWS)
    variants = {(c["variant"], c["window"], c["jagg_frac"]) for c in r["cells"]}
    assert ("exact", 4, None) in variants
    for w in WINDOWS:
        for f in FRACS:
            assert {("jagg-joint", w, f), ("jagg-sequential", w, f)} <= variants
    # W = 2 has no middle steps: ablate and reuse would repeat jagg-joint's work exactly.
    assert ("ablate", 2, 1.0) not in variants and ("ablate", 4, 1.0) in variants
    assert {("jagg-k3", 4, 1.0), ("jagg-k4", 4, 1.0), ("jagg-unbiased", 4, 1.0), ("jagg-unbiased", 4, 0.5)} <= variants
    # The strongest exact baseline at every W, and every JAGG figure also against it.
    assert all(("exact-batched", w, None) in variants for w in WINDOWS)
    for c in r["cells"]:
        if c["mode"] != "exact":
            eb = next(x for x in r["cells"] if x["variant"] == "exact-batched" and x["window"] == c["window"])
            assert math.isclose(c["speedup_vs_batched"], eb["time"]["median"] / c["time"]["median"])
    for c in r["cells"]:
        t = c["time"]
        assert t["n"] == 2 and t["min"] <= t["median"] <= t["max"] and t["q1"] <= t["q3"]
        assert c["speedup"] > 0 and c["ideal_speedup"] > 0
        assert math.isclose(c["measured_over_ideal"], c["speedup"] / c["ideal_speedup"])
    assert r["memory"] == {"skipped": "--no-memory"} and r["comm"] == {"skipped": "--no-comm"}
    docs = (root / "docs" / "benchmarks.md").read_text()
    for heading in ("## Machine", "### Update time per micro-batch", "### Speed vs gradient fidelity",
                    "### Peak memory", "### Communication", "| any | — | exact |", "## Reproduce",
                    "### Batched forwards vs fewer backward passes", "### The whole iteration",
                    "#### MixGRPO's sliding window as one JAGG group", "measured/ideal (per call)",
                    "](bench/iteration-toy.png)", "**A stopped bench continues.**"):
        assert heading in docs
    assert "jagg bench --model toy --windows" in docs and "--write-docs docs/benchmarks.md" in docs
    assert "Settings: a stored rollout of" in docs
    assert (root / "docs" / "bench" / "iteration-toy.png").read_bytes()[:4] == b"\x89PNG"


def test_per_call_cost_model_by_hand():
    """The extended model prices counted calls: per-step exact, exact-batched and JAGG-joint at W = 4."""
    from jagg_core.bench.timing import call_cost, call_cost_model

    prim = {"forward_nograd": {"median": 0.5}, "forward_grad": {"median": 1.5}, "backward": {"median": 3.0},
            "forward_grad_batched": {"median": 4.5}, "backward_batched": {"median": 9.0}, "batched_steps": 4}
    coef = call_cost_model(prim)  # forward 0.5 + n·1.0, backward 1.0 + n·2.0
    assert coef == pytest.approx({"f0": 0.5, "c_f": 0.5, "s_f": 1.0, "c_b": 1.0, "s_b": 2.0, "batched_steps": 4})
    exact = [{"grad_forwards": 1, "forward_calls": 1, "nograd_forwards": 0, "backward_calls": 1}] * 4
    batched = [{"grad_forwards": 4, "forward_calls": 1, "nograd_forwards": 0, "backward_calls": 1}]
    joint = [{"grad_forwards": 2, "forward_calls": 3, "nograd_forwards": 2, "backward_calls": 1}]
    assert call_cost(exact, coef) == pytest.approx(4 * (1.5 + 3.0))
    assert call_cost(batched, coef) == pytest.approx(0.5 + 4 + 1 + 8)
    assert call_cost(joint, coef) == pytest.approx(2 * 0.5 + 0.5 + 2 + 1 + 4)
    # Without per-call cost the model is the plain one: batching buys nothing, JAGG 3W/(W + 4).
    flat = call_cost_model({**prim, "forward_grad_batched": {"median": 6.0}, "backward_batched": {"median": 12.0},
                            "forward_nograd": {"median": 1.5}})
    assert call_cost(exact, flat) == pytest.approx(call_cost(batched, flat))
    assert call_cost(exact, flat) / call_cost(joint, flat) == pytest.approx(18 / 12)


def test_per_call_ideal_and_the_iteration(tiny):
    _, _, r = tiny
    from jagg_core.bench.timing import call_cost

    exact = next(c for c in r["cells"] if c["mode"] == "exact")
    for c in r["cells"]:
        want = call_cost(exact["per_group"], r["cost_model"]) / call_cost(c["per_group"], r["cost_model"])
        assert c["ideal_calls_speedup"] == pytest.approx(want)
        assert math.isclose(c["measured_over_ideal_calls"], c["speedup"] / c["ideal_calls_speedup"])
    it = r["iteration"]
    roll, opt = r["primitives"]["rollout"]["median"], r["primitives"]["optimizer_step"]["median"]
    for b in it["breakdown"]:
        c = next(x for x in r["cells"] if x["key"] == b["key"])
        assert b["iteration_s"] == pytest.approx(roll + c["time"]["median"] + opt)
        assert sum(b["phases"].values()) == pytest.approx(b["iteration_s"])
    # MixGRPO: one window of W steps per iteration, each cell's time over its T / W groups.
    mix = {(m["window"], m["variant"]): m for m in it["mix_grpo"]}
    assert {(4, "exact"), (4, "exact-batched"), (4, "jagg-joint"), (4, "jagg-reuse"), (2, "jagg-joint")} <= set(mix)
    assert mix[(4, "exact")]["iteration_speedup"] == pytest.approx(1.0)
    joint = cell(r, "jagg-joint", 4, 1.0)
    assert mix[(4, "jagg-joint")]["update_s"] == pytest.approx(joint["time"]["median"] * 4 / T)


# (with-grad forwards, forward calls, no-grad forwards, reused velocities, backward calls) per routed group
EXPECTED = {
    ("exact", 4): (4, 4, 0, 0, 4),
    ("jagg-joint", 2): (2, 1, 0, 0, 1),
    ("jagg-sequential", 2): (2, 2, 0, 0, 2),
    ("jagg-joint", 4): (2, 3, 2, 0, 1),  # the two anchors in one batched forward, one backward
    ("jagg-sequential", 4): (2, 4, 2, 0, 2),
    ("ablate", 4): (2, 3, 2, 0, 1),
    ("jagg-reuse", 4): (2, 1, 0, 2, 1),  # middle velocities from the rollout: no forward at all
    ("jagg-k3", 4): (3, 2, 1, 0, 1),
    ("jagg-k4", 4): (4, 1, 0, 0, 1),
    # the anchors in one call, the probe (every image at its drawn step) in one, each middle step on the images that
    # did not draw it: 3 graphs, the no-grad rows of one forward, one backward
    ("jagg-unbiased", 4): (3, 4, 1, 0, 1),
    ("exact-batched", 2): (2, 1, 0, 0, 1),  # every step of the group in one forward call, one backward
    ("exact-batched", 4): (4, 1, 0, 0, 1),
}
KEYS = ("grad_forwards", "forward_calls", "nograd_forwards", "reused_velocities", "backward_calls")


def test_counts_per_group_and_totals(tiny):
    _, _, r = tiny
    for c in r["cells"]:
        want = EXPECTED[(c["variant"], c["window"])]
        assert tuple(c["counts_per_group"][k] for k in KEYS) == want, c["key"]
        for g in c["per_group"]:
            assert g["steps"] == c["window"]
            w = g["steps"]
            expected = want if g["mode"] == c["mode"] else (w, w, 0, 0, w)
            assert tuple(g[k] for k in KEYS) == expected, (c["key"], g)
        # The timed update (all groups in one accumulate_gradients call) did the same work as the groups alone.
        assert c["totals"] == {k: sum(g[k] for g in c["per_group"]) for k in KEYS}
    # Routing: jagg_frac 0.5 of 2 groups -> the high-noise group is JAGG, the other exact.
    assert [g["mode"] for g in cell(r, "jagg-joint", 4, 0.5)["per_group"]] == ["jagg", "exact"]
    assert [g["mode"] for g in cell(r, "ablate", 4, 0.5)["per_group"]] == ["ablate", "exact"]


def test_cost_model_figures(tiny):
    _, _, r = tiny
    assert cell(r, "jagg-joint", 4, 1.0)["textbook_speedup"] == pytest.approx(1.5)  # 3W/(W + 4)
    assert cell(r, "jagg-reuse", 4, 1.0)["textbook_speedup"] == pytest.approx(2.0)  # W/2
    assert cell(r, "jagg-joint", 2, 1.0)["textbook_speedup"] == pytest.approx(1.0)
    assert cell(r, "jagg-k4", 4, 1.0)["ideal_speedup"] == pytest.approx(1.0)  # K = W: exact's work
    assert cell(r, "exact-batched", 4, None)["ideal_speedup"] == pytest.approx(1.0)  # batched, but exact's work
    assert cell(r, "jagg-joint", 4, 0.5)["textbook_speedup"] == pytest.approx(24 / (12 + 8))
    exact = next(c for c in r["cells"] if c["mode"] == "exact")
    assert exact["speedup"] == 1.0 and exact["ideal_speedup"] == pytest.approx(1.0)


def test_fidelity_by_anchors(tiny):
    _, _, r = tiny
    fid = r["fidelity"]
    assert fid["window"] == 4 and set(fid["anchors"]) == {"2", "3", "4"}
    for k, f in fid["anchors"].items():
        assert f["positions"] == [0, 1] and len(f["cos_jagg"]) == 2
        assert all(-1.0 <= c <= 1.0 + 1e-9 for c in f["cos_jagg"])
    assert fid["anchors"]["4"]["cos_jagg"] == pytest.approx([1.0, 1.0], abs=1e-5)  # K = W is exact


def test_plan_cells_of_chosen_variants():
    """--variants keeps exact (every speedup's baseline) and only the named variants, at every W and jagg_frac."""
    keys = [c.key for c in plan_cells((4, 8), (0.5, 1.0), (2, 3, 4), ("jagg-sequential", "jagg-joint"))]
    assert keys == ["exact", *(f"{v}/W{w}/frac{f:g}" for w in (4, 8) for f in (0.5, 1.0)
                               for v in ("jagg-joint", "jagg-sequential"))]
    every = {c.key for c in plan_cells((4, 8), (1.0,), (2, 3, 4))}
    assert {c.key for c in plan_cells((4, 8), (1.0,), (2, 3, 4), ())} == every
    assert {"exact-batched/W8", "jagg-k4/W8/frac1", "jagg-unbiased/W8/frac1"} <= every


@pytest.mark.parametrize("argv, needle", [
    (["--windows", "2,4,8", "--steps", "12"], "--steps 12 must be a multiple of every window (here 8)"),
    (["--windows", "2,x"], "--windows '2,x' must be a comma-separated list of ints"),
    (["--fracs", "0.6,1.5"], "--fracs 0.6,1.5 must be distinct numbers in [0, 1]"),
    (["--windows", "1,2"], "must be distinct integers ≥ 2"),
    (["--repeats", "0"], "--repeats 0 must be at least 1"),
    (["--model", "huge"], "--model 'huge' is not one of toy, large, both"),
    (["--model", "toy", "--profile", "toy"], "give one of them"),
    (["--variants", "jagg-joint,jagg-seq"], "--variants 'jagg-seq' is not a variant timed beside exact"),
])
def test_cli_errors_are_one_sentence(argv, needle, capsys, tmp_path):
    assert main([*argv, "--no-mlflow", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("jagg: error: ") and needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_mlflow_run(tiny, tmp_path):
    from mlflow.tracking import MlflowClient

    from tasks.bench import _log_mlflow, _tracker

    _, path, r = tiny
    params = load_params(REPO / "params.yaml", overrides={"tracking.mlflow_uri": f"sqlite:///{tmp_path}/m.db"})
    run_id = _log_mlflow(_tracker(params, tmp_path), r, path)
    client = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == "jagg-bench"
    assert run.data.params["bench.steps"] == str(T) and run.data.metrics["bench/speedup/exact"] == 1.0
    assert "bench/backward_calls_per_group/jagg-joint/W4/frac1" in run.data.metrics
    assert [a.path for a in client.list_artifacts(run_id, "bench")] == [f"bench/{path.name}"]


@pytest.mark.slow
def test_collective_counts_two_processes():
    """gloo × 2: one all-reduce per optimizer step for every method; FSDP2 all-gathers in backward per group and
    module: exact W, jagg-joint 1 (batched anchor forward), jagg-sequential 2."""
    from jagg_core.bench.comm import measure_comm

    spec = model_spec("toy", load_params(REPO / "params.yaml"), device="cpu")
    comm = measure_comm(spec, windows=list(WINDOWS), steps=T, batch=2, seed=0, threads=1)
    backward = {"exact": lambda w: T, "jagg-joint": lambda w: T // w, "jagg-sequential": lambda w: 2 * T // w,
                "ablate": lambda w: T // w, "jagg-reuse": lambda w: T // w}
    assert {(a["variant"], a["window"]) for a in comm["allreduce"]} == {
        (v, w) for w in WINDOWS for v in backward if w > 2 or v not in ("ablate", "jagg-reuse")}
    for a in comm["allreduce"]:
        assert a["all_reduces"] == 1 and a["all_reduce_calls"] == 1, a
        assert a["backward_calls"] == backward[a["variant"]](a["window"]) == a["naive_ddp_all_reduces"]
    assert comm["fsdp_modules"] == 5 and comm["fsdp_modules_resharding"] == 4  # 2 + 2 blocks, then the root
    per_module = {"exact": lambda w: w, "jagg-joint": lambda w: 1, "jagg-sequential": lambda w: 2}
    assert len(comm["fsdp2"]) == 6
    for a in comm["fsdp2"]:
        assert a["all_gathers_per_group_per_module"] == per_module[a["variant"]](a["window"]), a
        assert a["all_gathers_backward"] == per_module[a["variant"]](a["window"]) * a["groups"] * 4


@pytest.mark.slow
def test_memory_probe_per_variant():
    """A fresh process per variant reports its update's peak over setup (values are not asserted: a shared CPU)."""
    from jagg_core.bench.memory import measure_memory

    spec = model_spec("toy", load_params(REPO / "params.yaml"), device="cpu")
    rows = measure_memory(spec, ["jagg-joint", "jagg-sequential"], window=4, steps=T, batch=2, seed=0, threads=1)
    assert [m["variant"] for m in rows] == ["jagg-joint", "jagg-sequential"]
    assert [m["backward_calls"] for m in rows] == [2, 4]
    for m in rows:
        assert m["setup_rss_mb"] > 0 and m["peak_rss_mb"] >= m["update_peak_mb"] >= 0
