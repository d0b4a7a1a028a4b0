"""HPSv2.1 (Wu et al. 2023, "Human Preference Score v2"): the reward ``hpsv2.1``.

HPSv2.1 is open_clip's ViT-H-14 fine-tuned on human preferences; its checkpoint ``HPS_v2.1_compressed.pt`` (HF repo
``xswu/HPSv2``) holds ``{'state_dict': ...}`` with exactly open_clip ViT-H-14's keys, so the model is built here with
``open_clip_torch`` directly (the ``hpsv2`` package is not a usable dependency, see ENVIRONMENT.md).

The score is hpsv2's: the cosine of the L2-normalised image and text features,
``hps = <f_img / |f_img|, f_txt / |f_txt|>`` (no logit scale), ~0.25-0.37 on real images -- the raw scale GRPO
trainers (Flow-GRPO, DanceGRPO) use as the reward. HPSv2's tables report it x100 (e.g. 27.4 for 0.274).

Preprocessing is hpsv2's evaluation transform: resize the longest side to the model's input size (bicubic), pad to a
square with black, normalise with CLIP's mean/std (``open_clip.image_transform(224, is_train=False,
resize_mode='longest', fill_color=0)``), applied to the images rounded to 8 bits.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .base import RewardFn, register_reward
from .clip_models import (
    Published,
    check_batch_size,
    check_inputs,
    chunks,
    load_open_clip,
    parse_dtype,
    to_pil_images,
)

__all__ = ["HPS_CHECKPOINT", "HPS_REPO", "make_hps"]

HPS_REPO = "xswu/HPSv2"
HPS_CHECKPOINT = "HPS_v2.1_compressed.pt"
_OPTIONS = "reward.options.hpsv2.1"


@register_reward("hpsv2.1")
def make_hps(
    checkpoint: str = HPS_REPO,
    model_name: str = "ViT-H-14",
    device: str = "cpu",
    dtype: str = "float32",
    batch_size: int = 16,
) -> RewardFn:
    """Build the HPSv2.1 reward.

    Args:
        checkpoint: ``HPS_v2.1_compressed.pt``, a folder holding it, or the hub repo id ``xswu/HPSv2`` looked up in
            the local HF cache only.
        model_name: the open_clip config the checkpoint belongs to (tests register a tiny one).
        device: where the model runs.
        dtype: the model's precision: ``float32``, ``bfloat16`` or ``float16``; cosines are computed in float32.
        batch_size: images per forward pass.

    Returns:
        ``fn(images, prompts, metadata) -> (rewards, info)``: rewards (B,) float32 = the cosine; info is empty.
    """
    import open_clip

    torch_dtype = parse_dtype(dtype, f"{_OPTIONS}.dtype")
    batch_size = check_batch_size(batch_size, f"{_OPTIONS}.batch_size")
    published = Published(
        what="the HPSv2.1 checkpoint",
        option=f"{_OPTIONS}.checkpoint",
        download=f"{HPS_CHECKPOINT} from the Hugging Face repo {HPS_REPO}",
    )
    model, tokenizer, _ = load_open_clip(
        model_name, checkpoint, filename=HPS_CHECKPOINT, published=published, model_name_option=f"{_OPTIONS}.model_name"
    )
    model = model.to(device=device, dtype=torch_dtype)
    image_size = open_clip.get_model_preprocess_cfg(model)["size"]  # 224 for ViT-H-14
    preprocess = open_clip.image_transform(image_size, is_train=False, resize_mode="longest", fill_color=0)

    @torch.no_grad()
    def fn(
        images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        check_inputs(images, prompts)
        pil = to_pil_images(images)
        cos = torch.empty(len(pil), dtype=torch.float32)
        for part in chunks(len(pil), batch_size):
            pixels = torch.stack([preprocess(im) for im in pil[part]]).to(device, torch_dtype)  # (b, 3, S, S)
            tokens = tokenizer(list(prompts[part])).to(device)  # (b, 77)
            # Normalise and sum in float32: in bf16 the cosine itself would be rounded to ~3 significant digits.
            f_img = torch.nn.functional.normalize(model.encode_image(pixels).float(), dim=-1)  # (b, D)
            f_txt = torch.nn.functional.normalize(model.encode_text(tokens).float(), dim=-1)  # (b, D)
            cos[part] = (f_img * f_txt).sum(-1).cpu()
        return cos, {}

    return fn
