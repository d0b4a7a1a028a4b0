"""``toy_preference`` (the toy's HPSv2.1) and the shipped base model, against the checks a learned preference scorer
would have to pass: ground truth above the base model's samples, empty canvases below them, a one-step GRPO probe
that raises it on prompts it never saw, and a gradient signal-to-noise ratio far above ``toy_fidelity``'s."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from rl_probe import loss_gradient, rollout_advantages, set_weights

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "assets" / "toy-base"
# folder_digest of assets/toy-base: what every toy run records as its base model. Re-committing the base changes it.
SHIPPED_DIGEST = "0d399c3b49aa3f7f"


def _toy(root: Path, overrides: dict | None = None):
    from jagg_core.pipeline.build import policy_from_params
    from jagg_core.pipeline.config import load_params
    from jagg_core.pipeline.paths import Layout

    params = load_params(root / "params.yaml", "toy", overrides or {})
    lay = Layout(root, "toy")
    return params, lay, policy_from_params(params, lay, torch.device("cpu"))


def _preference(images: torch.Tensor, prompts) -> np.ndarray:
    from jagg_core.rewards import make_reward

    return make_reward("toy_preference")(images, prompts, [{} for _ in prompts])[0].double().numpy()


def test_shipped_base_is_pinned_verified_and_what_the_toy_profile_starts_from(toy_base, tmp_path):
    from jagg_core.pipeline.config import load_params
    from jagg_core.errors import UserError
    from jagg_core.pipeline.storage import folder_digest
    from tasks.pretrain import verify_sums

    assert folder_digest(SHIPPED) == SHIPPED_DIGEST
    verify_sums(SHIPPED)
    card = json.loads((SHIPPED / "card.json").read_text())
    params = load_params(REPO / "params.yaml", "toy", {})
    assert card["pretrain"] == params.pretrain.model_dump() and card["world"] == params.world.model_dump()
    assert sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file()) < 10 * 2**20
    # the toy profile's pretrain stage installed exactly those bits (the fixture ran it): no training
    assert folder_digest(toy_base / "models" / "toy" / "base") == SHIPPED_DIGEST
    damaged = tmp_path / "toy-base"
    shutil.copytree(SHIPPED, damaged)
    weights = next(damaged.rglob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError, match="is damaged"):
        verify_sums(damaged)


@pytest.fixture(scope="module")
def base_samples(toy_base):
    """The base model's ODE samples of the 128 test prompts, as evaluation draws them, and the ground truth."""
    from jagg_core.evaluation.evaluate import test_prompts
    from jagg_core.sampling import derive_seed, sample_images
    from jagg_core.world import render, scene_for_prompt

    params, lay, policy = _toy(toy_base)
    by_style = test_prompts(params, lay)
    styles = list(by_style)
    prompts = [p for s in styles for p in by_style[s]]
    seeds = [derive_seed(params.eval.seed, k, i) for k, s in enumerate(styles) for i in range(len(by_style[s]))]
    images = sample_images(policy, prompts, num_steps=params.eval.num_steps, seeds=seeds, batch_size=64)
    truth = np.stack([render(scene_for_prompt(p, np.random.default_rng(s)), params.world.image_size)
                      for p, s in zip(prompts, seeds)])
    truth = torch.from_numpy(truth).permute(0, 3, 1, 2).float() / 255.0
    return prompts, images, truth


def test_ground_truth_scores_above_the_base_models_samples_and_empty_canvases_below(base_samples):
    from jagg_core.world.scene import BACKGROUNDS, COLORS

    prompts, images, truth = base_samples
    base, gt = _preference(images, prompts), _preference(truth, prompts)
    assert gt.mean() > np.quantile(base, 0.95), (gt.mean(), np.quantile(base, 0.95))
    for name, rgb in {**BACKGROUNDS, **COLORS}.items():  # a blank canvas of every background, a one-colour one
        canvas = torch.tensor(rgb, dtype=torch.float32).div(255).view(1, 3, 1, 1).expand_as(images)
        assert _preference(canvas, prompts).mean() < base.mean(), name
    assert 0 < base.std()  # real spread to learn from


@pytest.mark.slow
def test_one_step_along_the_preference_gradient_raises_it_on_unseen_prompts(toy_base):
    """The probe of scripts/toy_rl_diagnostics.py step: the gradient of 2 rollouts of 16 training prompts, a step
    of norm 0.1 along it (and the reversed step), judged on 16 test prompts with common random numbers."""
    from jagg_core.pipeline.build import reward_from_params
    from jagg_core.evaluation.evaluate import test_prompts
    from jagg_core.pipeline.storage import read_prompts

    overrides = {"reward.weights": {"toy_preference": 1.0}, "sample.prompts_per_iteration": 16,
                 "sample.group_size": 8}
    params, lay, policy = _toy(toy_base, overrides)
    reward_fn = reward_from_params(params)
    train = read_prompts(lay.train_prompts)[:16]
    unseen = [p for ps in test_prompts(params, lay).values() for p in ps[:4]]
    g = sum(loss_gradient(params, policy, *rollout_advantages(params, policy, train, reward_fn, 0, i)[::2])
            for i in (0, 1))
    theta = [p.detach().clone() for p in policy.trainable_parameters()]

    def rewards_after(step: float) -> torch.Tensor:
        set_weights(policy, theta, g, step)
        return torch.cat([rollout_advantages(params, policy, unseen, reward_fn, 7, 100 + i)[1] for i in range(2)])

    base, descent, ascent = (rewards_after(s) for s in (0.0, 0.1, -0.1))
    for changed, sign in ((descent, 1), (ascent, -1)):
        diff = sign * (changed - base)  # paired by image
        se = float(diff.std() / math.sqrt(diff.numel()))
        assert float(diff.mean()) > 3 * se, (sign, float(diff.mean()), se)


@pytest.mark.slow
def test_preference_gradient_signal_to_noise_is_over_10x_toy_fidelitys(toy_base):
    """Per-image SNR (jagg_core.snr) of both rewards' GRPO gradients on the same 6 rollouts of 8 random training
    prompts × 16 images."""
    from jagg_core.advantages import group_advantages
    from jagg_core.rewards import make_reward
    from jagg_core.snr import gradient_snr
    from jagg_core.pipeline.storage import read_prompts
    from jagg_core.trainer.rollout import rollout

    params, lay, policy = _toy(toy_base, {"sample.prompts_per_iteration": 8, "sample.group_size": 16})
    prompts = read_prompts(lay.train_prompts)
    fns = {n: make_reward(n) for n in ("toy_preference", "toy_fidelity")}
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in fns}
    gen = torch.Generator().manual_seed(0)
    for k in range(6):
        ids = torch.randperm(len(prompts), generator=gen)[:8].tolist()
        traj = rollout(policy, [prompts[i] for i in ids], list(range(8)), params.sample, seed=0, iteration=500 + k)
        texts = traj.image_prompts()
        for name, fn in fns.items():
            adv = group_advantages(fn(traj.images, texts, [{} for _ in texts])[0], traj.group_ids,
                                   eps=params.train.adv_eps, clip=params.train.adv_clip,
                                   global_std=params.train.global_std)
            grads[name].append(loss_gradient(params, policy, traj, adv).clone())
    pref, fid = (gradient_snr(grads[n], 128) for n in fns)
    assert pref["snr_per_image"] > 3 * pref["snr_per_image_se"], pref
    assert pref["snr_per_image"] >= 10 * max(fid["snr_per_image"] + fid["snr_per_image_se"], 0.0), (pref, fid)
