"""``toy_preference`` (the toy's HPSv2.1) and the shipped base model, against the checks a learned preference scorer
would have to pass: ground truth above the base model's samples, and empty canvases below them. The two checks it
does not pass at CPU batch sizes — a one-step GRPO probe that raises it on unseen prompts, and a per-image gradient
signal-to-noise ratio 10x toy_fidelity's — are measured in docs/toy_rl.md §0 (scripts/toy_rl_diagnostics.py step
and signal), not asserted here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "assets" / "toy-base"
# folder_digest of assets/toy-base: what every toy run records as its base model. Re-committing the base changes it.
SHIPPED_DIGEST = "0d399c3b49aa3f7f"


def _toy(root: Path, overrides: dict | None = None):
    from jagg_core.build import policy_from_params
    from jagg_core.setup.params_io import load_params
    from jagg_core.setup.paths import Layout

    params = load_params(root / "params.yaml", "toy", overrides or {})
    lay = Layout(root, "toy")
    return params, lay, policy_from_params(params, lay, torch.device("cpu"))


def _preference(images: torch.Tensor, prompts) -> np.ndarray:
    from jagg_core.rewards import make_reward

    return make_reward("toy_preference")(images, prompts, [{} for _ in prompts])[0].double().numpy()


def test_shipped_base_is_pinned_verified_and_what_the_toy_profile_starts_from(toy_base, tmp_path):
    from jagg_core.setup.params_io import load_params
    from jagg_core.errors import UserError
    from jagg_core.setup.storage import folder_digest
    from tasks.pretrain import verify_sums

    assert folder_digest(SHIPPED) == SHIPPED_DIGEST
    verify_sums(SHIPPED)
    card = json.loads((SHIPPED / "card.json").read_text())
    params = load_params(REPO / "params.yaml", "toy", {})
    # the card names the world keys pretraining reads (the image size, and the seed and size of the split it held out)
    from tasks.pretrain import PRETRAIN_WORLD_KEYS

    assert card["pretrain"] == params.pretrain.model_dump()
    assert {k: card["world"][k] for k in PRETRAIN_WORLD_KEYS} == {k: getattr(params.world, k) for k in PRETRAIN_WORLD_KEYS}
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
