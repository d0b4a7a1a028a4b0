"""Gradient fidelity along a trajectory, and the jagg_frac it implies."""

from __future__ import annotations

import math

import torch

from jagg_core import gradient_fidelity, jagg_frac_from_cosines
from velocity_models import AffineVelocity, NonlinearVelocity, flat_grad, ppo_problem, segment_group


def _trajectory(model, seed, off_segment):
    # Three groups of W = 4 on one trajectory, each group's inputs on its own segment (or pushed off it).
    t = [1000.0, 930.0, 820.0, 760.0, 640.0, 600.0, 470.0, 380.0, 300.0, 210.0, 140.0, 60.0]
    zs, ts = [], []
    for k in range(3):
        tk, zk = segment_group(t[4 * k : 4 * k + 4], seed=seed + k, off_segment=off_segment[k])
        zs += zk
        ts.append(tk)
    return torch.cat(ts), zs


def test_fidelity_is_one_where_theorem1_holds_and_lower_elsewhere():
    model = AffineVelocity()
    t, zs = _trajectory(model, seed=0, off_segment=[0.0, 0.0, 4.0])
    velocity, step_loss = ppo_problem(model, t, zs)
    model.zero_grad(set_to_none=True)
    report = gradient_fidelity(model.parameters(), velocity, step_loss, t, 4)
    assert report.positions == [0, 1, 2]
    assert report.cos_jagg[0] > 1 - 1e-10 and report.cos_jagg[1] > 1 - 1e-10
    assert report.cos_jagg[2] < 0.999
    assert all(c < 1 - 1e-6 for c in report.cos_ablate)
    assert report.jagg_frac(threshold=0.9999) == 2 / 3
    assert all(p.grad is None for p in model.parameters())  # grads restored


def test_fidelity_restores_existing_grads():
    model = NonlinearVelocity()
    t, zs = _trajectory(model, seed=3, off_segment=[0.1, 0.1, 0.1])
    velocity, step_loss = ppo_problem(model, t, zs)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    before = flat_grad(model).clone()
    report = gradient_fidelity(model.parameters(), velocity, step_loss, t, 4, anchors=3)
    assert torch.equal(flat_grad(model), before)
    assert len(report.cos_jagg) == 3 and all(-1 <= c <= 1 for c in report.cos_jagg)


def test_jagg_frac_from_cosines_counts_the_leading_run():
    assert jagg_frac_from_cosines([0.9, 0.8, 0.4, 0.9, 0.7], 0.5) == 0.4
    assert jagg_frac_from_cosines([0.9, 0.8], 0.5) == 1.0
    assert jagg_frac_from_cosines([0.3, 0.9], 0.5) == 0.0
    assert jagg_frac_from_cosines([0.9, math.nan, 0.9], 0.5) == 1 / 3
    assert jagg_frac_from_cosines([], 0.5) == 0.0
