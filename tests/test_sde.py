"""The SDE step with log-prob: densities, sampling, gradients and the two drift forms (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from jagg_core import sde_step_with_logprob

KINDS = ["flow_grpo", "dance_grpo", "cps"]


def _inputs(shape=(4, 3, 5), seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape, generator=g, dtype=dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sigma,sigma_next", [(0.8, 0.6), (torch.tensor([0.9, 0.7, 0.5, 0.3]), torch.tensor([0.8, 0.55, 0.45, 0.1]))])
def test_log_prob_is_the_normal_log_density_averaged_over_dims(kind, sigma, sigma_next):
    z, v = _inputs()
    out = sde_step_with_logprob(z, v, sigma, sigma_next, noise_level=0.7, kind=kind,
                                generator=torch.Generator().manual_seed(1))
    ref = torch.distributions.Normal(out.mean, out.std.expand_as(out.mean)).log_prob(out.prev_sample)
    torch.testing.assert_close(out.log_prob, ref.mean(dim=(1, 2)), rtol=0, atol=1e-12)
    assert out.log_prob.shape == (4,)


@pytest.mark.parametrize("kind", KINDS)
def test_sample_then_rescore_gives_the_same_log_prob(kind):
    z, v = _inputs()
    drawn = sde_step_with_logprob(z, v, 0.7, 0.5, noise_level=0.9, kind=kind, generator=torch.Generator().manual_seed(3))
    again = sde_step_with_logprob(z, v, 0.7, 0.5, noise_level=0.9, kind=kind, prev_sample=drawn.prev_sample)
    torch.testing.assert_close(again.log_prob, drawn.log_prob, rtol=0, atol=0)
    torch.testing.assert_close(again.prev_sample, drawn.prev_sample, rtol=0, atol=0)


def test_sampling_is_deterministic_by_generator_and_has_the_stated_moments():
    z, v = _inputs(shape=(2, 20000))
    a = sde_step_with_logprob(z, v, 0.6, 0.4, noise_level=0.8, generator=torch.Generator().manual_seed(5))
    b = sde_step_with_logprob(z, v, 0.6, 0.4, noise_level=0.8, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.prev_sample, b.prev_sample)
    eps = (a.prev_sample - a.mean) / a.std
    assert abs(float(eps.mean())) < 0.02 and abs(float(eps.std()) - 1.0) < 0.02


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_log_prob_and_mean_wrt_velocity(kind):
    z, v = _inputs(shape=(2, 3))
    nxt = sde_step_with_logprob(z, v, 0.7, 0.4, noise_level=0.8, kind=kind, generator=torch.Generator().manual_seed(0)).prev_sample
    v = v.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda vv: sde_step_with_logprob(z, vv, 0.7, 0.4, noise_level=0.8, kind=kind, prev_sample=nxt).log_prob, (v,)
    )
    assert torch.autograd.gradcheck(
        lambda vv: sde_step_with_logprob(z, vv, 0.7, 0.4, noise_level=0.8, kind=kind, prev_sample=nxt).mean, (v,)
    )


def test_flow_grpo_and_dance_grpo_drifts_agree_at_equal_diffusion_coefficients():
    """Both are z·(1 + s²dt/(2σ)) + v·(1 + s²(1 − σ)/(2σ))·dt; Flow-GRPO's s = a·sqrt(σ/(1 − σ)), DanceGRPO's s = η."""
    z, v = _inputs()
    sigma, sigma_next, eta = 0.7, 0.55, 0.6
    a = eta / math.sqrt(sigma / (1 - sigma))  # the Flow-GRPO noise level with the same s
    flow = sde_step_with_logprob(z, v, sigma, sigma_next, noise_level=a, kind="flow_grpo")
    dance = sde_step_with_logprob(z, v, sigma, sigma_next, noise_level=eta, kind="dance_grpo")
    torch.testing.assert_close(flow.mean, dance.mean, rtol=0, atol=1e-14)
    torch.testing.assert_close(flow.std, dance.std, rtol=0, atol=1e-14)  # both s·sqrt(−dt)
    dt = sigma_next - sigma
    by_hand = z * (1 + eta**2 * dt / (2 * sigma)) + v * (1 + eta**2 * (1 - sigma) / (2 * sigma)) * dt
    torch.testing.assert_close(flow.mean, by_hand, rtol=0, atol=1e-14)


@pytest.mark.parametrize("kind", KINDS)
def test_noise_level_zero_is_the_euler_ode_step(kind):
    z, v = _inputs()
    out = sde_step_with_logprob(z, v, 0.8, 0.5, noise_level=0.0, kind=kind, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.prev_sample, z + (0.5 - 0.8) * v, rtol=0, atol=1e-15)
    assert torch.count_nonzero(out.log_prob) == 0 and torch.count_nonzero(out.std) == 0


def test_sigma_one_uses_the_next_sigma_in_the_flow_grpo_denominator():
    """At σ = 1, 1 − σ = 0; Flow-GRPO replaces σ by sigma_max = sigmas[1], the schedule's second sigma."""
    z, v = _inputs()
    sigma_1 = 0.95
    out = sde_step_with_logprob(z, v, 1.0, sigma_1, noise_level=0.7, generator=torch.Generator().manual_seed(0))
    s = 0.7 * math.sqrt(1.0 / (1 - sigma_1))
    dt = sigma_1 - 1.0
    torch.testing.assert_close(out.std, torch.full_like(out.std, s * math.sqrt(-dt)), rtol=0, atol=1e-14)
    torch.testing.assert_close(out.mean, z * (1 + s**2 * dt / 2) + v * dt, rtol=0, atol=1e-14)
    assert torch.isfinite(out.log_prob).all()


def test_low_precision_inputs_are_scored_in_float32():
    z, v = _inputs(dtype=torch.bfloat16)
    out = sde_step_with_logprob(z, v, 0.8, 0.6, noise_level=0.7, generator=torch.Generator().manual_seed(0))
    assert out.log_prob.dtype == torch.float32 and out.mean.dtype == torch.float32


def test_gradient_flows_to_v_not_z():
    z, v = _inputs()
    z.requires_grad_(True)
    v.requires_grad_(True)
    out = sde_step_with_logprob(z, v, 0.8, 0.6, noise_level=0.7, generator=torch.Generator().manual_seed(0))
    out.log_prob.sum().backward()
    assert z.grad is None and v.grad is not None and v.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(kind="ddim"), "kind"), (dict(noise_level=-1.0), "noise_level"), (dict(sigma=torch.ones(3)), "sigma")],
)
def test_bad_arguments_are_refused(kwargs, match):
    z, v = _inputs()
    args = dict(sigma=0.8, sigma_next=0.6, noise_level=0.7)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        sde_step_with_logprob(z, v, args.pop("sigma"), args.pop("sigma_next"), **args)


def test_per_sample_generators_make_noise_independent_of_batching():
    z, v = _inputs()
    gens = lambda: [torch.Generator().manual_seed(100 + i) for i in range(4)]  # noqa: E731
    whole = sde_step_with_logprob(z, v, 0.7, 0.5, noise_level=0.8, generator=gens())
    g = gens()
    halves = [sde_step_with_logprob(z[i : i + 2], v[i : i + 2], 0.7, 0.5, noise_level=0.8, generator=g[i : i + 2])
              for i in (0, 2)]
    assert torch.equal(whole.prev_sample, torch.cat([h.prev_sample for h in halves]))
    with pytest.raises(ValueError, match="generators"):
        sde_step_with_logprob(z, v, 0.7, 0.5, noise_level=0.8, generator=gens()[:3])
