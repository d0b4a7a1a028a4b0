"""Wan2.1 text-to-video as a policy: diffusers' WanPipeline denoising step with true CFG, on video latents.

A sample is a clip: its latent is ``(C, F', h, w)`` with ``F' = (num_frames − 1) / 4 + 1`` latent frames (the Wan VAE
compresses time 4× after the first frame and space 8×); the transformer patchifies it itself (1×2×2 patches). The SDE
step, its log-prob (a mean over every non-batch dimension) and the JAGG group backward are shape-agnostic, so a clip
goes through them exactly as an image does. ``decode`` returns clips ``(B, F, 3, H, W)`` in [0, 1]; the rewards score
chosen frames of them (``reward.frames``, :mod:`jagg_core.rewards.clips`).

Prompts are encoded by UMT5 through the pipeline's own ``encode_prompt`` (zero-padded to ``max_sequence_length``, as
the pipeline passes them to the transformer, no mask). The conditional and the negative-prompt halves run as one
batched call (one forward per ``velocity``), combined as the pipeline does: ``v = v_neg + w (v_cond − v_neg)``.
The schedule is the fixed-shift one of the published GRPO recipes for Wan (``T + 1`` equally spaced sigmas shifted by
``shift``; Pref-GRPO's ``--shift 3``), not the UniPC sampler Wan ships with: the SDE needs a flow-matching Euler grid.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ..setup.options import DIFFUSERS_COMMON, Frames, Shift
from ..setup.registry import CostFacts
from .base import PolicyError, PromptEmbeds, no_grad
from .diffusers_common import check_image_size, read_config, to_unit_images
from .diffusers_policy import DiffusersPolicy, diffusers_backbone
from .tiny import build_wan

if TYPE_CHECKING:
    import torch

    from ..schedules import Schedule

__all__ = ["WanPolicy", "WAN_LORA_TARGETS", "FSDP_BLOCK"]

HUB_ID = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
# Self- and cross-attention projections of every WanTransformerBlock (the text enters through cross-attention: no
# add_*_proj as in the MMDiT backbones).
WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
FSDP_BLOCK = "WanTransformerBlock"  # the FSDP2 unit (configs/accelerate/fsdp2-wan.yaml); found in ``blocks``
DEFAULTS: dict[str, Any] = {
    "height": 480,  # pixels; a multiple of 16 (VAE ×8, 2×2 patches); WanPipeline's default 480×832
    "width": 832,
    "num_frames": 81,  # frames of a clip; num_frames − 1 a multiple of 4 (WanPipeline's default)
    "guidance_scale": 5.0,  # true CFG scale (WanPipeline's default; Pref-GRPO's --cfg_infer 5.0); <= 1 turns CFG off
    "negative_prompt": "",  # WanPipeline's default negative prompt
    "max_sequence_length": 512,  # UMT5 tokens (WanPipeline's default)
    "shift": 3.0,  # the fixed schedule shift (Pref-GRPO's --shift 3)
    "lora": None,  # {rank, alpha, target_modules, dropout}; None or rank 0: full fine-tune
    "gradient_checkpointing": False,
    "vae_tiling": False,  # decode in spatial tiles (Pref-GRPO calls vae.enable_tiling()): less memory at 480p and up
}
# model.options: what each takes (read strictly before any work: jagg_core/setup/options.py)
OPTIONS = {**DIFFUSERS_COMMON, "negative_prompt": (str, None), "num_frames": (Frames, None), "shift": (Shift, None),
           "vae_tiling": (bool, None)}
# jagg plan's arithmetic: the published architecture
COST = CostFacts(
    "Wan2.1-T2V-1.3B", 1.42e9, 30, 1536, 16, 512, 5.7e9 + 0.13e9,
    "30 blocks of width 1536 (self-attention over the clip's tokens, cross-attention to max_sequence_length "
    "UMT5 tokens (512), FFN "
    "8960); VAE ×8 in space, ×4 in time, and 1×2×2 patches; UMT5-XXL encoder 5.7 B + VAE 0.13 B frozen",
    frames_per_latent=4, cross_attention=True, true_cfg=True, text_fixed=0)


def _check_frames(num_frames: Any, temporal: int) -> None:
    if not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % temporal:
        raise PolicyError(f"model.num_frames must be {temporal}·k + 1 frames (e.g. 33, 49 or 81), got {num_frames!r}.")


@diffusers_backbone("wan", options=OPTIONS, cost=COST, stand_in=build_wan, video=True)
class WanPolicy(DiffusersPolicy):
    """Wan transformer (trained) + UMT5 text encoder and Wan VAE (frozen)."""

    hub_id, defaults = HUB_ID, DEFAULTS
    pipeline, transformer_class, vae_class = "WanPipeline", "WanTransformer3DModel", "AutoencoderKLWan"
    true_cfg = True

    def _layout(self, folder: Path, opts: Mapping[str, Any]) -> None:
        vae_config = read_config(folder, "vae")
        spatial = int(vae_config.get("scale_factor_spatial") or 8)
        temporal = int(vae_config.get("scale_factor_temporal") or 4)
        patch = read_config(folder, "transformer").get("patch_size", [1, 2, 2])
        check_image_size(opts["height"], opts["width"], spatial * int(patch[1]))
        _check_frames(opts["num_frames"], temporal)
        self.shift = float(opts["shift"])
        if self.shift <= 0:
            raise PolicyError(f"model.options.shift must be a positive number (Pref-GRPO uses 3), got {self.shift}.")
        self.height, self.width, self.num_frames = opts["height"], opts["width"], opts["num_frames"]
        self.latent_frames = (self.num_frames - 1) // temporal + 1
        self.latent_h, self.latent_w = self.height // spatial, self.width // spatial

    def _lora(self, lora: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        if lora and lora.get("rank") and not lora.get("target_modules"):
            return {**lora, "target_modules": list(WAN_LORA_TARGETS)}
        return lora

    def _loaded(self, opts: Mapping[str, Any]) -> None:
        import torch

        if opts["vae_tiling"]:
            self.vae.enable_tiling()
        z = self.vae.config.z_dim
        self.latents_mean = torch.tensor(self.vae.config.latents_mean).view(1, z, 1, 1, 1)
        self.latents_std = torch.tensor(self.vae.config.latents_std).view(1, z, 1, 1, 1)

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor]:
        embeds, _ = self.encoders.encode_prompt(
            prompt=prompts, do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return (embeds.to(self.dtype),)  # (B, max_sequence_length, D), zero past each prompt's tokens

    def latent_shape(self) -> tuple[int, ...]:
        return (self.latent_channels, self.latent_frames, self.latent_h, self.latent_w)

    def schedule(self, num_steps: int) -> Schedule:
        from ..schedules import fixed_shift_schedule

        return fixed_shift_schedule(num_steps, self.shift)

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        import torch

        b = latents.shape[0]
        x = latents.to(self.device, self.dtype)
        t = timesteps.to(device=self.device, dtype=torch.float32).expand(b)  # Wan takes t in [0, 1000] as is
        text = embeds.tensors["prompt_embeds"].to(self.device)
        if self.do_cfg:  # conditional half first, then the negative prompt
            x, t = torch.cat([x, x]), torch.cat([t, t])
            text = torch.cat([text, embeds.tensors["negative_prompt_embeds"].to(self.device)])
        out = self.transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        out = out.to(torch.promote_types(out.dtype, torch.float32))  # the guidance arithmetic upcast (float64 stays)
        if not self.do_cfg:  # (B or 2B, C, F', h, w)
            return out
        cond, uncond = out.chunk(2)
        return uncond + self.guidance_scale * (cond - uncond)

    @no_grad
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents (B, C, F', h, w) → clips (B, F, 3, H, W) float32 in [0, 1]."""
        latents = latents.to(self.device)
        latents = latents * self.latents_std.to(latents.device) + self.latents_mean.to(latents.device)
        video = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]  # (B, 3, F, H, W) in [-1, 1]
        return to_unit_images(video).permute(0, 2, 1, 3, 4).contiguous()

