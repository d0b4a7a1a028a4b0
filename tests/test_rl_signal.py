"""GRPO moves the policy the right way: the machinery (rollout, rewards, advantages, update) measured on outcomes.

The test uses `jpeg_compressibility` (DDPO's first reward), which every prompt shares, so what one rollout teaches
carries over to fresh rollouts and to other prompts. docs/toy_rl.md explains why `toy_fidelity` cannot serve here:
its gradient's signal-to-noise ratio on the toy is too low for a test-sized batch.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
JPEG = {"reward.weights": {"jpeg_compressibility": 1.0}}
# The toy's own sampling (Flow-GRPO-Fast: SDE on the first 8 of 12 steps) on 8 prompts x 8 images.
TOY_SAMPLING = {"sample.num_steps": 12, "sample.recipe": "flow_grpo_fast", "sample.sde_window_size": 8,
                "sample.sde_window_range": [0, 1], "sample.sde_kind": "flow_grpo", "sample.group_size": 8,
                "sample.batch_size": 64, "train.micro_batch": 64}


@pytest.fixture(scope="module")
def drawing_base(tmp_path_factory):
    """The ci profile's prompts and a base model pretrained long enough to draw shapes (300 steps, ~30 s).

    The ci base model (40 steps) draws noise, on which JPEG size has no smooth direction to follow.
    """
    import shutil

    from jagg_core.setup.params_io import load_params
    from jagg_core.setup.paths import Layout
    from tasks.prepare import prepare
    from tasks.pretrain import pretrain

    root = tmp_path_factory.mktemp("drawing_base")
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    params = load_params(root / "params.yaml", "ci", {"pretrain.steps": 300, "pretrain.batch_size": 32})
    lay = Layout(root, "ci")
    prepare(params, lay)
    pretrain(params, lay, progress=False)
    return root


def _setup(root, overrides):
    from jagg_core.build import policy_from_params, reward_from_params
    from jagg_core.setup.params_io import load_params
    from jagg_core.setup.paths import Layout
    from jagg_core.setup.storage import read_prompts

    params = load_params(root / "params.yaml", "ci", {**JPEG, **overrides})
    lay = Layout(root, "ci")
    return params, policy_from_params(params, lay, torch.device("cpu")), read_prompts(lay.train_prompts), \
        reward_from_params(params)


def _rollout(params, policy, prompts, reward_fn, seed, iteration):
    from jagg_core.advantages import group_advantages
    from jagg_core.trainer.rollout import rollout

    traj = rollout(policy, prompts, list(range(len(prompts))), params.sample, seed=seed, iteration=iteration)
    texts = traj.image_prompts()
    rewards, _ = reward_fn(traj.images, texts, [{} for _ in texts])
    adv = group_advantages(rewards, traj.group_ids, eps=params.train.adv_eps, clip=params.train.adv_clip,
                           global_std=params.train.global_std)
    return traj, rewards, adv


def _loss_gradient(params, policy, traj, adv) -> torch.Tensor:
    """The flat gradient of the baseline's GRPO loss over the whole rollout (what the trainer accumulates)."""
    from jagg_core.trainer.distributed import NoSync
    from jagg_core.jagg import plan_groups
    from jagg_core.trainer.update import UpdateContext, accumulate_gradients

    method = params.method("baseline")
    groups = plan_groups(traj.train_steps, method.window, 0.0, mode=method.mode)
    policy.transformer.zero_grad(set_to_none=True)
    ctx = UpdateContext(policy, method, params.sample, params.train, NoSync(), contextlib.nullcontext)
    accumulate_gradients(ctx, traj, adv, torch.arange(traj.batch_size), groups, reuse=False)
    return torch.cat([p.grad.reshape(-1) for p in policy.trainable_parameters()])


@pytest.mark.slow
def test_one_step_along_the_grpo_gradient_raises_the_reward_and_the_reversed_step_lowers_it(drawing_base):
    params, policy, prompts, reward_fn = _setup(drawing_base, TOY_SAMPLING)
    train, other = prompts[:8], prompts[8:16]
    g = sum(_loss_gradient(params, policy, *_rollout(params, policy, train, reward_fn, 0, i)[::2]) for i in (0, 1))
    theta = [p.detach().clone() for p in policy.trainable_parameters()]

    def rewards_after(step: float) -> torch.Tensor:
        """Per-image rewards of fresh rollouts of the trained and of other prompts, the same noise for every step
        (common random numbers), after a step of norm ``step`` along minus the loss gradient."""
        with torch.no_grad():
            off = 0
            for p, t0 in zip(policy.trainable_parameters(), theta):
                p.copy_(t0 - step * (g[off : off + t0.numel()] / g.norm()).view_as(t0))
                off += t0.numel()
        return torch.cat([_rollout(params, policy, ps, reward_fn, 7, 100 + i)[1]
                          for ps in (train, other) for i in range(3)])

    base, descent, ascent = (rewards_after(s) for s in (0.0, 0.1, -0.1))
    for changed, sign in ((descent, 1), (ascent, -1)):
        diff = sign * (changed - base)  # paired by image: common random numbers cancel most of the noise
        se = float(diff.std() / math.sqrt(diff.numel()))
        assert float(diff.mean()) > 3 * se, (sign, float(diff.mean()), se)

