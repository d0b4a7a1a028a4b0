"""Coefficients-preserving sampling (CPS, arXiv:2509.05952) as ``sde_kind: cps``: the step against a slow reference
written out from the paper's formulas and against its authors' published (constant-free) log-probability on fixed
numbers, its noiseless last step, and the trainer's update under exact, JAGG and JAGG-reuse with it (first PPO ratio
exactly 1)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import REPO
from jagg_core import sde_step_with_logprob
from jagg_core.loss import kernel_kl
from jagg_core.setup.config import ResolvedMethod, SampleConfig, TrainConfig
from jagg_core.setup.params_io import load_params


def slow_cps(z, v, sigma, sigma_next, eta, prev):
    """Element by element in Python floats: x̂₀ = z − σv, x̂₁ = z + (1 − σ)v, σ_t = σ'·sin(ηπ/2),
    μ = (1 − σ')x̂₀ + sqrt(σ'² − σ_t²)·x̂₁ and log N(prev; μ, σ_t²) averaged over each sample's elements."""
    means, stds, logps = [], [], []
    for b in range(z.shape[0]):
        s, sn = float(sigma[b]), float(sigma_next[b])
        std = sn * math.sin(eta * math.pi / 2)
        row_mu, row_lp = [], []
        for zz, vv, pp in zip(z[b].flatten().tolist(), v[b].flatten().tolist(), prev[b].flatten().tolist()):
            x0, x1 = zz - s * vv, zz + (1 - s) * vv
            mu = (1 - sn) * x0 + math.sqrt(max(sn * sn - std * std, 0.0)) * x1
            row_mu.append(mu)
            row_lp.append(0.0 if std == 0 else -((pp - mu) ** 2) / (2 * std * std) - math.log(std)
                          - 0.5 * math.log(2 * math.pi))
        means.append(row_mu)
        stds.append(std)
        logps.append(sum(row_lp) / len(row_lp))
    return (torch.tensor(means, dtype=torch.float64).view_as(z), torch.tensor(stds, dtype=torch.float64),
            torch.tensor(logps, dtype=torch.float64))


def test_cps_matches_the_slow_reference_in_float64():
    """Per-sample sigmas through the whole schedule: σ = 1 (step 0), the middle, and σ' = 0 (the last step)."""
    g = torch.Generator().manual_seed(0)
    z, v = (torch.randn(5, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    sigma = torch.tensor([1.0, 0.9, 0.55, 0.3, 0.1], dtype=torch.float64)
    sigma_next = torch.tensor([0.9, 0.7, 0.4, 0.05, 0.0], dtype=torch.float64)
    for eta in (0.3, 0.8, 1.0):
        drawn = sde_step_with_logprob(z, v, sigma, sigma_next, noise_level=eta, kind="cps",
                                      generator=torch.Generator().manual_seed(1))
        mean, std, logp = slow_cps(z, v, sigma, sigma_next, eta, drawn.prev_sample)
        assert (drawn.mean - mean).abs().max() <= 1e-6 and (drawn.mean - mean).abs().max() <= 1e-13
        assert (drawn.std.flatten() - std).abs().max() <= 1e-13
        assert (drawn.log_prob - logp).abs().max() <= 1e-12
        eps = torch.randn(z.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        torch.testing.assert_close(drawn.prev_sample, mean + std.view(-1, 1, 1) * eps, rtol=0, atol=1e-13)
        assert torch.equal(drawn.prev_sample[4], drawn.mean[4])  # σ' = 0: the predicted clean sample, no noise


def test_cps_on_fixed_numbers_and_the_published_constant_free_log_prob():
    """z = 0.5, v = −0.2, σ = 0.8, σ' = 0.6, η = 0.5, z' = 0.5, by hand: sin(π/4) = √2/2, σ_t = 0.3√2 (σ_t² = 0.18);
    x̂₀ = 0.66, x̂₁ = 0.46, sqrt(0.36 − 0.18) = 0.3√2, μ = 0.264 + 0.138√2 = 0.459161471607487.
    The authors' log-prob −(z' − μ)² = −0.040838528392513² = −0.00166778540126608; ours is the density:
    that / 0.36 − log(0.3√2) − ½·log 2π = −0.0661720563844482."""
    one = lambda x: torch.tensor([[x]], dtype=torch.float64)  # noqa: E731
    out = sde_step_with_logprob(one(0.5), one(-0.2), 0.8, 0.6, noise_level=0.5, kind="cps", prev_sample=one(0.5))
    assert float(out.std) == pytest.approx(0.3 * math.sqrt(2), abs=1e-15)
    assert float(out.mean) == pytest.approx(0.459161471607487, abs=1e-14)
    assert float(out.log_prob) == pytest.approx(-0.0661720563844482, abs=1e-14)
    # The published form (FlowCPS's sde_step_with_logprob) on the same inputs: their mean, their log-prob.
    std = 0.6 * math.sin(0.5 * math.pi / 2)
    their_mean = (0.5 - 0.8 * -0.2) * (1 - 0.6) + (0.5 + (1 - 0.8) * -0.2) * math.sqrt(0.6**2 - std**2)
    their_log_prob = -((0.5 - their_mean) ** 2)
    assert their_log_prob == pytest.approx(-0.00166778540126608, abs=1e-16)
    assert float(out.mean) == pytest.approx(their_mean, abs=1e-15)
    # Ours = theirs / (2σ_t²) − log σ_t − ½ log 2π: the constants cancel in a ratio at one step, the 1/(2σ_t²) does not.
    assert float(out.log_prob) == pytest.approx(their_log_prob / (2 * std**2) - math.log(std)
                                                - 0.5 * math.log(2 * math.pi), abs=1e-14)


def test_cps_keeps_the_flow_coefficients_and_zero_noise_is_euler():
    """With the exact velocity of z = (1 − σ)x₀ + σx₁, the next latent is (1 − σ')x₀ + σ'(cos·x₁ + sin·ε): the clean
    sample's coefficient 1 − σ', the noise's σ' in total (cos² + sin² = 1). η = 0 is the Euler step."""
    g = torch.Generator().manual_seed(3)
    x0, x1 = (torch.randn(2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    s, sn, eta = 0.7, 0.45, 0.6
    z, v = (1 - s) * x0 + s * x1, x1 - x0
    out = sde_step_with_logprob(z, v, s, sn, noise_level=eta, kind="cps", generator=torch.Generator().manual_seed(4))
    eps = (out.prev_sample - out.mean) / out.std
    a = eta * math.pi / 2
    expected = (1 - sn) * x0 + sn * (math.cos(a) * x1 + math.sin(a) * eps)
    torch.testing.assert_close(out.prev_sample, expected, rtol=0, atol=1e-14)
    euler = sde_step_with_logprob(z, v, s, sn, noise_level=0.0, kind="cps")
    torch.testing.assert_close(euler.prev_sample, z + (sn - s) * v, rtol=0, atol=1e-15)


def test_the_noiseless_last_step_has_no_density_no_gradient_and_no_kl():
    g = torch.Generator().manual_seed(5)
    z, v = (torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    v = v.requires_grad_(True)
    out = sde_step_with_logprob(z, v, 0.2, 0.0, noise_level=0.9, kind="cps", prev_sample=z)
    assert torch.count_nonzero(out.log_prob) == 0 and torch.count_nonzero(out.std) == 0
    out.log_prob.sum().backward()
    assert torch.isfinite(v.grad).all() and torch.count_nonzero(v.grad) == 0
    assert float(kernel_kl(out.mean.detach(), out.mean.detach() + 1.0, out.std)) == 0.0
    # A batch with one noisy and one noiseless sample: the KL is the noisy one's, halved by the mean over samples.
    std = torch.tensor([0.5, 0.0], dtype=torch.float64).view(2, 1)
    mean = torch.zeros(2, 4, dtype=torch.float64)
    assert float(kernel_kl(mean, mean + 1.0, std)) == pytest.approx(0.5 * 1.0 / (2 * 0.25), abs=1e-15)


def test_cps_noise_level_above_one_is_refused():
    z = torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="cps SDE must be in"):
        sde_step_with_logprob(z, z, 0.8, 0.6, noise_level=1.2, kind="cps")
    with pytest.raises(ValueError, match="above 1, the most the cps SDE takes"):
        SampleConfig(sde_kind="cps", noise_level=1.2)
    assert load_params(REPO / "params.yaml", "toy", {"sample.sde_kind": "cps", "sample.noise_level": 0.8}).sample.sde_kind == "cps"


@pytest.fixture(scope="module")
def toy_policy():
    """The shipped toy base (no pretraining, no project): a real toy-flux policy, 24 px."""
    from jagg_core.policies import load_policy

    return load_policy("toy-flux", str(REPO / "assets/toy-base"))


@pytest.mark.parametrize("recipe", ["dance_grpo", "flow_grpo_fast"])
def test_exact_jagg_and_reuse_update_with_cps_and_the_first_ratio_is_one(toy_policy, recipe):
    """A CPS rollout of the toy policy, then the trainer's update at the first optimizer step (policy = rollout
    policy): approx_kl and clipfrac exactly 0 (clip_range 1e-6) under exact, JAGG and JAGG-reuse, finite non-zero
    gradients; dance_grpo trains the noiseless last step too. With β > 0 the KL is exactly 0 and train.kl_ref reports
    the same."""
    from jagg_core.jagg import plan_groups
    from jagg_core.trainer.distributed import NoSync
    from jagg_core.trainer.rollout import rollout
    from jagg_core.trainer.update import UpdateContext, accumulate_gradients

    policy = toy_policy
    policy.keep_reference()
    cfg = SampleConfig(recipe=recipe, num_steps=5, noise_level=0.8, sde_kind="cps", group_size=2,
                       prompts_per_iteration=2, batch_size=4, sde_window_size=4, sde_window_range=(0, 2))
    traj = rollout(policy, ["a red circle", "two blue squares"], [0, 1], cfg, seed=0, iteration=0,
                   keep_velocities=True)
    assert traj.log_probs[:, traj.train_steps].abs().sum() > 0
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    # JAGG's sequential variant: each forward has the rollout's batch, so the first ratio is exactly 1. The joint one
    # batches the two endpoints into one forward of twice the rows, which float32 rounds differently at the last bit
    # (approx_kl ~1e-16, whatever the SDE kind): bounded, not exact.
    for name, mode, variant, reuse, beta in (("exact", "exact", "joint", False, 0.0),
                                             ("jagg", "jagg", "sequential", False, 0.0),
                                             ("jagg-reuse", "jagg", "sequential", True, 0.0),
                                             ("jagg-beta", "jagg", "sequential", False, 0.1),
                                             ("jagg-joint", "jagg", "joint", False, 0.0)):
        method = ResolvedMethod(name=name, mode=mode, window=4, jagg_frac=1.0, variant=variant, anchors=2,
                                reuse_rollout_velocity=reuse)
        groups = plan_groups(traj.train_steps, 4, 1.0, mode=mode)
        ctx = UpdateContext(policy, method, cfg, TrainConfig(micro_batch=4, clip_range=1e-6, beta=beta), NoSync(),
                            lambda: torch.autocast("cpu", enabled=False))
        stats = accumulate_gradients(ctx, traj, advantages, torch.arange(4), groups, reuse=reuse)
        exact = variant == "sequential" or mode == "exact"
        assert stats.extras["approx_kl"] and all(x == 0.0 if exact else x < 1e-12 for x in stats.extras["approx_kl"])
        assert all(x == 0.0 for x in stats.extras["clipfrac"]) or not exact, name
        # policy = reference before any step
        assert all(x == 0.0 if exact else x < 1e-12 for x in stats.extras["kl_ref"]), name
        assert all(x == 0.0 for x in stats.extras["kl"]), name
        assert (stats.reused_velocities > 0) == reuse and (stats.kl_ref_seconds > 0) == (beta == 0), name
        grads = [p.grad for p in policy.trainable_parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(gr).all() for gr in grads), name
        assert sum(float(gr.abs().sum()) for gr in grads) > 0, name
        for p in policy.trainable_parameters():
            p.grad = None
