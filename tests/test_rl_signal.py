"""GRPO moves the policy the right way: the machinery (rollout, rewards, advantages, update) measured on outcomes.

The test uses `jpeg_compressibility` (DDPO's first reward), which every prompt shares, so what one rollout teaches
carries over to fresh rollouts and to other prompts. docs/toy_rl.md explains why `toy_fidelity` cannot serve here:
its gradient's signal-to-noise ratio on the toy is too low for a test-sized batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rl_probe import loss_gradient, rollout_advantages, set_weights

REPO = Path(__file__).resolve().parents[1]
JPEG = {"reward.weights": {"jpeg_compressibility": 1.0}}
# The toy's own sampling (Flow-GRPO-Fast: SDE on the first 8 of 12 steps) on 8 prompts x 8 images.
TOY_SAMPLING = {"sample.num_steps": 12, "sample.recipe": "flow_grpo_fast", "sample.sde_window_size": 8,
                "sample.sde_window_range": [0, 1], "sample.sde_kind": "flow_grpo", "sample.group_size": 8,
                "sample.batch_size": 64, "train.micro_batch": 64}


def _setup(root, overrides):
    from jagg_core.pipeline.build import policy_from_params, reward_from_params
    from jagg_core.pipeline.config import load_params
    from jagg_core.pipeline.paths import Layout
    from jagg_core.pipeline.storage import read_prompts

    params = load_params(root / "params.yaml", "toy", {**JPEG, **overrides})
    lay = Layout(root, "toy")
    return params, policy_from_params(params, lay, torch.device("cpu")), read_prompts(lay.train_prompts), \
        reward_from_params(params)


@pytest.mark.slow
def test_one_step_along_the_grpo_gradient_raises_the_reward_and_the_reversed_step_lowers_it(toy_base):
    params, policy, prompts, reward_fn = _setup(toy_base, TOY_SAMPLING)
    train, other = prompts[:8], prompts[8:16]
    g = sum(loss_gradient(params, policy, *rollout_advantages(params, policy, train, reward_fn, 0, i)[::2])
            for i in (0, 1))
    theta = [p.detach().clone() for p in policy.trainable_parameters()]

    def rewards_after(step: float) -> torch.Tensor:
        """Per-image rewards of fresh rollouts of the trained and of other prompts, the same noise for every step
        (common random numbers), after a step of norm ``step`` along minus the loss gradient."""
        set_weights(policy, theta, g, step)
        return torch.cat([rollout_advantages(params, policy, ps, reward_fn, 7, 100 + i)[1]
                          for ps in (train, other) for i in range(3)])

    base, descent, ascent = (rewards_after(s) for s in (0.0, 0.1, -0.1))
    for changed, sign in ((descent, 1), (ascent, -1)):
        diff = sign * (changed - base)  # paired by image: common random numbers cancel most of the noise
        se = float(diff.std() / math.sqrt(diff.numel()))
        assert float(diff.mean()) > 3 * se, (sign, float(diff.mean()), se)

