"""HPSv2.1 (Wu et al. 2023, "Human Preference Score v2"): the reward ``hpsv2.1``.

HPSv2.1 is open_clip's ViT-H-14 fine-tuned on human preferences; its checkpoint ``HPS_v2.1_compressed.pt`` (HF repo
``xswu/HPSv2``) holds ``{'state_dict': ...}`` with exactly open_clip ViT-H-14's keys, so the model is built here with
``open_clip_torch`` directly (the ``hpsv2`` package is not a usable dependency, see docs/architecture.md#environment).

The score is hpsv2's: the cosine of the L2-normalised image and text features,
``hps = <f_img / |f_img|, f_txt / |f_txt|>`` (no logit scale), ~0.25-0.37 on real images -- the raw scale GRPO
trainers (Flow-GRPO, DanceGRPO) use as the reward. HPSv2's tables report it x100 (e.g. 27.4 for 0.274).

Preprocessing is hpsv2's ``preprocess_val`` (of ``create_model_and_transforms(..., light_augmentation=True)``:
``ToTensor`` then ``ResizeMaxSize``) pixel for pixel, batched (tested in tests/test_hps_reference.py): the images
rounded to 8 bits (as an image file stores them) are taken as floats ``uint8 / 255``; that float tensor is resized so
that its longest side is the model's input size (bicubic, with torchvision's default antialiasing; new sides
``round(side * size / longest)``, Python's ``round``), padded to a square with 0 (``pw // 2`` left, ``ph // 2`` top,
the rest right and bottom) and normalised with CLIP's mean/std. Unlike hpsv2, a non-square image whose longest side
already is the input size is padded too (hpsv2 leaves it unpadded, which its model cannot take). This is not
``open_clip.image_transform(..., resize_mode='longest')``, which resizes the 8-bit image and rounds the result to 8
bits again (2.7e-5 off in the score on that test's random ViT-H-14). It runs in float32 on the model's device: on the
CPU it is bit-identical to ``preprocess_val``; on a GPU, CUDA's resampling kernel may round the last bit differently.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..setup.options import HF_SCORER
from .base import RewardError, RewardFn, register_reward
from .clip_models import (
    Published,
    check_batch_size,
    check_inputs,
    chunks,
    load_open_clip,
    parse_dtype,
)

if TYPE_CHECKING:
    import torch

__all__ = ["HPS_CHECKPOINT", "HPS_REPO", "hps_pixels", "make_hps"]

HPS_REPO = "xswu/HPSv2"
HPS_CHECKPOINT = "HPS_v2.1_compressed.pt"
_OPTIONS = "reward.options.hpsv2.1"


def hps_pixels(images: torch.Tensor, size: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """hpsv2's ``preprocess_val``, batched (module docstring).

    Args:
        images: (B, 3, H, W) floats in [0, 1].
        size: the model's input size (224 for ViT-H-14).
        device: where to compute.

    Returns:
        (B, 3, size, size) float32 on ``device``.
    """
    import open_clip
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    # Rounded to 8 bits as in to_pil_images, then ToTensor's uint8 / 255 (exact integers: the same floats).
    x = (images.detach().to(device).float().clamp(0, 1) * 255).round() / 255  # (B, 3, H, W)
    height, width = x.shape[-2:]
    # hpsv2's ResizeMaxSize.forward, line for line (its resize and pad only when scale != 1; the pad always here).
    scale = size / float(max(height, width))
    new_size = [round(dim * scale) for dim in (height, width)]
    if scale != 1.0:
        x = TF.resize(x, new_size, InterpolationMode.BICUBIC)  # antialias=True, torchvision's default
    pad_h, pad_w = size - new_size[0], size - new_size[1]
    x = TF.pad(x, padding=[pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)
    return TF.normalize(x, open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD)  # (B, 3, size, size)


def _describe(options: Mapping[str, Any]) -> str:
    return (f"open_clip {options.get('model_name', 'ViT-H-14')}, pretrained {options.get('checkpoint', HPS_REPO)}:"
            f"{HPS_CHECKPOINT}; raw cosine (x100 in hpsv2's leaderboard)")


@register_reward("hpsv2.1", options={"checkpoint": (str, None), "model_name": (str, None), **HF_SCORER},
                 table=("hpsv2.1", 1.0, "raw cosine"), describe=_describe,
                 weights=lambda options: [options.get("checkpoint") or HPS_REPO])
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
    import torch
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
    image_size = open_clip.get_model_preprocess_cfg(model)["size"]  # (224, 224) for ViT-H-14
    if isinstance(image_size, (tuple, list)):  # hpsv2's image_transform takes a square one as its side
        if image_size[0] != image_size[1]:
            raise RewardError(f"{_OPTIONS}.model_name {model_name!r} has a non-square input size {tuple(image_size)}: "
                              f"HPSv2's preprocessing pads to a square; use a model config with a square image_size.")
        image_size = image_size[0]

    @torch.no_grad()
    def fn(
        images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        check_inputs(images, prompts)
        cos = torch.empty(len(images), dtype=torch.float32)
        for part in chunks(len(images), batch_size):
            pixels = hps_pixels(images[part], image_size, device).to(torch_dtype)  # (b, 3, S, S)
            tokens = tokenizer(list(prompts[part])).to(device)  # (b, 77)
            # Normalise and sum in float32: in bf16 the cosine itself would be rounded to ~3 significant digits.
            f_img = torch.nn.functional.normalize(model.encode_image(pixels).float(), dim=-1)  # (b, D)
            f_txt = torch.nn.functional.normalize(model.encode_text(tokens).float(), dim=-1)  # (b, D)
            cos[part] = (f_img * f_txt).sum(-1).cpu()
        return cos, {}

    fn.modules = (model,)  # type: ignore[attr-defined]  (rewards_off_device moves it)
    return fn
