"""JAGG group backward against slow, obviously-correct references, in float64 (arXiv:2607.17572, Eq. 6–7 and
Theorem 1)."""

from __future__ import annotations

import weakref

import pytest
import torch

from jagg_core import (
    aggregate_upstream,
    anchor_positions,
    anchor_weights,
    draw_random_anchor,
    Estimator,
    group_backward,
    group_surrogate,
    inner_product,
    interpolation_weights,
    plan_groups,
    random_anchor_probabilities,
)
from velocity_models import (
    AffineVelocity,
    NonlinearVelocity,
    PiecewiseAffineVelocity,
    flat_grad,
    piecewise_segment_group,
    ppo_problem,
    rel_err,
    segment_group,
)

UNEVEN_T = [1000.0, 910.0, 700.0, 655.0, 380.0, 120.0]  # W = 6, deliberately uneven spacing


# --- slow references ---------------------------------------------------------------------------------------------


def exact_reference(model, velocity, step_loss, w):
    """Σ_j ∂L_j(v_θ(z_j, t_j))/∂θ straight through the model, one step at a time, no proxies."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for j in range(w):
        out = step_loss(j, velocity(j))
        loss = out[0] if isinstance(out, tuple) else out
        for acc, g in zip(total, torch.autograd.grad(loss, params)):
            acc += g
    return torch.cat([g.reshape(-1) for g in total])


def jacobian(model, velocity, j):
    """J_j = ∂ vec(v_j) / ∂θ as a dense (B·D, P) matrix, one output row at a time."""
    params = list(model.parameters())
    v = velocity(j).reshape(-1)
    rows = []
    for i in range(v.numel()):
        gs = torch.autograd.grad(v[i], params, retain_graph=True)
        rows.append(torch.cat([g.reshape(-1) for g in gs]))
    return torch.stack(rows)


def upstream(step_loss, velocity, j):
    v = velocity(j).detach().requires_grad_(True)
    out = step_loss(j, v)
    loss = out[0] if isinstance(out, tuple) else out
    (s,) = torch.autograd.grad(loss, v)
    return s.reshape(-1)


def jagg_reference(model, velocity, step_loss, t):
    """Eq. 6–7 literally: Σ_j ((1 − α_j) J_0 + α_j J_{W−1})ᵀ s_j with dense Jacobians."""
    w = len(t)
    t = torch.as_tensor(t, dtype=torch.float64)
    alpha = (t[0] - t) / (t[0] - t[-1])
    j0, j1 = jacobian(model, velocity, 0), jacobian(model, velocity, w - 1)
    return sum(((1 - a) * j0 + a * j1).T @ upstream(step_loss, velocity, j) for j, a in enumerate(alpha))


def batched_velocity(model, t, zs, calls):
    """``velocity_batch`` for :func:`group_backward`: the steps ``js`` in one model call, each call noted in ``calls``."""

    def velocity_batch(js):
        calls.append(tuple(js))
        b = zs[0].shape[0]
        v = model(torch.cat([zs[j] for j in js]), torch.cat([t[j].expand(b) for j in js]))
        return list(v.split(b))

    return velocity_batch


ESTIMATOR_FIELDS = ("anchors", "anchor_at", "random_anchor", "random_anchor_p", "random_anchor_weight")


def run(model, velocity, step_loss, t, mode, variant="joint", **kw):
    """The group's gradient by :func:`group_backward`; the estimator's fields among ``kw`` go into its Estimator."""
    model.zero_grad(set_to_none=True)
    est = {k: kw.pop(k) for k in ESTIMATOR_FIELDS if k in kw}
    if est:
        kw["estimator"] = Estimator(**est)
    stats = group_backward(velocity, step_loss, t, mode, variant, **kw)
    return flat_grad(model), stats


# --- weights and routing -----------------------------------------------------------------------------------------


def test_interpolation_weights_are_t_weighted_not_index_based():
    alpha = interpolation_weights([1.0, 0.9, 0.4, 0.0])
    torch.testing.assert_close(alpha, torch.tensor([0.0, 0.1, 0.6, 1.0], dtype=torch.float64), rtol=0, atol=1e-15)
    assert not torch.allclose(alpha, torch.linspace(0, 1, 4, dtype=torch.float64))
    # even spacing reduces to j / (W − 1)
    torch.testing.assert_close(interpolation_weights([800, 600, 400, 200]), torch.tensor([0, 1 / 3, 2 / 3, 1.0],
                               dtype=torch.float64))


@pytest.mark.parametrize("bad", [[1.0], [1.0, 1.0, 0.5], [1.0, 0.5, 0.7]])
def test_interpolation_weights_refuse_degenerate_groups(bad):
    with pytest.raises(ValueError):
        interpolation_weights(bad)


def test_aggregate_upstream_by_hand():
    s = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]), torch.tensor([4.0, 4.0])]
    s_base, s_corr = aggregate_upstream(s, [10.0, 7.0, 0.0])  # α = 0, 0.3, 1
    torch.testing.assert_close(s_base, torch.tensor([1.0, 1.4]))
    torch.testing.assert_close(s_corr, torch.tensor([4.0, 4.6]))


def test_anchor_weights_generalise_the_two_endpoint_rule():
    t = torch.tensor(UNEVEN_T, dtype=torch.float64)
    alpha = interpolation_weights(t)
    m2 = anchor_weights(t)
    torch.testing.assert_close(m2, torch.stack([1 - alpha, alpha], dim=1))
    assert anchor_positions(6, 2) == (0, 5) and anchor_positions(6, 3) == (0, 2, 5) and anchor_positions(8, 3) == (0, 4, 7)
    m3 = anchor_weights(t, (0, 2, 5))
    torch.testing.assert_close(m3.sum(dim=1), torch.ones(6, dtype=torch.float64))  # a partition of unity per step
    a = (t[0] - t[1]) / (t[0] - t[2])
    torch.testing.assert_close(m3[1], torch.tensor([1 - a, a, 0.0], dtype=torch.float64))
    torch.testing.assert_close(m3[2], torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(anchor_weights(t, tuple(range(6))), torch.eye(6, dtype=torch.float64))


def test_plan_groups_routes_leading_groups_and_keeps_partial_group_exact():
    groups = plan_groups(18, 4, 0.6, mode="jagg")
    assert [g.steps for g in groups] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15), (16, 17)]
    # round(0.6 · 4 full groups) = 2 JAGG groups, high-noise first; the partial group is exact
    assert [g.mode for g in groups] == ["jagg", "jagg", "exact", "exact", "exact"]
    assert [g.mode for g in plan_groups(18, 4, 1.0, mode="ablate")] == ["ablate"] * 4 + ["exact"]
    assert {g.mode for g in plan_groups(18, 4, 1.0, mode="exact")} == {"exact"}
    assert {g.mode for g in plan_groups(8, 4, 0.0)} == {"exact"}
    assert [g.mode for g in plan_groups(12, 4, 0.6)] == ["jagg", "jagg", "exact"]  # 0.6 · 3 = 1.8 → 2
    assert [g.mode for g in plan_groups(8, 4, 0.6)] == ["jagg", "exact"]  # 1.2 → 1
    custom = plan_groups([3, 4, 5, 6, 7, 8], 3, 0.5)  # trained step indices, e.g. a Flow-GRPO-Fast SDE window
    assert [(g.steps, g.mode, g.position) for g in custom] == [((3, 4, 5), "jagg", 0), ((6, 7, 8), "exact", 1)]


def test_plan_groups_subsamples_whole_groups_and_keeps_their_routing():
    full = plan_groups(32, 4, 0.5)
    seen = set()
    for seed in range(20):
        sub = plan_groups(32, 4, 0.5, fraction=0.5, subset="random", generator=torch.Generator().manual_seed(seed))
        assert len(sub) == 4
        assert [g.position for g in sub] == sorted(g.position for g in sub)
        for g in sub:
            assert g == full[g.position]  # whole groups with the routing of their place in the trajectory
        seen.add(tuple(g.position for g in sub))
    assert len(seen) > 1


@pytest.mark.parametrize(
    "kwargs", [dict(window=0, jagg_frac=0.5), dict(window=4, jagg_frac=1.5), dict(window=4, jagg_frac=-0.1),
               dict(window=4, jagg_frac=0.5, mode="fast"), dict(window=4, jagg_frac=0.5, fraction=0.0),
               dict(window=4, jagg_frac=0.5, fraction=0.5), dict(window=4, jagg_frac=0.5, fraction=0.5, subset="all"),
               dict(window=2.0, jagg_frac=0.5)]
)
def test_plan_groups_refuses_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        plan_groups(16, **kwargs)


def test_plan_groups_takes_flow_grpos_prefix_and_an_off_switch():
    """Flow-GRPO trains range(int(T · timestep_fraction)): 0.99 of 10 steps is steps 0-8, never step 9; W = 1 is
    the per-step loop, every step exact whatever the mode."""
    prefix = plan_groups(10, 4, 1.0, fraction=0.99, subset="prefix")
    assert [(g.steps, g.mode) for g in prefix] == [((0, 1, 2, 3), "jagg"), ((4, 5, 6, 7), "jagg"), ((8,), "exact")]
    assert [(g.steps, g.mode) for g in plan_groups(10, 4, 0.5, fraction=0.6, subset="prefix")] == [
        ((0, 1, 2, 3), "jagg"), ((4, 5), "exact")]
    off = plan_groups(9, 1, 1.0, mode="jagg")
    assert [(g.steps, g.mode) for g in off] == [((j,), "exact") for j in range(9)]
    with pytest.raises(ValueError, match="subset='prefix'"):
        plan_groups(10, 4, 0.5, fraction=0.99)  # the tempting call: which steps is not guessed


# --- Theorem 1 ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["flow_grpo", "dance_grpo", "cps"])
@pytest.mark.parametrize("variant", ["joint", "sequential"])
def test_theorem1_jagg_is_exact_for_affine_velocity_on_the_segment(kind, variant):
    model = AffineVelocity()
    t, zs = segment_group(UNEVEN_T)
    velocity, step_loss = ppo_problem(model, t, zs, kind=kind)
    g_exact = exact_reference(model, velocity, step_loss, len(t))
    g_jagg, stats = run(model, velocity, step_loss, t, "jagg", variant)
    assert stats.extras["clipfrac"] < 1.0  # the PPO losses are live, not all clipped away
    assert rel_err(g_jagg, g_exact) <= 1e-10
    g_base, _ = run(model, velocity, step_loss, t, "exact")
    assert rel_err(g_base, g_exact) <= 1e-12


def test_theorem1_fails_once_inputs_leave_the_segment():
    model = AffineVelocity()
    t, zs = segment_group(UNEVEN_T, off_segment=0.5)
    velocity, step_loss = ppo_problem(model, t, zs)
    g_exact = exact_reference(model, velocity, step_loss, len(t))
    g_jagg, _ = run(model, velocity, step_loss, t, "jagg")
    assert rel_err(g_jagg, g_exact) > 1e-3


def test_theorem1_fails_for_a_velocity_nonlinear_in_z():
    model = NonlinearVelocity()
    t, zs = segment_group(UNEVEN_T)
    velocity, step_loss = ppo_problem(model, t, zs)
    g_exact = exact_reference(model, velocity, step_loss, len(t))
    g_jagg, _ = run(model, velocity, step_loss, t, "jagg")
    assert rel_err(g_jagg, g_exact) > 1e-3


def test_theorem1_needs_t_weighting_on_uneven_steps():
    """Index-based weights j/(W−1) are wrong when the timesteps are unevenly spaced: JAGG must use t."""
    model = AffineVelocity()
    t, zs = segment_group(UNEVEN_T)
    velocity, step_loss = ppo_problem(model, t, zs)
    g_exact = exact_reference(model, velocity, step_loss, len(t))
    s = [upstream(step_loss, velocity, j) for j in range(len(t))]
    idx_alpha = torch.linspace(0, 1, len(t), dtype=torch.float64)
    j0, j1 = jacobian(model, velocity, 0), jacobian(model, velocity, len(t) - 1)
    g_index = sum(((1 - a) * j0 + a * j1).T @ s_j for a, s_j in zip(idx_alpha, s))
    assert rel_err(g_index, g_exact) > 1e-3


def test_jagg_matches_the_dense_jacobian_formula_off_theorem():
    """Away from Theorem 1's premise JAGG is an approximation — but exactly Eq. 6–7's approximation."""
    model = NonlinearVelocity(seed=3)
    t, zs = segment_group(UNEVEN_T, off_segment=0.3, seed=4)
    velocity, step_loss = ppo_problem(model, t, zs)
    g_ref = jagg_reference(model, velocity, step_loss, t)
    for variant in ("joint", "sequential"):
        g, _ = run(model, velocity, step_loss, t, "jagg", variant)
        assert rel_err(g, g_ref) <= 1e-12


# --- invariants --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["jagg", "ablate"])
def test_joint_equals_sequential(mode):
    model = NonlinearVelocity(seed=5)
    t, zs = segment_group(UNEVEN_T, off_segment=0.4, seed=6)
    velocity, step_loss = ppo_problem(model, t, zs)
    g_joint, _ = run(model, velocity, step_loss, t, mode, "joint")
    g_seq, _ = run(model, velocity, step_loss, t, mode, "sequential")
    assert rel_err(g_seq, g_joint) <= 1e-12


@pytest.mark.parametrize("mode", ["jagg", "ablate"])
def test_window_two_is_exact(mode):
    model = NonlinearVelocity(seed=7)
    t, zs = segment_group([900.0, 450.0], off_segment=0.0, seed=8)
    velocity, step_loss = ppo_problem(model, t, zs)
    g_exact = exact_reference(model, velocity, step_loss, 2)
    g, _ = run(model, velocity, step_loss, t, mode)
    assert rel_err(g, g_exact) <= 1e-12


def test_ablate_discards_middle_signals():
    model = NonlinearVelocity(seed=9)
    t, zs = segment_group(UNEVEN_T, off_segment=0.2, seed=10)
    velocity, step_loss = ppo_problem(model, t, zs)
    g_jagg, _ = run(model, velocity, step_loss, t, "jagg")
    g_ablate, _ = run(model, velocity, step_loss, t, "ablate")
    assert rel_err(g_ablate, g_jagg) > 1e-2
    # ablate = J_0ᵀ s_0 + J_{W−1}ᵀ s_{W−1}
    w = len(t)
    j0, j1 = jacobian(model, velocity, 0), jacobian(model, velocity, w - 1)
    ref = j0.T @ upstream(step_loss, velocity, 0) + j1.T @ upstream(step_loss, velocity, w - 1)
    assert rel_err(g_ablate, ref) <= 1e-12


@pytest.mark.parametrize("variant", ["joint", "sequential"])
def test_weight_matched_ablate_scales_the_endpoints_to_the_group_weight(variant):
    model = NonlinearVelocity(seed=9)
    t, zs = segment_group(UNEVEN_T, off_segment=0.2, seed=10)
    velocity, step_loss = ppo_problem(model, t, zs)
    w = len(t)
    # (W/2)·(J_0ᵀ s_0 + J_{W−1}ᵀ s_{W−1}): the two anchors carry the weight of all W steps
    j0, j1 = jacobian(model, velocity, 0), jacobian(model, velocity, w - 1)
    ref = (w / 2) * (j0.T @ upstream(step_loss, velocity, 0) + j1.T @ upstream(step_loss, velocity, w - 1))
    g, stats = run(model, velocity, step_loss, t, "ablate_matched", variant)
    assert rel_err(g, ref) <= 1e-12
    assert stats.mode == "ablate_matched" and stats.grad_forwards == 2


def test_accumulates_into_existing_grads_like_backward():
    model = NonlinearVelocity(seed=11)
    t, zs = segment_group(UNEVEN_T, seed=12)
    velocity, step_loss = ppo_problem(model, t, zs)
    g_once, _ = run(model, velocity, step_loss, t, "jagg")
    group_backward(velocity, step_loss, t, "jagg")  # on top of the grads already there
    assert rel_err(flat_grad(model), 2 * g_once) <= 1e-14


# --- counts and graph lifetimes ----------------------------------------------------------------------------------


class CountingVelocity:
    """Wraps a velocity fn, recording the grad mode of each call; counts backward calls via a tensor hook."""

    def __init__(self, velocity):
        self.velocity = velocity
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, j):
        self.calls.append((j, torch.is_grad_enabled()))
        return self.velocity(j)


@pytest.mark.parametrize(
    "mode,variant,grad_fwd,nograd_fwd,backwards",
    [("exact", "joint", 6, 0, 6), ("jagg", "joint", 2, 4, 1), ("jagg", "sequential", 2, 4, 2),
     ("ablate", "joint", 2, 4, 1), ("ablate", "sequential", 2, 4, 2)],
)
def test_forward_and_backward_counts(mode, variant, grad_fwd, nograd_fwd, backwards, monkeypatch):
    model = AffineVelocity()
    t, zs = segment_group(UNEVEN_T)
    velocity, step_loss = ppo_problem(model, t, zs)
    counting = CountingVelocity(velocity)
    n_backward = []
    real_backward = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: (n_backward.append(1), real_backward(*a, **k)))
    model.zero_grad(set_to_none=True)
    stats = group_backward(counting, step_loss, t, mode, variant)
    with_grad = [j for j, g in counting.calls if g]
    without = [j for j, g in counting.calls if not g]
    assert (len(with_grad), len(without), len(n_backward)) == (grad_fwd, nograd_fwd, backwards)
    assert (stats.grad_forwards, stats.nograd_forwards, stats.backward_calls) == (grad_fwd, nograd_fwd, backwards)
    if mode != "exact":
        assert sorted(with_grad) == [0, 5] and sorted(without) == [1, 2, 3, 4]  # the middle really runs no_grad


def test_sequential_frees_the_first_graph_before_the_last_forward():
    model = AffineVelocity()
    t, zs = segment_group(UNEVEN_T)
    velocity, step_loss = ppo_problem(model, t, zs)
    saved: dict[int, list[weakref.ref]] = {}
    current = {"j": None}
    alive_at_forward: dict[int, int] = {}

    class Saved:  # a box per saved tensor, so its lifetime can be watched with a weakref
        def __init__(self, x):
            self.x = x

    def pack(x):
        box = Saved(x)
        saved.setdefault(current["j"], []).append(weakref.ref(box))
        return box

    def unpack(box):
        return box.x

    def watched(j):
        if torch.is_grad_enabled():
            alive_at_forward[j] = sum(r() is not None for refs in saved.values() for r in refs)
        current["j"] = j
        return velocity(j)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        group_backward(watched, step_loss, t, "jagg", "sequential")
    assert saved[0], "the endpoint forward saved tensors for backward"
    assert alive_at_forward[5] == 0  # nothing of step 0's graph survives when step W−1 is forwarded
    # the joint variant, by contrast, holds both graphs at once
    saved.clear()
    alive_at_forward.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        group_backward(watched, step_loss, t, "jagg", "joint")
    assert alive_at_forward[5] > 0


def test_a_clipped_step_has_zero_signal_and_contributes_nothing():
    model = NonlinearVelocity(seed=13)
    t, zs = segment_group([900.0, 600.0, 300.0], seed=14)
    velocity, _ = ppo_problem(model, t, zs)
    # Old log-probs far below the current ones: ratio ≫ 1 + ε with positive advantages → clipped, s_j = 0.
    from jagg_core import ppo_step_loss, sde_step_with_logprob

    sig = t / 1000.0
    batch = zs[0].shape[0]
    adv = torch.ones(batch, dtype=torch.float64)
    with torch.no_grad():
        steps = [sde_step_with_logprob(zs[j], velocity(j), float(sig[j]), float(sig[j]) * 0.8, noise_level=0.7,
                                       generator=torch.Generator().manual_seed(j)) for j in range(3)]

    def loss_with(clipped_step):
        def step_loss(j, v):
            step = sde_step_with_logprob(zs[j], v, float(sig[j]), float(sig[j]) * 0.8, noise_level=0.7,
                                         prev_sample=steps[j].prev_sample)
            old = steps[j].log_prob - (10.0 if j == clipped_step else 0.0)
            return ppo_step_loss(step.log_prob, old, adv, clip_range=0.2).loss
        return step_loss

    s1 = upstream(loss_with(1), velocity, 1)
    assert torch.count_nonzero(s1) == 0
    g_with, _ = run(model, velocity, loss_with(1), t, "jagg")

    def without_middle(j, v):  # the same group with step 1's loss removed altogether
        return loss_with(None)(j, v) * (0.0 if j == 1 else 1.0)

    g_without, _ = run(model, velocity, without_middle, t, "jagg")
    assert rel_err(g_with, g_without) <= 1e-14


# --- K anchors and velocity reuse --------------------------------------------------------------------------------


def test_two_anchors_is_jagg_and_w_anchors_is_exact():
    model = NonlinearVelocity(seed=15)
    t, zs = segment_group(UNEVEN_T, off_segment=0.3, seed=16)
    velocity, step_loss = ppo_problem(model, t, zs)
    g_jagg, _ = run(model, velocity, step_loss, t, "jagg")
    g_k2, _ = run(model, velocity, step_loss, t, "jagg", anchors=2)
    assert rel_err(g_k2, g_jagg) == 0.0
    g_exact = exact_reference(model, velocity, step_loss, len(t))
    for variant in ("joint", "sequential"):
        g_kw, stats = run(model, velocity, step_loss, t, "jagg", variant, anchors=len(t))
        assert rel_err(g_kw, g_exact) <= 1e-12
        assert stats.nograd_forwards == 0 and stats.grad_forwards == len(t)


def test_piecewise_theorem1_three_anchors():
    """A model affine on each piece with inputs on each piece's segment: K = 3 anchors are exact, K = 2 are not."""
    anchors = anchor_positions(len(UNEVEN_T), 3)  # (0, 2, 5)
    model = PiecewiseAffineVelocity(t_knot=UNEVEN_T[anchors[1]], seed=17)
    t, zs = piecewise_segment_group(UNEVEN_T, anchors, seed=18)
    velocity, step_loss = ppo_problem(model, t, zs)
    g_exact = exact_reference(model, velocity, step_loss, len(t))
    g_k3, stats = run(model, velocity, step_loss, t, "jagg", anchors=3)
    assert stats.grad_forwards == 3 and stats.nograd_forwards == 3
    assert rel_err(g_k3, g_exact) <= 1e-10
    g_k2, _ = run(model, velocity, step_loss, t, "jagg", anchors=2)
    assert rel_err(g_k2, g_exact) > 1e-3


def test_reused_middle_velocities_give_the_same_gradient_without_middle_forwards():
    model = NonlinearVelocity(seed=20)
    t, zs = segment_group(UNEVEN_T, off_segment=0.3, seed=21)
    velocity, step_loss = ppo_problem(model, t, zs)
    with torch.no_grad():
        kept = {j: velocity(j) for j in range(len(t))}
    g_ref, _ = run(model, velocity, step_loss, t, "jagg")
    counting = CountingVelocity(velocity)
    g_reuse, stats = run(model, counting, step_loss, t, "jagg", middle_velocity=kept.get)
    assert rel_err(g_reuse, g_ref) <= 1e-12
    assert stats.nograd_forwards == 0 and stats.reused_velocities == len(t) - 2
    assert sorted(j for j, _ in counting.calls) == [0, len(t) - 1]


def test_batched_anchor_forward_is_one_call_with_the_same_gradient():
    model = NonlinearVelocity(seed=22)
    t, zs = segment_group(UNEVEN_T, off_segment=0.3, seed=23)
    velocity, step_loss = ppo_problem(model, t, zs)
    g_ref, _ = run(model, velocity, step_loss, t, "jagg")
    calls = []
    velocity_batch = batched_velocity(model, t, zs, calls)

    lasts = []
    g, stats = run(model, velocity, step_loss, t, "jagg", velocity_batch=velocity_batch, before_backward=lasts.append)
    assert rel_err(g, g_ref) <= 1e-12
    assert calls == [(0, 5)] and stats.forward_calls == 1 + 4 and stats.grad_forwards == 2
    assert lasts == [True]
    lasts.clear()
    run(model, velocity, step_loss, t, "exact", before_backward=lasts.append)
    assert lasts == [False] * 5 + [True]


def test_exact_batched_is_exact_in_one_forward_call_and_one_backward(monkeypatch):
    """exact_batched: every step of the group in ONE with-grad forward call and ONE backward, the exact gradient."""
    model = NonlinearVelocity(seed=24)
    t, zs = segment_group(UNEVEN_T, off_segment=0.3, seed=25)
    velocity, step_loss = ppo_problem(model, t, zs)
    g_exact, _ = run(model, velocity, step_loss, t, "exact")
    assert rel_err(g_exact, exact_reference(model, velocity, step_loss, len(t))) <= 1e-12
    calls = []
    velocity_batch = batched_velocity(model, t, zs, calls)

    n_backward = []
    real_backward = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: (n_backward.append(1), real_backward(*a, **k)))
    lasts = []
    g, stats = run(model, velocity, step_loss, t, "exact_batched", velocity_batch=velocity_batch,
                   before_backward=lasts.append)
    assert rel_err(g, g_exact) <= 1e-12
    assert calls == [tuple(range(len(t)))] and len(n_backward) == 1 and lasts == [True]
    assert (stats.mode, stats.forward_calls, stats.grad_forwards, stats.nograd_forwards, stats.backward_calls) == (
        "exact_batched", 1, len(t), 0, 1)
    g_unbatched, stats = run(model, velocity, step_loss, t, "exact_batched")  # no velocity_batch: W calls, 1 backward
    assert rel_err(g_unbatched, g_exact) <= 1e-12
    assert (stats.forward_calls, stats.backward_calls) == (len(t), 1)


def test_plan_groups_routes_every_group_of_an_exact_mode():
    groups = plan_groups(10, 4, 0.5, mode="exact_batched")
    assert [(g.steps, g.mode) for g in groups] == [((0, 1, 2, 3), "exact_batched"), ((4, 5, 6, 7), "exact_batched"),
                                                    ((8, 9), "exact_batched")]


# --- the random anchor: an unbiased JAGG (docs/frontier.md) ------------------------------------------------------

W8_T = [1000.0, 955.0, 880.0, 790.0, 650.0, 520.0, 330.0, 140.0]  # W = 8, uneven


def rows_velocity(model, t, zs, calls=None):
    """``velocity_rows`` for :func:`group_backward`: image ``rows[i]`` at step ``js[i]``, in one model call."""
    stacked = torch.stack(list(zs))  # (W, B, D)

    def velocity_rows(rows, js):
        if calls is not None:
            calls.append((rows.tolist(), js.tolist()))
        return model(stacked[js, rows], t[js])

    return velocity_rows


def w8_problem(seed):
    model = NonlinearVelocity(seed=seed)
    t, zs = segment_group(W8_T, batch=6, off_segment=0.4, seed=seed + 1)
    velocity, step_loss = ppo_problem(model, t, zs, seed=seed + 2)
    return model, t, zs, velocity, step_loss


@pytest.mark.parametrize("law", ["uniform", "alpha", [0, 1.0, 3.0, 0.5, 2.0, 1.0, 4.0, 0]])
@pytest.mark.parametrize("variant", ["joint", "sequential"])
@pytest.mark.parametrize("anchor_at", [None, (0, 3, 7)])
def test_the_random_anchor_averaged_over_its_law_is_the_exact_gradient(law, variant, anchor_at):
    """Σ_r p_r g_r over every non-anchor step r (one group's draw) is Σ_j J_jᵀ s_j to float64 rounding, whatever the
    law and the base anchors, while each g_r and JAGG alone are off by percents."""
    model, t, zs, velocity, step_loss = w8_problem(40)
    g_exact = exact_reference(model, velocity, step_loss, len(t))
    pos = (0, 7) if anchor_at is None else anchor_at
    p = random_anchor_probabilities(t, pos, law)
    assert float(p.sum()) == pytest.approx(1.0, abs=1e-15) and all(float(p[a]) == 0.0 for a in pos)
    mean = torch.zeros_like(g_exact)
    for r in [j for j in range(len(t)) if j not in pos]:
        g_r, stats = run(model, velocity, step_loss, t, "jagg", variant, anchor_at=anchor_at, random_anchor="group",
                         random_anchor_p=law, draw=r)
        assert stats.random_anchor == [r] * 6
        assert rel_err(g_r, g_exact) > 1e-4  # one draw is not exact
        mean += float(p[r]) * g_r
    assert rel_err(mean, g_exact) <= 1e-12
    g_jagg, _ = run(model, velocity, step_loss, t, "jagg", variant, anchor_at=anchor_at)
    assert rel_err(g_jagg, g_exact) > 1e-3


@pytest.mark.parametrize("variant", ["joint", "sequential"])
def test_per_image_draws_route_each_row_to_its_own_step(variant):
    """One call with every row at its own drawn step: over the six cyclic draws (row i at middle step (i + m) mod 6)
    each row meets every step once, so with the uniform law their mean is exact; each call forwards the probe in one
    call of velocity_rows and every middle step without grad only on the rows that did not draw it."""
    model, t, zs, velocity, step_loss = w8_problem(50)
    g_exact = exact_reference(model, velocity, step_loss, len(t))
    mids = list(range(1, 7))
    mean = torch.zeros_like(g_exact)
    for m in range(6):
        draw = torch.tensor([mids[(i + m) % 6] for i in range(6)])
        calls = []
        g, stats = run(model, velocity, step_loss, t, "jagg", variant, random_anchor="image", draw=draw,
                       velocity_rows=rows_velocity(model, t, zs, calls))
        assert stats.random_anchor == draw.tolist()
        assert calls[0] == (list(range(6)), draw.tolist())  # the probe: every row at its own step, one call
        assert [len(rows) for rows, _ in calls[1:]] == [5] * 6  # each middle step: the five rows that did not draw it
        assert (stats.grad_forwards, stats.nograd_forwards, stats.backward_calls) == (
            3, 5, 1 if variant == "joint" else 2)
        mean += g / 6
    assert rel_err(mean, g_exact) <= 1e-12


def test_a_group_draw_batched_with_the_anchors_is_one_call_and_one_backward():
    model, t, zs, velocity, step_loss = w8_problem(60)
    g_ref, _ = run(model, velocity, step_loss, t, "jagg", random_anchor="group", draw=3)
    calls = []
    counting = CountingVelocity(velocity)
    g, stats = run(model, counting, step_loss, t, "jagg", random_anchor="group", draw=3,
                   velocity_batch=batched_velocity(model, t, zs, calls))
    assert rel_err(g, g_ref) <= 1e-12
    assert calls == [(0, 7, 3)]  # the anchors and the drawn step: one call, one graph
    assert sorted(j for j, _ in counting.calls) == [1, 2, 4, 5, 6]  # the other middle steps, no grad, once each
    assert (stats.grad_forwards, stats.nograd_forwards, stats.forward_calls, stats.backward_calls) == (3, 5, 6, 1)


def test_the_random_anchor_with_reused_velocities_forwards_only_its_graphs():
    model, t, zs, velocity, step_loss = w8_problem(70)
    with torch.no_grad():
        kept = {j: velocity(j) for j in range(len(t))}
    g_ref, _ = run(model, velocity, step_loss, t, "jagg", random_anchor="group", draw=5)
    counting = CountingVelocity(velocity)
    g, stats = run(model, counting, step_loss, t, "jagg", random_anchor="group", draw=5, middle_velocity=kept.get)
    assert rel_err(g, g_ref) <= 1e-12
    assert sorted(j for j, _ in counting.calls) == [0, 5, 7]
    assert (stats.grad_forwards, stats.nograd_forwards, stats.reused_velocities) == (3, 0, 6)


def test_random_anchor_draws_follow_their_law_and_are_stratified_per_image():
    t = torch.tensor(W8_T, dtype=torch.float64)
    p = random_anchor_probabilities(t, (0, 7), "alpha")
    alpha = interpolation_weights(t)
    torch.testing.assert_close(p, alpha * (1 - alpha) / float((alpha * (1 - alpha)).sum()), rtol=0, atol=1e-15)
    uniform = random_anchor_probabilities(t, (0, 7), "uniform")
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # 12 rows over 6 steps, stratified: every step exactly twice
        r = draw_random_anchor(uniform, 12, "image", g)
        assert sorted(r.tolist()) == sorted([1, 2, 3, 4, 5, 6] * 2)
    counts = torch.zeros(8)  # one row's marginal is the law: row 0 over 6000 draws
    for _ in range(6000):
        counts[int(draw_random_anchor(p, 5, "image", g)[0])] += 1
    assert float((counts / 6000 - p.float()).abs().max()) < 0.02
    group = draw_random_anchor(p, 5, "group", g)
    assert len(set(group.tolist())) == 1
    same = [draw_random_anchor(p, 9, "image", torch.Generator().manual_seed(3)).tolist() for _ in range(2)]
    assert same[0] == same[1]  # a seeded generator draws the same steps (a resumed run)


def test_a_partial_correction_moves_the_expectation_a_share_of_the_way_from_jagg_to_exact():
    """λ = random_anchor_weight: E g = JAGG + λ (exact − JAGG); λ = 0 is JAGG itself, draw by draw."""
    model, t, zs, velocity, step_loss = w8_problem(90)
    g_exact = exact_reference(model, velocity, step_loss, len(t))
    g_jagg, _ = run(model, velocity, step_loss, t, "jagg")
    p = random_anchor_probabilities(t, (0, 7), "uniform")
    for lam in (0.0, 0.5):
        mean = torch.zeros_like(g_exact)
        for r in range(1, 7):
            g_r, _ = run(model, velocity, step_loss, t, "jagg", random_anchor="group", random_anchor_weight=lam, draw=r)
            if lam == 0.0:
                assert rel_err(g_r, g_jagg) <= 1e-12
            mean += float(p[r]) * g_r
        assert rel_err(mean, g_jagg + lam * (g_exact - g_jagg)) <= 1e-12


@pytest.mark.parametrize("bad, words", [
    ({"random_anchor": "group", "random_anchor_weight": 1.5}, "random_anchor_weight must be"),
    ({"random_anchor": "image"}, "needs velocity_rows"),
    ({"random_anchor": "step"}, "random_anchor must be"),
    ({"random_anchor": "group", "random_anchor_p": [1, 1, 0, 1, 1, 1, 1, 1]}, "positive random anchor weight"),
    ({"random_anchor": "group", "random_anchor_p": "sqrt"}, "'uniform', 'alpha'"),
    ({"anchor_at": (1, 4, 7)}, "anchor_at must increase strictly from 0"),
    ({"random_anchor": "group", "draw": 7}, "not an anchor"),
])
def test_bad_random_anchor_options_are_one_sentence(bad, words):
    model, t, zs, velocity, step_loss = w8_problem(80)
    with pytest.raises(ValueError, match=words):
        run(model, velocity, step_loss, t, "jagg", **bad)


# --- the caller's backward: group_surrogate and backward= ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode, est", [("exact", {}), ("exact_batched", {}), ("jagg", {}), ("jagg", {"anchors": 3}),
                                       ("ablate", {}), ("ablate_matched", {}),
                                       ("jagg", {"random_anchor": "group"})])
def test_the_surrogate_and_the_backward_hook_give_group_backwards_gradient_to_the_last_bit(dtype, mode, est):
    """group_surrogate's scalar, backpropagated by the caller, and group_backward(backward=) both give
    group_backward's own gradient bit for bit (float32 and float64); the scalar's value is the group's loss. An exact
    group's surrogate is one backward over its W graphs: exact_batched's gradient (the per-step loop's sums its W
    backwards in another order, equal to rounding)."""
    model, t, zs, velocity, step_loss = w8_problem(60)
    model.to(dtype)
    zs_d = [z.to(dtype) for z in zs]

    def velocity_d(j):
        return model(zs_d[j], t[j].to(dtype).expand(zs_d[j].shape[0]))

    def loss_d(j, v):
        return step_loss(j, v.to(torch.float64))

    estimator = Estimator(**est)
    draw = {"draw": 3} if est.get("random_anchor") else {}
    g_ref, stats = run(model, velocity_d, loss_d, t, mode, estimator=estimator, **draw)
    model.zero_grad(set_to_none=True)
    out = group_surrogate(velocity_d, loss_d, t, mode, estimator=estimator, **draw)
    assert out.loss.ndim == 0 and out.stats.backward_calls == 1
    assert float(out.loss.detach()) == pytest.approx(stats.loss, rel=1e-6, abs=1e-9)
    out.loss.backward()
    if mode == "exact":  # one backward over W graphs: the per-step sums in another order
        assert rel_err(flat_grad(model), g_ref) <= (1e-12 if dtype == torch.float64 else 1e-5)
    else:
        assert torch.equal(flat_grad(model), g_ref)
    calls = []
    g_hook, hook_stats = run(model, velocity_d, loss_d, t, mode, estimator=estimator,
                             backward=lambda x: (calls.append(x.ndim), x.backward()), **draw)
    if mode == "exact":  # each step's own loss, backpropagated: the per-step loop itself
        model.zero_grad(set_to_none=True)
        for j in range(len(t)):
            loss_d(j, velocity_d(j))[0].backward()
        g_ref = flat_grad(model)
    assert torch.equal(g_hook, g_ref)
    assert calls == [0] * stats.backward_calls == [0] * hook_stats.backward_calls


def test_the_surrogate_scaled_by_the_caller_scales_the_gradient_as_a_grad_scaler_does():
    """A GradScaler multiplies the loss by 2^k before backward; the surrogate's cotangents stay float32 until then, so
    a half-precision output gets (2^k · s) cast once, as the loss's own gradient would, not 2^k · (s cast)."""
    model, t, zs, velocity, step_loss = w8_problem(61)
    g_ref, _ = run(model, velocity, step_loss, t, "jagg")
    model.zero_grad(set_to_none=True)
    (group_surrogate(velocity, step_loss, t, "jagg").loss * 1024.0).backward()
    assert torch.equal(flat_grad(model), g_ref * 1024.0)
    v = torch.full((3,), 1.0, dtype=torch.float16, requires_grad=True)
    tiny = torch.full((3,), 2.0 ** -26, dtype=torch.float32)  # below float16's smallest subnormal
    (inner_product([v], [tiny]) * 2.0 ** 16).backward()
    assert torch.equal(v.grad, torch.full((3,), 2.0 ** -10, dtype=torch.float16))


def test_flow_grpos_batch_by_step_timesteps_are_accepted_or_refused_in_one_sentence():
    """Flow-GRPO stores timesteps (B, T): ``[:, steps]`` is a (B, W) group, rows equal; every mode takes it."""
    model, t, zs, velocity, step_loss = w8_problem(62)
    bt = t.expand(zs[0].shape[0], len(t))  # (B, W)
    for mode in ("exact", "jagg"):
        g_1d, _ = run(model, velocity, step_loss, t, mode)
        g_2d, _ = run(model, velocity, step_loss, bt, mode)
        assert torch.equal(g_2d, g_1d)
    uneven = bt.clone()
    uneven[1] += 1.0
    with pytest.raises(ValueError, match="same in every row"):
        run(model, velocity, step_loss, uneven, "exact")


def test_a_step_loss_that_is_not_a_scalar_is_one_sentence():
    model, t, zs, velocity, step_loss = w8_problem(63)
    with pytest.raises(ValueError, match="scalar tensor"):
        run(model, velocity, lambda j, v: 0.5, t, "jagg")
    with pytest.raises(ValueError, match="jagg_core.Estimator"):
        group_backward(velocity, step_loss, t, "jagg", estimator={"anchors": 3})


def test_the_off_switchs_surrogate_is_the_per_step_loops_backward_bit_for_bit():
    """W = 1 (plan_groups' off switch): each group's surrogate is its step's own loss, so a trainer's backward of it
    under any scale (accelerate divides by its accumulation steps, here 3) is the per-step loop's, bit for bit."""
    model, t, zs, velocity, step_loss = w8_problem(64)
    model.zero_grad(set_to_none=True)
    for j in range(len(t)):
        (step_loss(j, velocity(j))[0] / 3).backward()
    g_loop = flat_grad(model)
    model.zero_grad(set_to_none=True)
    for g in plan_groups(len(t), 1, 1.0):
        out = group_surrogate(lambda i, g=g: velocity(g.steps[i]), lambda i, v, g=g: step_loss(g.steps[i], v),
                              t[list(g.steps)], g.mode)
        (out.loss / 3).backward()
    assert torch.equal(flat_grad(model), g_loop)
