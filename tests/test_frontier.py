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

from jagg_core import group_backward
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
    t = [1000.0 - 1000.0 * i / 12 for i in range(8)]  # the toy's steps 0-7 of 12
    model = NonlinearVelocity(seed=3)
    ts, zs = segment_group(t, batch=3, off_segment=0.3)
    velocity, step_loss = ppo_problem(model, ts, zs)
    counts = {"grad_forwards": 0, "nograd_forwards": 0, "reused_velocities": 0}
    for g in plan_groups(8, method.window, float(method.jagg_frac), mode=method.mode):
        steps = list(g.steps)
        kept = (lambda j, steps=steps: velocity(steps[j]).detach()) if method.reuse_rollout_velocity else None
        stats = group_backward(lambda j, steps=steps: velocity(steps[j]),
                               lambda j, v, steps=steps: step_loss(steps[j], v), ts[steps], g.mode, method.variant,
                               anchors=method.anchors, middle_velocity=kept)
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
