"""CLIPScore (Hessel et al. 2021): the reward ``clipscore``.

CLIP through ``transformers`` (the same loading path as PickScore), by default OpenAI's ViT-B/32
(``openai/clip-vit-base-patch32``), the model Hessel et al. use; its folder holds both weights and processor.

- the reward = the raw cosine of the L2-normalised image and prompt embeddings;
- ``info["clipscore"]`` = Hessel et al.'s ``CLIP-S = 2.5 * max(cos, 0)`` (Eq. 1, w = 2.5), for evaluation.

Hessel et al. score captions as ``"A photo depicts " + caption``; text-to-image evaluation usually scores the prompt
itself, so ``prefix`` defaults to none; set ``prefix: "A photo depicts"`` to reproduce their setting exactly.
"""

from __future__ import annotations

from typing import Any, Mapping, Union

from ..setup.options import HF_SCORER
from .base import RewardFn, register_reward
from .clip_models import hf_clip_reward

__all__ = ["CLIPSCORE_MODEL", "CLIPSCORE_W", "make_clipscore"]

CLIPSCORE_MODEL = "openai/clip-vit-base-patch32"
CLIPSCORE_W = 2.5  # Hessel et al.'s w, which stretches typical cosines (~0.2-0.4) towards [0, 1]


def _describe(options: Mapping[str, Any]) -> str:
    prefix = options.get("prefix", "")
    return (f"{options.get('model', CLIPSCORE_MODEL)}; raw cosine of image and prompt"
            f"{f' prefixed {prefix!r}' if prefix else ''} (not 2.5 x CLIP-S)")


@register_reward("clipscore", options={"model": (str, None), "processor": (Union[str, None], None),
                                       "prefix": (str, None), **HF_SCORER},
                 table=("clipscore", 1.0, "raw cosine"), describe=_describe,
                 weights=lambda options: [options.get("model") or CLIPSCORE_MODEL,
                                          options.get("processor") or options.get("model") or CLIPSCORE_MODEL])
def make_clipscore(
    model: str = CLIPSCORE_MODEL,
    processor: str | None = None,
    prefix: str = "",
    device: str = "cpu",
    dtype: str = "float32",
    batch_size: int = 16,
) -> RewardFn:
    """Build the CLIPScore reward.

    Args:
        model: a CLIP model folder (config.json + weights), or its hub id looked up in the local HF cache only.
        processor: the processor folder or hub id (tokenizer + image processor config); default: ``model``'s.
        prefix: text put before every prompt (Hessel et al.: ``"A photo depicts"``); a space is added after it.
        device: where the model runs.
        dtype: the model's precision: ``float32``, ``bfloat16`` or ``float16``; cosines are computed in float32.
        batch_size: images per forward pass.

    Returns:
        ``fn(images, prompts, metadata) -> (rewards, info)``: rewards (B,) float32 = the cosine;
        info: ``clipscore`` (B,) = ``2.5 * max(cos, 0)``.
    """
    return hf_clip_reward(
        "clipscore", "CLIPScore", model, model if processor is None else processor, model_hub=CLIPSCORE_MODEL,
        processor_hub=CLIPSCORE_MODEL, device=device, dtype=dtype, batch_size=batch_size, prefix=prefix,
        finish=lambda clip: lambda cos: (cos, {"clipscore": CLIPSCORE_W * cos.clamp(min=0)}),
    )
