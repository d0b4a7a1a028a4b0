"""FLUX.1 (dev) as a policy: diffusers' FluxPipeline denoising step, packed 2×2 latents, embedded guidance.

FLUX.1-dev is guidance-distilled: the guidance scale enters as an embedding, one transformer call per step (no
negative prompt), as in DanceGRPO and Flow-GRPO's Flux runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Union

from ..setup.options import DIFFUSERS_COMMON, Shift
from ..setup.registry import CostFacts
from .base import PolicyError, PromptEmbeds, no_grad
from .diffusers_common import check_image_size, load_scheduler_config, pipeline_schedule, \
    read_config, to_unit_images
from .diffusers_policy import DiffusersPolicy, diffusers_backbone
from .tiny import build_flux

if TYPE_CHECKING:
    import torch

    from ..schedules import Schedule

__all__ = ["FluxPolicy", "pack_latents", "unpack_latents"]

HUB_ID = "black-forest-labs/FLUX.1-dev"
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
    "19 double-stream + 38 single-stream blocks of width 3072; VAE ×8 and 2×2 patches; T5 padded to "
    "max_sequence_length tokens (512); T5-XXL 4.76 B + CLIP-L 0.12 B + VAE 0.08 B frozen", text_fixed=0)


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
    import torch

    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3)


@diffusers_backbone("flux", options=OPTIONS, cost=COST, stand_in=build_flux)
class FluxPolicy(DiffusersPolicy):
    """FLUX.1 transformer (trained) + CLIP/T5 text encoders and VAE (frozen)."""

    hub_id, defaults = HUB_ID, DEFAULTS
    pipeline, transformer_class, vae_class = "FluxPipeline", "FluxTransformer2DModel", "AutoencoderKL"
    tokenizers = ("tokenizer", "tokenizer_2")
    embeds = ("prompt_embeds", "pooled_prompt_embeds")  # (B, L, D_t5), (B, D_clip)

    def _layout(self, folder: Path, opts: Mapping[str, Any]) -> None:
        vae_scale = 2 ** (len(read_config(folder, "vae")["block_out_channels"]) - 1)
        check_image_size(opts["height"], opts["width"], vae_scale * 2)
        self.height, self.width = opts["height"], opts["width"]
        self.latent_h, self.latent_w = 2 * (self.height // (vae_scale * 2)), 2 * (self.width // (vae_scale * 2))
        self.scheduler_config = load_scheduler_config(folder)
        self.shift = None if opts["shift"] is None else float(opts["shift"])
        if self.shift is not None and self.shift <= 0:
            raise PolicyError(f"model.options.shift must be a positive number (DanceGRPO uses 3), got {self.shift}.")

    def _read_transformer(self, config: Any) -> None:
        self.guidance_embeds = bool(config.guidance_embeds)
        self.latent_channels = config.in_channels // 4

    def _loaded(self, opts: Mapping[str, Any]) -> None:
        self.img_ids = image_ids(self.latent_h, self.latent_w).to(device=self.device, dtype=self.dtype)

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        prompt_embeds, pooled, _ = self.encoders.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return prompt_embeds.to(self.dtype), pooled.to(self.dtype)

    def latent_shape(self) -> tuple[int, ...]:
        return ((self.latent_h // 2) * (self.latent_w // 2), self.latent_channels * 4)

    def schedule(self, num_steps: int) -> Schedule:
        from ..schedules import fixed_shift_schedule

        if self.shift is not None:
            return fixed_shift_schedule(num_steps, self.shift)
        image_seq_len = (self.latent_h // 2) * (self.latent_w // 2)
        return pipeline_schedule(self.scheduler_config, num_steps, image_seq_len=image_seq_len, spacing="flux")

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        import torch

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

    @no_grad
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        latents = unpack_latents(latents.to(self.device), self.latent_h, self.latent_w)  # (B, C, h, w)
        latents = latents / config.scaling_factor + (config.shift_factor or 0.0)
        return to_unit_images(self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0])

