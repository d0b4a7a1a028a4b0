"""Stable Diffusion 3.5 as a policy: diffusers' StableDiffusion3Pipeline denoising step with true CFG.

Latents stay unpacked (C, h, w); the transformer patchifies them itself. Classifier-free guidance runs the
unconditional and conditional halves in one batched transformer call, as the pipeline does, so one ``velocity`` is
one forward (and one DDP/FSDP pass).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..schedules import Schedule
from ..setup.options import DIFFUSERS_COMMON
from ..setup.registry import CostFacts
from .base import Policy, PromptEmbeds, register_backbone
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
from .tiny import build_sd3

__all__ = ["SD3Policy"]

HUB_ID = "stabilityai/stable-diffusion-3.5-medium"
COMPONENTS = {
    "scheduler": SCHEDULER,
    "text_encoder": MODEL,
    "text_encoder_2": MODEL,
    "text_encoder_3": MODEL,
    "tokenizer": TOKENIZER,
    "tokenizer_2": TOKENIZER,
    "tokenizer_3": TOKENIZER,
    "transformer": MODEL,
    "vae": MODEL,
}
DEFAULTS: dict[str, Any] = {
    "height": 512,  # pixels; a multiple of vae_scale_factor · patch_size (16)
    "width": 512,
    "guidance_scale": 4.5,  # true CFG scale, as Flow-GRPO trains SD3.5; <= 1 turns CFG off
    "negative_prompt": "",  # the pipeline's default negative prompt
    "max_sequence_length": 128,  # T5 tokens, as Flow-GRPO (the pipeline's default is 256)
    "lora": None,  # {rank, alpha, target_modules, dropout}; None or rank 0: full fine-tune
    "gradient_checkpointing": False,
}
# model.options: what each takes (read strictly before any work: jagg_core/setup/options.py)
OPTIONS = {**DIFFUSERS_COMMON, "negative_prompt": (str, None)}
# jagg plan's arithmetic: the published architecture
COST = CostFacts(
    "SD3.5 Medium", 2.5e9, 24, 1536, 16, 333, 4.76e9 + 0.82e9 + 0.08e9,
    "24 MMDiT-X blocks of width 1536; VAE ×8 and 2×2 patches; 77 CLIP + 256 T5 tokens; T5-XXL 4.76 B + "
    "CLIP-L/G 0.82 B + VAE 0.08 B frozen", true_cfg=True)


class SD3Policy(Policy):
    """SD3 transformer (trained) + CLIP-L/CLIP-G/T5 text encoders and VAE (frozen)."""

    def __init__(self, folder: Path, *, device: torch.device, dtype: torch.dtype, options: Mapping[str, Any]):
        from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline

        opts = read_options(options, DEFAULTS, backbone="sd3")
        check_model_dir(folder, COMPONENTS, hub_id=HUB_ID)
        vae_scale = 2 ** (len(read_config(folder, "vae")["block_out_channels"]) - 1)
        self.patch_size = read_config(folder, "transformer")["patch_size"]
        check_image_size(opts["height"], opts["width"], vae_scale * self.patch_size)  # before minutes of loading
        self.height, self.width = opts["height"], opts["width"]
        self.latent_h, self.latent_w = self.height // vae_scale, self.width // vae_scale
        self.scheduler_config = load_scheduler_config(folder)
        self.device, self.dtype = device, dtype
        self.guidance_scale = float(opts["guidance_scale"])
        self.do_cfg = self.guidance_scale > 1  # StableDiffusion3Pipeline.do_classifier_free_guidance
        self.negative_prompt = str(opts["negative_prompt"])
        self.max_sequence_length = int(opts["max_sequence_length"])
        self._negative: tuple[torch.Tensor, torch.Tensor] | None = None

        self.encoders = load_text_encoders(
            StableDiffusion3Pipeline,
            folder,
            tokenizers=("tokenizer", "tokenizer_2", "tokenizer_3"),
            device=device,
            dtype=dtype,
            hub_id=HUB_ID,
        )
        self.vae = freeze(load_component(AutoencoderKL, folder, "vae", dtype=dtype, hub_id=HUB_ID)).to(device)
        transformer = load_component(SD3Transformer2DModel, folder, "transformer", dtype=dtype, hub_id=HUB_ID)
        self.latent_channels = transformer.config.in_channels
        self.transformer = prepare_transformer(
            transformer.to(device), lora=opts["lora"], gradient_checkpointing=bool(opts["gradient_checkpointing"])
        )

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        prompt_embeds, _, pooled, _ = self.encoders.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return prompt_embeds.to(self.dtype), pooled.to(self.dtype)  # (B, 77 + L, D), (B, P)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        prompt_embeds, pooled = self._encode(list(prompts))
        tensors = {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}
        if self.do_cfg:
            if self._negative is None:  # the same for every prompt: encoded once
                self._negative = self._encode([self.negative_prompt])
            neg, neg_pooled = self._negative
            b = len(prompts)
            tensors["negative_prompt_embeds"] = neg.expand(b, -1, -1)
            tensors["negative_pooled_prompt_embeds"] = neg_pooled.expand(b, -1)
        return PromptEmbeds(tensors)

    def latent_shape(self) -> tuple[int, ...]:
        return (self.latent_channels, self.latent_h, self.latent_w)

    def schedule(self, num_steps: int) -> Schedule:
        # The pipeline's image_seq_len (used only by dynamic-shifting configs) counts transformer patches.
        image_seq_len = (self.latent_h // self.patch_size) * (self.latent_w // self.patch_size)
        return pipeline_schedule(self.scheduler_config, num_steps, image_seq_len=image_seq_len, spacing="sd3")

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        b = latents.shape[0]
        x = latents.to(self.device, self.dtype)
        t = timesteps.to(device=self.device, dtype=torch.float32).expand(b)  # SD3 takes t in [0, 1000] as is
        prompt_embeds = embeds.tensors["prompt_embeds"].to(self.device)
        pooled = embeds.tensors["pooled_prompt_embeds"].to(self.device)
        if self.do_cfg:  # unconditional half first, as the pipeline concatenates
            x, t = torch.cat([x, x]), torch.cat([t, t])
            prompt_embeds = torch.cat([embeds.tensors["negative_prompt_embeds"].to(self.device), prompt_embeds])
            pooled = torch.cat([embeds.tensors["negative_pooled_prompt_embeds"].to(self.device), pooled])
        out = self.transformer(
            hidden_states=x,
            timestep=t,
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0].float()  # (B or 2B, C, h, w); the guidance arithmetic is upcast
        if not self.do_cfg:
            return out
        uncond, cond = out.chunk(2)
        return uncond + self.guidance_scale * (cond - uncond)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        latents = latents.to(self.device) / config.scaling_factor + (config.shift_factor or 0.0)
        return to_unit_images(self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0])


@register_backbone(
    "sd3",
    options=OPTIONS,
    defaults=DEFAULTS,
    hub_id=HUB_ID,
    components=COMPONENTS,
    cost=COST,
    export_pipeline="StableDiffusion3Pipeline",
    stand_in=build_sd3,
)
def build_sd3(path: str | None, *, device: torch.device, dtype: torch.dtype, options: Mapping[str, Any]) -> Policy:
    return SD3Policy(resolve_model_dir(path, hub_id=HUB_ID), device=device, dtype=dtype, options=options)
