"""FLUX.1 (dev) as a policy: diffusers' FluxPipeline denoising step, packed 2×2 latents, embedded guidance.

FLUX.1-dev is guidance-distilled: the guidance scale enters as an embedding, one transformer call per step (no
negative prompt), as in DanceGRPO and Flow-GRPO's Flux runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence, Union

import torch

from ..schedules import Schedule, fixed_shift_schedule
from ..setup.options import DIFFUSERS_COMMON, Shift
from ..setup.registry import CostFacts
from .base import Policy, PolicyError, PromptEmbeds, register_backbone
from .diffusers_common import (
    MODEL,
    SCHEDULER,
    TOKENIZER,
    check_image_size,
    check_model_dir,
    freeze,
    load_component,
    load_scheduler_config,
    load_text_encoders,
    pipeline_schedule,
    prepare_transformer,
    read_config,
    read_options,
    resolve_model_dir,
    to_unit_images,
)
from .tiny import build_flux

__all__ = ["FluxPolicy", "pack_latents", "unpack_latents"]

HUB_ID = "black-forest-labs/FLUX.1-dev"
COMPONENTS = {
    "scheduler": SCHEDULER,
    "text_encoder": MODEL,
    "text_encoder_2": MODEL,
    "tokenizer": TOKENIZER,
    "tokenizer_2": TOKENIZER,
    "transformer": MODEL,
    "vae": MODEL,
}
DEFAULTS: dict[str, Any] = {
    "height": 512,  # pixels; a multiple of 16
    "width": 512,
    "guidance_scale": 3.5,  # the distilled-guidance embedding value (FluxPipeline's default)
    "max_sequence_length": 512,  # T5 tokens (FluxPipeline's default)
    "lora": None,  # {rank, alpha, target_modules, dropout}; None or rank 0: full fine-tune
    "gradient_checkpointing": False,
    "shift": None,  # a fixed schedule shift (DanceGRPO: 3) instead of the pipeline's resolution-dependent one
}
# model.options: what each takes (read strictly before any work: jagg_core/setup/options.py)
OPTIONS = {**DIFFUSERS_COMMON, "shift": (Union[Shift, None], None)}
# jagg plan's arithmetic: the published architecture
COST = CostFacts(
    "FLUX.1-dev", 11.9e9, 57, 3072, 16, 512, 4.76e9 + 0.12e9 + 0.08e9,
    "19 double-stream + 38 single-stream blocks of width 3072; VAE ×8 and 2×2 patches; T5 padded to 512 "
    "tokens; T5-XXL 4.76 B + CLIP-L 0.12 B + VAE 0.08 B frozen")


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) → (B, h/2 · w/2, 4C): 2×2 patches as tokens, as FluxPipeline._pack_latents."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)  # (B, h/2, w/2, C, 2, 2)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h/2 · w/2, 4C) → (B, C, h, w), the inverse of :func:`pack_latents`."""
    b, _, d = latents.shape
    latents = latents.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)  # (B, C, h/2, 2, w/2, 2)
    return latents.reshape(b, d // 4, h, w)


def image_ids(h: int, w: int) -> torch.Tensor:
    """(h/2 · w/2, 3) rotary position ids of the packed tokens: (0, row, column)."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3)


class FluxPolicy(Policy):
    """FLUX.1 transformer (trained) + CLIP/T5 text encoders and VAE (frozen)."""

    def __init__(self, folder: Path, *, device: torch.device, dtype: torch.dtype, options: Mapping[str, Any]):
        from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel

        opts = read_options(options, DEFAULTS, backbone="flux")
        check_model_dir(folder, COMPONENTS, hub_id=HUB_ID)
        vae_scale = 2 ** (len(read_config(folder, "vae")["block_out_channels"]) - 1)
        check_image_size(opts["height"], opts["width"], vae_scale * 2)  # before minutes of loading
        self.height, self.width = opts["height"], opts["width"]
        self.latent_h, self.latent_w = 2 * (self.height // (vae_scale * 2)), 2 * (self.width // (vae_scale * 2))
        self.scheduler_config = load_scheduler_config(folder)
        self.device, self.dtype = device, dtype
        self.guidance_scale = float(opts["guidance_scale"])
        self.shift = None if opts["shift"] is None else float(opts["shift"])
        if self.shift is not None and self.shift <= 0:
            raise PolicyError(f"model.options.shift must be a positive number (DanceGRPO uses 3), got {self.shift}.")
        self.max_sequence_length = int(opts["max_sequence_length"])

        self.encoders = load_text_encoders(
            FluxPipeline, folder, tokenizers=("tokenizer", "tokenizer_2"), device=device, dtype=dtype, hub_id=HUB_ID
        )
        self.vae = freeze(load_component(AutoencoderKL, folder, "vae", dtype=dtype, hub_id=HUB_ID)).to(device)
        transformer = load_component(FluxTransformer2DModel, folder, "transformer", dtype=dtype, hub_id=HUB_ID)
        # Read once here: the trainer may wrap the transformer (DDP) and hide its config.
        self.guidance_embeds = bool(transformer.config.guidance_embeds)
        self.latent_channels = transformer.config.in_channels // 4
        self.transformer = prepare_transformer(
            transformer.to(device), lora=opts["lora"], gradient_checkpointing=bool(opts["gradient_checkpointing"])
        )
        self.img_ids = image_ids(self.latent_h, self.latent_w).to(device=device, dtype=dtype)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        prompt_embeds, pooled, _ = self.encoders.encode_prompt(
            prompt=list(prompts), prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return PromptEmbeds(
            {"prompt_embeds": prompt_embeds.to(self.dtype), "pooled_prompt_embeds": pooled.to(self.dtype)}
        )  # (B, L, D_t5), (B, D_clip)

    def latent_shape(self) -> tuple[int, ...]:
        return ((self.latent_h // 2) * (self.latent_w // 2), self.latent_channels * 4)

    def schedule(self, num_steps: int) -> Schedule:
        if self.shift is not None:
            return fixed_shift_schedule(num_steps, self.shift)
        image_seq_len = (self.latent_h // 2) * (self.latent_w // 2)
        return pipeline_schedule(self.scheduler_config, num_steps, image_seq_len=image_seq_len, spacing="flux")

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        b = latents.shape[0]
        prompt_embeds = embeds.tensors["prompt_embeds"].to(self.device)
        # FluxPipeline: timestep cast to the latents' dtype, then t/1000 (the transformer multiplies by 1000 again).
        t = timesteps.to(device=self.device, dtype=torch.float32).expand(b).to(self.dtype) / 1000
        guidance = (
            torch.full((b,), self.guidance_scale, device=self.device, dtype=torch.float32)
            if self.guidance_embeds
            else None
        )
        out = self.transformer(
            hidden_states=latents.to(self.device, self.dtype),
            timestep=t,
            guidance=guidance,
            pooled_projections=embeds.tensors["pooled_prompt_embeds"].to(self.device),
            encoder_hidden_states=prompt_embeds,
            txt_ids=torch.zeros(prompt_embeds.shape[1], 3, device=self.device, dtype=self.dtype),
            img_ids=self.img_ids,
            return_dict=False,
        )[0]
        return out.float()  # (B, tokens, 4C)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        latents = unpack_latents(latents.to(self.device), self.latent_h, self.latent_w)  # (B, C, h, w)
        latents = latents / config.scaling_factor + (config.shift_factor or 0.0)
        return to_unit_images(self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0])


@register_backbone(
    "flux",
    options=OPTIONS,
    defaults=DEFAULTS,
    hub_id=HUB_ID,
    components=COMPONENTS,
    cost=COST,
    export_pipeline="FluxPipeline",
    stand_in=build_flux,
)
def build_flux(path: str | None, *, device: torch.device, dtype: torch.dtype, options: Mapping[str, Any]) -> Policy:
    return FluxPolicy(resolve_model_dir(path, hub_id=HUB_ID), device=device, dtype=dtype, options=options)
