"""The toy-w study (docs/frontier.md): every method's ideal update speedup by hand, from the forwards the backward
really counts, from `jagg plan`'s counts and from the speed stage's table; the report's pairs and verdicts for a
study's own methods; and a ci-sized run of the profile through the real command line, down to the frontier page."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from jagg_core import Estimator, group_backward
from jagg_core.bench.side_by_side import speed_rows
from jagg_core.cost import ideal_speedup
from jagg_core.jagg import plan_groups
from jagg_core.pipeline.plan import forward_counts
from jagg_core.pipeline.report import cost_model_speedup, report_pairs
from jagg_core.pipeline.report_stats import noninferiority
from jagg_core.setup.params_io import load_params
from velocity_models import NonlinearVelocity, ppo_problem, segment_group

REPO = Path(__file__).resolve().parents[1]

# Forward 1, backward 2: an exact step costs 3, a JAGG group of W steps with K anchors W + 2K (K graphs, W − K no-grad
# forwards), with reuse 3K. The 8-step window: 24 over the groups' summed cost.
IDEAL = {
    "baseline": Fraction(24, 24),
    "jagg": Fraction(24, 8 + 4),            # one group of 8, 2 anchors: 2.0
    "jagg-w4": Fraction(24, 2 * (4 + 4)),   # two groups of 4: 1.5
    "jagg-k3": Fraction(24, 8 + 6),         # 3 anchors: 12/7
    "jagg-k4": Fraction(24, 8 + 8),         # 4 anchors: 1.5
    "ablate": Fraction(24, 8 + 4),          # computes the middle velocities it then drops: JAGG's cost
    "jagg-reuse": Fraction(24, 6),          # 2 graphs, the 6 middle velocities the rollout's: 4.0
}


@pytest.fixture(scope="module")
def toy_w():
    return load_params(REPO / "params.yaml", "toy-w")


def _counted(method) -> dict[str, int]:
    """The forwards group_backward counts over the 8 trained steps, routed as the trainer routes them, on a float64
    velocity model (reuse: the rollout's middle velocities handed in, as the trainer's ImageSteps does)."""
    t = [1000.0 - 1000.0 * i / 12 for i in range(2, 10)]  # the toy's steps 2-9 of 12
    model = NonlinearVelocity(seed=3)
    ts, zs = segment_group(t, batch=3, off_segment=0.3)
    velocity, step_loss = ppo_problem(model, ts, zs)
    counts = {"grad_forwards": 0, "nograd_forwards": 0, "reused_velocities": 0}
    for g in plan_groups(8, method.window, float(method.jagg_frac), mode=method.mode):
        steps = list(g.steps)
        kept = (lambda j, steps=steps: velocity(steps[j]).detach()) if method.reuse_rollout_velocity else None
        stats = group_backward(lambda j, steps=steps: velocity(steps[j]),
                               lambda j, v, steps=steps: step_loss(steps[j], v), ts[steps], g.mode, method.variant,
                               estimator=Estimator(anchors=method.anchors), middle_velocity=kept)
        for k in counts:
            counts[k] += getattr(stats, k)
    return counts


def test_every_methods_ideal_speedup_is_the_cost_model_by_hand(toy_w):
    """The report's 'ideal' column (cost_model_speedup of a run's counted forwards), the speed stage's (speed_rows of
    its counts) and `jagg plan`'s counts all give 3·8 over the groups' summed cost, method by method: two groups of
    4 are 1.5x, not one group of 8's 2x; K anchors are K graphs."""
    assert set(toy_w.run.methods) == set(IDEAL)
    counted = {}
    for name in toy_w.run.methods:
        m = toy_w.method(name)
        c = counted[name] = _counted(m)
        assert c["grad_forwards"] + c["nograd_forwards"] + c["reused_velocities"] == 8
        report = cost_model_speedup(grad_forwards=c["grad_forwards"], nograd_forwards=c["nograd_forwards"],
                                    reused=c["reused_velocities"])
        assert report == pytest.approx(float(IDEAL[name]), rel=1e-12), name
        units = forward_counts(toy_w, m)  # per image: the update's graphs and no-grad forwards
        planned = ideal_speedup(steps=toy_w.sample.trained_steps, grad_forwards=units["grad"],
                                nograd_forwards=units["nograd"])
        assert planned == pytest.approx(float(IDEAL[name]), rel=1e-12), name
    side = {"methods": {n: {"mode": toy_w.method(n).mode, "counts": {k: float(v) for k, v in c.items()},
                            "update": {"median": 1.0, "q1": 1.0, "q3": 1.0}} for n, c in counted.items()}}
    for row in speed_rows(side):
        assert row["ideal"] == pytest.approx(float(IDEAL[row["method"]]), rel=1e-12), row["method"]


def test_the_report_pairs_every_study_method_with_the_baseline(toy_w):
    """Besides the paper's pairs, every method of toy-w that is not an exact backward is paired with the baseline
    (its paired interval over seeds and over prompts, and its verdict at the margin)."""
    pairs = report_pairs(toy_w)
    for name in toy_w.run.methods:
        if name != "baseline":
            assert (name, "baseline") in pairs, name
    assert len(pairs) == len(set(pairs))
    toy = load_params(REPO / "params.yaml", "toy")  # exact-batched is an exact backward: not a method to pair
    assert ("exact-batched", "baseline") not in report_pairs(toy)


@pytest.mark.parametrize("lo, hi, n, word", [(-0.009, 0.004, 10, "non-inferior"), (-0.011, 0.004, 10, "not shown"),
                                              (-0.03, -0.0101, 10, "inferior"), (0.01, 0.02, 1, "not shown")])
def test_noninferiority_at_the_margin(lo, hi, n, word):
    assert noninferiority({"a": "m", "b": "baseline", "lo": lo, "hi": hi, "n": n})["verdict"] == word


# The ci profile's sizes on toy-w: a shipped-base world (its validation split as the base was made), 4 test prompts per
# style, 10 denoising steps (the profile's 8-step window at step 2 fits), 2 prompts x 4 images, 1 iteration.
CI_SIZES = {
    "world": {"n_test_per_style": 4},
    "reward": {"weights": {"toy_fidelity": 1.0, "toy_preference": 1.0}},  # the ci profile's: a dense signal beside
    "sample": {"num_steps": 10, "group_size": 4, "prompts_per_iteration": 2, "batch_size": 8},
    "train": {"iterations": 1, "micro_batch": 8, "checkpoint_every": 1, "fidelity_every": 1, "log_images_every": 1,
              "kl_ref_every": 1},
    "eval": {"curve_subset": None, "num_steps": 4, "batch_size": 16, "block_size": 2, "num_images_logged": 4},
    "resources": {"speed_rounds": 3},
    "run": {"seeds": [0]},
}


def _script(name: str, *args: str, root: Path) -> "subprocess.CompletedProcess":
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_ci_sized_toy_w_run_reports_every_method_and_makes_the_frontier_page(tmp_path):
    """`jagg run --profile toy-w` at ci sizes: every method trains, is evaluated and has its row in summary.json (final
    score, paired difference with the baseline and its verdict, side-by-side speed with the cost model's ideal); the
    cosine tool measures every method on the same checkpoint; scripts/frontier_page.py writes a page naming every
    method, and refuses a summary without the baseline in one sentence, writing nothing."""
    import os
    import sys

    import yaml

    from conftest import run_module
    from jagg_core.setup.params_io import deep_merge

    root = tmp_path / "project"
    root.mkdir()
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["profiles"]["toy-w"] = deep_merge(raw["profiles"]["toy-w"], CI_SIZES)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    methods = list(load_params(root / "params.yaml", "toy-w").run.methods)
    assert methods == list(IDEAL)

    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    run = run_module("flows.cli", "run", "--profile", "toy-w", "--parallel-runs", "2", root=root,
                     env={"PATH": path, "OMP_NUM_THREADS": "1"}, timeout=1100)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((root / "reports/toy-w/summary.json").read_text())
    assert [r["method"] for r in summary["final"]] == methods and all(r["seeds"] == 1 for r in summary["final"])
    assert {(r["method"], r["seed"]) for r in summary["runs"]} == {(m, 0) for m in methods}
    for m in methods:
        assert (root / "checkpoints/toy-w" / f"{m}-s0").is_dir(), m
    # The speed stage's table (runs/…/speed.json, written whether or not the machine's load let it be trusted); the
    # report shows it where trusted and otherwise says why (under the suite's load, 3 workers on 2 cores, it may not)
    speed = json.loads((root / "runs/toy-w/speed.json").read_text())
    if speed["trusted"]:
        assert summary["side_by_side"]["table"] == speed["table"]
    else:
        assert summary["side_by_side"] is None and "cannot be trusted" in summary["side_by_side_note"], summary
    side = {r["method"]: r for r in speed["table"]}
    assert set(side) == set(methods)
    for m in methods:
        assert side[m]["ideal"] == pytest.approx(float(IDEAL[m]), rel=1e-12), m
        assert side[m]["speedup"] > 0
    assert {r["method"] for r in summary["speed"]} == set(methods)
    paired = {(p["a"], p["b"]) for p in summary["paired"]}
    assert {(m, "baseline") for m in methods if m != "baseline"} <= paired
    assert {v["a"] for v in summary["noninferiority"]} == set(methods) - {"baseline"}

    # The cosine of every method against the exact gradient, on the same model and rollout.
    fid = tmp_path / "fidelity"
    out = _script("jagg_fidelity_study.py", "--params", str(root / "params.yaml"), "--profile", "toy-w",
                  "--methods", "all", "--models", "base", "--rollouts", "1", "--reading", "4",
                  "--work", str(tmp_path / "work"), "--out", str(fid), root=root)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    cos = json.loads((fid / "methods.json").read_text())["methods"]
    assert set(cos) == set(methods)
    assert cos["baseline"]["cos"]["mean"] == pytest.approx(1.0, abs=1e-9)
    # Reuse takes the rollout's velocities where jagg recomputes them with the same weights: the same gradient up to
    # float32 rounding. Bit-equal on an AMD EPYC; 1.1e-7 apart in the cosine on an Intel Xeon, whose kernels round
    # the rollout's batch shape and the update's differently (the methods' cosines differ from each other by 1e-2).
    assert cos["jagg-reuse"]["cos"]["mean"] == pytest.approx(cos["jagg"]["cos"]["mean"], abs=1e-6)
    assert all(-1.0 <= c["cos"]["mean"] <= 1.0 + 1e-9 for c in cos.values())

    # The page.
    (tmp_path / "pilot.md").write_text("The pilot's section.\n")
    page = tmp_path / "docs" / "frontier.md"
    args = ["--summary", str(root / "reports/toy-w/summary.json"), "--cosines", str(fid / "methods.json"),
            "--pilot", str(tmp_path / "pilot.md"), "--wall", "1 min", "--date", "today", "--commit", "abc"]
    out = _script("frontier_page.py", *args, "--out", str(page), root=root)
    assert out.returncode == 0, out.stderr[-2000:]
    text = page.read_text()
    for m in methods:
        assert f"| {m} |" in text, m
    assert "The pilot's section." in text and "would not carry over" in text
    assert (page.parent / "frontier" / "frontier.png").read_bytes()[:4] == b"\x89PNG"

    broken = dict(summary, final=[r for r in summary["final"] if r["method"] != "baseline"])
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    other = tmp_path / "other" / "frontier.md"
    args[1] = str(tmp_path / "broken.json")
    out = _script("frontier_page.py", *args, "--out", str(other), root=root)
    assert out.returncode == 1 and "no exact baseline" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not other.parent.exists()


def test_the_reports_fidelity_curve_pools_one_estimator(toy_w):
    """Each run's monitor logs its own method's groups: toy-w's jagg-w4 (two groups of 4) and jagg-k3 must not be
    pooled into the W = 8, K = 2 curve of the report's fidelity figure."""
    from jagg_core.pipeline.report import _Run, fidelity_by_position

    runs = [_Run("baseline", 0, [{"jagg/cos_jagg/g0": 0.6, "jagg/cos_ablate/g0": 0.5}], None),
            _Run("jagg", 0, [{"jagg/cos_jagg/g0": 0.8, "jagg/cos_ablate/g0": 0.5}], None),
            _Run("jagg-w4", 0, [{"jagg/cos_jagg/g0": 0.9, "jagg/cos_jagg/g1": 0.9, "jagg/cos_ablate/g0": 0.7}], None),
            _Run("jagg-k3", 0, [{"jagg/cos_jagg/g0": 0.99, "jagg/cos_ablate/g0": 0.5}], None)]
    fid = fidelity_by_position(runs, toy_w)
    assert set(fid["jagg"]) == {0} and fid["jagg"][0][0] == pytest.approx(0.7) and fid["jagg"][0][2] == 2
    assert fid["ablate"][0][0] == pytest.approx(0.5)


def _page_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("frontier_page", REPO / "scripts" / "frontier_page.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(method, paired, verdict, cos, gain, measured=1.5, reuse=False):
    lo, hi = paired
    return {"method": method, "window": 8, "seeds": 10, "reuse": reuse, "measured": measured, "ideal": 2.0,
            "paired": {"mean": (lo + hi) / 2, "lo": lo, "hi": hi}, "verdict": verdict, "cos_mean": cos,
            "gain": {"mean": gain}}


def test_the_frontier_pages_advice_places_each_method_by_its_paired_interval():
    """The advice's four places (held, shown beyond the margin, shown below 0 only, no loss shown), the cosine's order
    against the gain's with ties, and reuse's sentence only where its gain equals its twin's."""
    fp = _page_module()
    base = {"method": "baseline", "window": 8, "seeds": 10, "reuse": False, "measured": 1.0, "ideal": 1.0,
            "paired": None, "verdict": "–", "gain": {"mean": 0.03}}
    rows = [base,
            _row("held", (-0.004, 0.006), "non-inferior", 0.99, 0.029, measured=1.2),
            _row("lost", (-0.03, -0.012), "inferior", 0.70, 0.005),
            _row("less", (-0.015, -0.002), "not shown", 0.95, 0.02),
            _row("open", (-0.013, 0.001), "not shown", 0.97, 0.025),
            _row("less-reuse", (-0.015, -0.002), "not shown", 0.95, 0.02, measured=3.9, reuse=True)]
    text = fp.advice(rows, 0.01)
    line = {k: next(x for x in text.splitlines() if x.startswith(f"- **{k}")) for k in
            ("Held", "Shown to learn less than the exact baseline by", "Shown to learn less than the exact baseline**",
             "No loss", "The cosine", "Reuse")}
    assert "held (1.20×" in line["Held"] and "lost" not in line["Held"]
    assert "lost (" in line["Shown to learn less than the exact baseline by"]
    assert "less (" in line["Shown to learn less than the exact baseline**"] and "open" not in \
        line["Shown to learn less than the exact baseline**"]
    assert "open (" in line["No loss"] and "less" not in line["No loss"]
    assert "lost < less = less-reuse < open < held; by gain the same" in line["The cosine"]
    assert "less-reuse learned what less learned" in line["Reuse"]
    assert "On average every method" not in text  # held gains 0.001 over the baseline on average
    rows[-1]["gain"] = {"mean": 0.021}
    assert "Reuse" not in fp.advice(rows, 0.01)
    rows[1]["paired"] = {"mean": -0.0005, "lo": -0.005, "hi": 0.004}
    assert "On average every method learned less" in fp.advice(rows, 0.01)
    assert fp.margin_share([base], 0.01, "toy_fidelity").endswith("33% of the toy baseline's gain here (+0.0300)")


def test_the_advice_says_where_the_cosine_separates_only_when_it_does():
    """"Where it stopped holding, by cosine" only when every method shown to learn less has a lower cosine than every
    other; a method shown to learn more than the baseline is not counted as shown to learn less."""
    fp = _page_module()
    base = {"method": "baseline", "window": 8, "seeds": 10, "reuse": False, "measured": 1.0, "ideal": 1.0,
            "paired": None, "verdict": "–", "gain": {"mean": 0.03}}
    rows = [base, _row("a", (-0.02, -0.005), "not shown", 0.90, 0.01),
            _row("b", (-0.01, 0.004), "not shown", 0.95, 0.02),
            _row("c", (0.001, 0.01), "non-inferior", 0.99, 0.035)]
    text = fp.advice(rows, 0.01)
    assert "cosine of 0.900 or less was shown to learn less than the baseline; b, c (cosine 0.950, 0.990)" in text
    rows[1]["cos_mean"] = 0.97  # a is shown to learn less yet has a higher cosine than b: no separation to state
    assert "Where it stopped holding" not in fp.advice(rows, 0.01)


def test_the_step_size_profile_is_toy_ws_recipe_with_each_method_at_three_rates():
    """toy-lr (issue 72: every method at its own learning rate) writes toy-w's recipe out rather than extending it
    (DVC reads each profile's own keys): it must stay toy-w's — the same world, base, sampler, jagg section, rewards,
    training and evaluation — but for the update-size log, the validation split and its methods, each of which is
    one of toy-w's methods at train.lr × 1, 1.5 or 2.25."""
    w, lr = load_params(REPO / "params.yaml", "toy-w"), load_params(REPO / "params.yaml", "toy-lr")
    for section in ("world", "pretrain", "model", "sample", "jagg", "reward", "resources"):
        assert getattr(lr, section) == getattr(w, section), section
    assert lr.train.model_dump(exclude={"update_size_every"}) == w.train.model_dump(exclude={"update_size_every"})
    assert lr.train.update_size_every > 0
    assert lr.eval.model_dump(exclude={"split"}) == w.eval.model_dump(exclude={"split"})
    assert (lr.eval.split, w.eval.split) == ("validation", "test")
    scales = {}
    for name in lr.run.methods:
        base, _, scale = name.partition("-x")
        got = lr.method(name)
        assert got.model_dump(exclude={"name", "lr_scale"}) == w.method(base).model_dump(exclude={"name", "lr_scale"})
        assert got.lr_scale == (float(scale.replace("_", ".")) if scale else 1.0), name
        scales.setdefault(base, []).append(got.lr_scale)
    assert scales == {m: [1.0, 1.5, 2.25] for m in ("baseline", "jagg", "jagg-k4", "jagg-u")}
