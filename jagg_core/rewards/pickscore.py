"""PickScore (Kirstain et al. 2023, "Pick-a-Pic"): the reward ``pickscore``.

PickScore_v1 (HF repo ``yuvalkirstain/PickScore_v1``) is CLIP-H fine-tuned on Pick-a-Pic preferences, used with the
CLIP-H processor (``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``), both through ``transformers``.

Scales, as PickScore's reference code and Flow-GRPO's ``pickscore_scorer``:
- ``info["score"]`` = ``logit_scale.exp() * cos`` -- PickScore as published (~18-24 on real images; logit scale
  ~100), what evaluation reports;
- ``info["cos"]`` = the raw cosine of the L2-normalised image and prompt embeddings;
- the reward = ``score / 26``, Flow-GRPO's normalisation to roughly [0, 1] (~0.7-0.9 on real images), so its
  advantages and KL weights carry over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..setup.options import HF_SCORER
from .base import RewardFn, register_reward
from .clip_models import hf_clip_reward

if TYPE_CHECKING:
    import torch

__all__ = ["PICKSCORE_MODEL", "PICKSCORE_NORM", "PICKSCORE_PROCESSOR", "make_pickscore"]

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
PICKSCORE_NORM = 26.0  # Flow-GRPO's pickscore_scorer divides by 26


def _describe(options: Mapping[str, Any]) -> str:
    return (f"{options.get('model', PICKSCORE_MODEL)} with processor {options.get('processor', PICKSCORE_PROCESSOR)}; "
            f"logit-scale score / 100 (the reward itself: score / 26)")


# Its table value is the logit-scale score / 100 (as the papers' tables), not the reward (score / 26)
@register_reward("pickscore", options={"model": (str, None), "processor": (str, None), **HF_SCORER},
                 table=("pickscore/score", 0.01, "logit-scale score / 100"), describe=_describe,
                 weights=lambda options: [options.get("model") or PICKSCORE_MODEL,
                                          options.get("processor") or PICKSCORE_PROCESSOR])
def make_pickscore(
    model: str = PICKSCORE_MODEL,
    processor: str = PICKSCORE_PROCESSOR,
    device: str = "cpu",
    dtype: str = "float32",
    batch_size: int = 16,
) -> RewardFn:
    """Build the PickScore reward.

    Args:
        model: the PickScore_v1 folder (config.json + weights), or its hub id looked up in the local HF cache only.
        processor: the CLIP-H processor folder (tokenizer + image processor config), or its hub id, cache only.
        device: where the model runs.
        dtype: the model's precision: ``float32``, ``bfloat16`` or ``float16``; cosines are computed in float32.
        batch_size: images per forward pass.

    Returns:
        ``fn(images, prompts, metadata) -> (rewards, info)``: rewards (B,) float32 = ``score / 26``;
        info: ``score`` (B,) = ``logit_scale.exp() * cos``, ``cos`` (B,).
    """
    return hf_clip_reward(
        "pickscore", "PickScore", model, processor, model_hub=PICKSCORE_MODEL, processor_hub=PICKSCORE_PROCESSOR,
        device=device, dtype=dtype, batch_size=batch_size, finish=_scores,
    )


def _scores(clip: torch.nn.Module) -> Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]:
    logit_scale = float(clip.logit_scale.float().exp())

    def finish(cos: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        score = logit_scale * cos  # (B,)
        return score / PICKSCORE_NORM, {"score": score, "cos": cos}

    return finish
