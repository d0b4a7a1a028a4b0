"""Shared pieces of the GRPO outcome probes (tests/test_rl_signal.py, tests/test_preference_reward.py): a rollout
with its group advantages, the baseline's loss gradient over it, and one step of the weights along a direction."""

from __future__ import annotations

import contextlib

import torch


def rollout_advantages(params, policy, prompts, reward_fn, seed, iteration):
    """A rollout of ``prompts`` (G images each), its rewards and their group advantages."""
    from jagg_core.advantages import group_advantages
    from jagg_core.trainer.rollout import rollout

    traj = rollout(policy, prompts, list(range(len(prompts))), params.sample, seed=seed, iteration=iteration)
    texts = traj.image_prompts()
    rewards, _ = reward_fn(traj.images, texts, [{} for _ in texts])
    adv = group_advantages(rewards, traj.group_ids, eps=params.train.adv_eps, clip=params.train.adv_clip,
                           global_std=params.train.global_std)
    return traj, rewards, adv


def loss_gradient(params, policy, traj, adv) -> torch.Tensor:
    """The flat gradient of the baseline's GRPO loss over the whole rollout (what the trainer accumulates)."""
    from jagg_core.trainer.distributed import NoSync
    from jagg_core.trainer.update import accumulate_gradients, plan_update

    method = params.method("baseline")
    groups = plan_update(traj, method, params.sample, 0.0, torch.Generator().manual_seed(0))
    policy.transformer.zero_grad(set_to_none=True)
    accumulate_gradients(policy, traj, adv, torch.arange(traj.batch_size), groups, method, sample=params.sample,
                         train=params.train, sync=NoSync(), reuse=False, autocast=contextlib.nullcontext)
    return torch.cat([p.grad.reshape(-1) for p in policy.trainable_parameters()])


def set_weights(policy, theta, direction: torch.Tensor, step: float) -> None:
    """θ = θ₀ − step · direction / ‖direction‖ (a step of norm ``step`` down ``direction``)."""
    with torch.no_grad():
        off = 0
        for p, t0 in zip(policy.trainable_parameters(), theta):
            p.copy_(t0 - step * (direction[off : off + t0.numel()] / direction.norm()).view_as(t0))
            off += t0.numel()
