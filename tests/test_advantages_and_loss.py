"""Group advantages and the per-step PPO-clip loss on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from jagg_core import group_advantages, ppo_step_loss, sde_step_with_logprob
from jagg_core.loss import KL_CONVENTIONS, kernel_kl
from jagg_core.schedules import flow_match_schedule


def test_advantages_by_hand():
    r = torch.tensor([1.0, 3.0, 10.0, 10.0, 4.0, 0.0], dtype=torch.float64)
    ids = torch.tensor([7, 7, 2, 2, 5, 5])
    adv = group_advantages(r, ids, eps=0.0, clip=10.0)
    # groups {1, 3}: mean 2, population std 1 → ∓1; {10, 10}: constant → 0; {4, 0}: mean 2, std 2 → ±1
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0, 1.0, -1.0], dtype=torch.float64))


def test_constant_group_gives_zeros_not_nan_even_without_eps():
    adv = group_advantages(torch.full((4,), 0.3), torch.zeros(4, dtype=torch.long), eps=0.0, clip=5.0)
    assert torch.equal(adv, torch.zeros(4))
    single = group_advantages(torch.tensor([0.5, 0.7]), torch.tensor([0, 1]), eps=1e-4, clip=5.0)
    assert torch.equal(single, torch.zeros(2))  # a group of one image has no relative signal


def test_eps_clip_and_global_std():
    r = torch.tensor([0.0, 1.0, 0.0, 100.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1])
    adv = group_advantages(r, ids, eps=0.5, clip=10.0)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, -50 / 50.5, 50 / 50.5], dtype=torch.float64))
    assert group_advantages(torch.tensor([0.0, 1.0, 2.0, 300.0]), torch.zeros(4, dtype=torch.long), eps=0.0,
                            clip=1.5).abs().max() == 1.5
    g = group_advantages(r, ids, eps=0.0, clip=10.0, global_std=True)
    std = float(r.std(unbiased=False))
    torch.testing.assert_close(g, torch.tensor([-0.5, 0.5, -50.0, 50.0], dtype=torch.float64) / std)


def test_advantages_refuse_mismatched_shapes():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))


def test_ppo_loss_by_hand():
    log_prob = torch.tensor([math.log(1.5), math.log(0.5), 0.0], dtype=torch.float64)
    old = torch.zeros(3, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -2.0], dtype=torch.float64)
    out = ppo_step_loss(log_prob, old, adv, clip_range=0.2)
    # ratio 1.5 (A>0): max(−1.5, −1.2) = −1.2; ratio 0.5 (A>0): max(−0.5, −0.8) = −0.5; ratio 1 (A<0): 2
    assert float(out.loss) == pytest.approx((-1.2 - 0.5 + 2.0) / 3)
    assert float(out.clipfrac) == pytest.approx(2 / 3)
    assert float(out.approx_kl) == pytest.approx(0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 3)
    assert float(out.kl) == 0.0


def test_ppo_loss_gradient_is_zero_exactly_where_clipped():
    log_prob = torch.tensor([math.log(1.5), math.log(1.1), math.log(0.5)], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    ppo_step_loss(log_prob, torch.zeros(3, dtype=torch.float64), adv, clip_range=0.2).loss.backward()
    assert log_prob.grad[0] == 0 and log_prob.grad[2] == 0  # pushed beyond the clip in the advantage's direction
    assert log_prob.grad[1] == pytest.approx(-1.1 / 3)


def test_kl_term_gaussian_is_the_kernels_kl():
    mean = torch.tensor([[1.0, 2.0], [0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[0.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    std = torch.tensor([[0.5], [1.0]], dtype=torch.float64)
    zeros = torch.zeros(2, dtype=torch.float64)
    out = ppo_step_loss(zeros, zeros, zeros, clip_range=0.2, mean=mean, ref_mean=ref, std=std, beta=0.1)
    kl = ((1 + 4) / 2 / (2 * 0.25) + (0 + 1) / 2 / 2) / 2
    assert float(out.kl) == pytest.approx(kl)
    assert float(out.loss.detach()) == pytest.approx(0.1 * kl)
    with pytest.raises(ValueError, match="beta > 0"):
        ppo_step_loss(zeros, zeros, zeros, clip_range=0.2, beta=0.1)


def _flow_grpo_train_sd3_kl(latents, v, v_ref, sigmas, j, noise_level):
    """Flow-GRPO's KL, line for line: sde_step_with_logprob's prev_sample_mean and std_dev_t
    (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py), then scripts/train_sd3.py's
    ``((mean − mean_ref)² ).mean(dim=(1,2,3), keepdim=True) / (2 * std_dev_t ** 2)``, averaged."""
    sigma, sigma_prev, sigma_max = sigmas[j], sigmas[j + 1], sigmas[1]
    dt = sigma_prev - sigma
    std_dev_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * noise_level

    def mean(out):
        return latents * (1 + std_dev_t**2 / (2 * sigma) * dt) + out * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt

    kl = ((mean(v) - mean(v_ref)) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2)
    return torch.mean(kl)


@pytest.mark.parametrize("j", [0, 4, 8])
def test_the_flow_grpo_kl_is_train_sd3s_and_the_gaussian_one_is_1_over_minus_dt_times_it(j):
    """The two named conventions on one step of a 10-step SD3-like schedule: flow_grpo equals Flow-GRPO's formula;
    the gaussian KL (the kernels' own) is 1/(−dt) times it (25.1, 12.0 and 3.7 at steps 0, 4 and 8)."""
    assert KL_CONVENTIONS == ("gaussian", "flow_grpo")
    g = torch.Generator().manual_seed(j)
    sigmas = [float(x) for x in flow_match_schedule(10, shift=3.0).sigmas]
    z, v, v_ref = (torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
    step = sde_step_with_logprob(z, v, sigmas[j], sigmas[j + 1], noise_level=0.7, kind="flow_grpo", generator=g)
    ref = sde_step_with_logprob(z, v_ref, sigmas[j], sigmas[j + 1], noise_level=0.7, kind="flow_grpo",
                                prev_sample=step.prev_sample)
    dt = sigmas[j + 1] - sigmas[j]
    ours = kernel_kl(step.mean, ref.mean, step.std, convention="flow_grpo", dt=dt)
    theirs = _flow_grpo_train_sd3_kl(z, v, v_ref, sigmas, j, 0.7)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-12)
    gaussian = kernel_kl(step.mean, ref.mean, step.std)
    assert float(gaussian / ours) == pytest.approx(1 / -dt, rel=1e-12)
    zeros = torch.zeros(2, dtype=torch.float64)
    out = ppo_step_loss(zeros, zeros, zeros, clip_range=0.2, mean=step.mean, ref_mean=ref.mean, std=step.std,
                        beta=0.04, kl_convention="flow_grpo", dt=dt)
    assert float(out.kl) == pytest.approx(float(theirs), rel=1e-12)
    with pytest.raises(ValueError, match="needs the step's dt"):
        kernel_kl(step.mean, ref.mean, step.std, convention="flow_grpo")
    with pytest.raises(ValueError, match="KL convention must be one of"):
        kernel_kl(step.mean, ref.mean, step.std, convention="flowgrpo", dt=dt)


def test_every_profile_that_takes_flow_grpos_beta_takes_its_kl():
    """A profile with β > 0 whose recipe is Flow-GRPO's (sde_kind flow_grpo) weighs Flow-GRPO's KL, not the gaussian
    one that would make its β 4–25× stronger; the configuration's choices are loss.py's."""
    from typing import get_args

    from jagg_core.setup.config import TrainConfig
    from jagg_core.setup.params_io import load_params

    assert get_args(TrainConfig.model_fields["kl_convention"].annotation) == KL_CONVENTIONS
    import yaml
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    profiles = yaml.safe_load((repo / "params.yaml").read_text())["profiles"]
    checked = 0
    for name in profiles:
        p = load_params(repo / "params.yaml", name)
        if p.train.beta > 0 and p.sample.sde_kind == "flow_grpo":
            assert p.train.kl_convention == "flow_grpo", name
            checked += 1
    assert checked >= 1  # sd3: β 0.04 as Flow-GRPO


def test_mixed_advantages_by_hand():
    from jagg_core.advantages import mixed_advantages

    ids = torch.tensor([0, 0, 1, 1])
    a = torch.tensor([0.0, 10.0, 4.0, 0.0], dtype=torch.float64)  # per group: ∓1 / ±1 once standardised
    b = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)  # ±1 / ∓1
    w = {"a": 1.0, "b": 0.5}
    per = mixed_advantages({"a": a, "b": b}, w, ids, normalize="per_reward", eps=0.0, clip=10.0)
    torch.testing.assert_close(per, torch.tensor([-1 + 0.5, 1 - 0.5, 1 - 0.5, -1 + 0.5], dtype=torch.float64))
    summed = mixed_advantages({"a": a, "b": b}, w, ids, normalize="sum", eps=0.0, clip=10.0)
    torch.testing.assert_close(summed, group_advantages(a + 0.5 * b, ids, eps=0.0, clip=10.0))
    clipped = mixed_advantages({"a": a, "b": b}, w, ids, normalize="per_reward", eps=0.0, clip=1.0)
    assert float(clipped.abs().max()) == 0.5  # the clip applies to the sum (|±1 ∓ 0.5| = 0.5), not to each reward
    clipped = mixed_advantages({"a": a, "b": -b}, w, ids, normalize="per_reward", eps=0.0, clip=1.0)
    assert float(clipped.abs().max()) == 1.0  # 1.5 clipped
    with pytest.raises(ValueError, match="no rewards given for 'b'"):
        mixed_advantages({"a": a}, w, ids)
    with pytest.raises(ValueError, match="normalize must be"):
        mixed_advantages({"a": a, "b": b}, w, ids, normalize="mean")


def test_per_reward_normalisation_keeps_a_small_spread_reward_in_the_advantages():
    """A reward whose within-group spread is 10× another's: summed first, the advantages follow the large one alone;
    normalised per reward, each reward's own advantages carry half of the mix (its weight)."""
    from jagg_core.advantages import mixed_advantages

    g = torch.Generator().manual_seed(0)
    ids = torch.arange(64).repeat_interleave(16)
    big = 10 * torch.randn(1024, generator=g, dtype=torch.float64)
    small = torch.randn(1024, generator=g, dtype=torch.float64)
    w = {"big": 1.0, "small": 1.0}
    own = group_advantages(small, ids, eps=0.0, clip=1e9)

    def corr(x, y):
        return float(torch.corrcoef(torch.stack([x, y]))[0, 1])

    summed = mixed_advantages({"big": big, "small": small}, w, ids, normalize="sum", eps=0.0, clip=1e9)
    per = mixed_advantages({"big": big, "small": small}, w, ids, normalize="per_reward", eps=0.0, clip=1e9)
    assert corr(summed, own) < 0.15  # ~1/10: drowned
    assert 0.6 < corr(per, own) < 0.8  # ~1/sqrt(2): counts as much as the other
