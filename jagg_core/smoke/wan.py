"""The `wan` case of the smoke test (`jagg smoke --profile wan`): a tiny random Wan2.1-shaped text-to-video pipeline
trained by the real trainer for every method under bf16 autocast, with the same checks as the Flux case (the first
PPO ratio exactly 1, peak memory, the update's time and speedup).

What it builds: a WanPipeline folder with random weights: a UMT5 text encoder, a Wan VAE with the released
model's compression (×8 in space, ×4 in time, 16 latent channels), a ``WanTransformer3DModel`` with 1×2×2 patches;
nothing is downloaded. Clips are scored by the pixel reward ``jpeg_compressibility`` on 2 frames (``reward.frames``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..policies.tiny import WanShape, build_wan

__all__ = ["WAN_PROFILES", "WAN_SIZES", "WanSmokeSize", "build_tiny_wan", "wan_overrides"]

WAN_PROFILES = ("wan",)  # the profiles whose smoke test builds a tiny Wan instead of a tiny Flux


@dataclass(frozen=True)
class WanSmokeSize:
    """The tiny Wan and the rollout it is trained on (field names shared with the Flux case where they mean the same)."""

    resolution: int  # pixels (square); a multiple of 16 (VAE ×8 and 2×2 patches)
    num_frames: int  # frames of a clip; 4·k + 1
    num_steps: int | None  # denoising steps; None: the profile's own
    group_size: int  # clips per prompt
    prompts_per_iteration: int
    max_sequence_length: int  # UMT5 tokens
    num_layers: int  # WanTransformerBlocks
    num_attention_heads: int
    attention_head_dim: int
    text_dim: int  # UMT5 width
    ffn_dim: int
    vae_base_dim: int


WAN_SIZES: dict[str, WanSmokeSize] = {
    # 256 px × 17 frames: 5 latent frames × 16 × 16 = 1280 tokens; 4 blocks of 8 heads × 64 (width 512), 16 steps.
    "gpu": WanSmokeSize(resolution=256, num_frames=17, num_steps=16, group_size=4, prompts_per_iteration=2,
                        max_sequence_length=64, num_layers=4, num_attention_heads=8, attention_head_dim=64,
                        text_dim=256, ffn_dim=1024, vae_base_dim=16),
    # Seconds on 2 CPU cores: 32 px × 5 frames (2 latent frames × 2 × 2 tokens), one block, 4 steps.
    "cpu": WanSmokeSize(resolution=32, num_frames=5, num_steps=4, group_size=2, prompts_per_iteration=2,
                        max_sequence_length=24, num_layers=1, num_attention_heads=2, attention_head_dim=8,
                        text_dim=16, ffn_dim=32, vae_base_dim=8),
}


def build_tiny_wan(folder: str | Path, size: WanSmokeSize, *, seed: int = 0) -> Path:
    """A Wan2.1-T2V-shaped pipeline of the smoke test's ``size`` with random weights, saved as a diffusers folder
    (jagg_core/policies/tiny.py): the released model's VAE compression (×8 in space, ×4 in time, 16 latent channels)."""
    d = size.text_dim
    shape = WanShape(
        num_layers=size.num_layers, num_attention_heads=size.num_attention_heads,
        attention_head_dim=size.attention_head_dim, ffn_dim=size.ffn_dim, freq_dim=64, rope_max_seq_len=256,
        text_dim=d, text_head_dim=max(8, d // 4), text_heads=4 if d >= 32 else 2, text_buckets=32,
        z_dim=16, vae_base_dim=size.vae_base_dim, vae_dim_mult=(1, 2, 4, 4), temporal_downsample=(False, True, True),
        scale_factor_temporal=4, scale_factor_spatial=8, latents_mean=None, latents_std=None)
    return build_wan(folder, shape, seed=seed)


def wan_overrides(size: WanSmokeSize) -> dict[str, Any]:
    """What the wan case sets beside the smoke test's own overrides: the clip's size and the reward's frames."""
    return {"model.options.num_frames": size.num_frames, "reward.frames": 2, "model.lora.rank": 0,
            "train.optimizer_steps_per_epoch": 1}  # the ratio check reads iteration 1 as the first optimizer step
