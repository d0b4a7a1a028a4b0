"""Stable Diffusion 3.5 as a policy: diffusers' StableDiffusion3Pipeline denoising step with true CFG.

Latents stay unpacked (C, h, w); the transformer patchifies them itself. Classifier-free guidance runs the
unconditional and conditional halves in one batched transformer call, as the pipeline does, so one ``velocity`` is
one forward (and one DDP/FSDP pass).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ..setup.options import DIFFUSERS_COMMON
from ..setup.registry import CostFacts
from .base import PromptEmbeds, no_grad
from .diffusers_common import check_image_size, load_scheduler_config, pipeline_schedule, \
    read_config, to_unit_images
from .diffusers_policy import DiffusersPolicy, diffusers_backbone
from .tiny import build_sd3

if TYPE_CHECKING:
    import torch

    from ..schedules import Schedule

__all__ = ["SD3Policy"]

HUB_ID = "stabilityai/stable-diffusion-3.5-medium"
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
    "24 MMDiT-X blocks of width 1536; VAE ×8 and 2×2 patches; 77 CLIP + max_sequence_length T5 tokens (128, as "
    "Flow-GRPO); T5-XXL 4.76 B + CLIP-L/G 0.82 B + VAE 0.08 B frozen", true_cfg=True, text_fixed=77)


@diffusers_backbone("sd3", options=OPTIONS, cost=COST, stand_in=build_sd3)
class SD3Policy(DiffusersPolicy):
    """SD3 transformer (trained) + CLIP-L/CLIP-G/T5 text encoders and VAE (frozen)."""

    hub_id, defaults = HUB_ID, DEFAULTS
    pipeline, transformer_class, vae_class = "StableDiffusion3Pipeline", "SD3Transformer2DModel", "AutoencoderKL"
    tokenizers = ("tokenizer", "tokenizer_2", "tokenizer_3")
    embeds = ("prompt_embeds", "pooled_prompt_embeds")  # (B, 77 + L, D), (B, P)
    true_cfg = True

    def _layout(self, folder: Path, opts: Mapping[str, Any]) -> None:
        vae_scale = 2 ** (len(read_config(folder, "vae")["block_out_channels"]) - 1)
        self.patch_size = read_config(folder, "transformer")["patch_size"]
        check_image_size(opts["height"], opts["width"], vae_scale * self.patch_size)
        self.height, self.width = opts["height"], opts["width"]
        self.latent_h, self.latent_w = self.height // vae_scale, self.width // vae_scale
        self.scheduler_config = load_scheduler_config(folder)

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

    def latent_shape(self) -> tuple[int, ...]:
        return (self.latent_channels, self.latent_h, self.latent_w)

    def schedule(self, num_steps: int) -> Schedule:
        # The pipeline's image_seq_len (used only by dynamic-shifting configs) counts transformer patches.
        image_seq_len = (self.latent_h // self.patch_size) * (self.latent_w // self.patch_size)
        return pipeline_schedule(self.scheduler_config, num_steps, image_seq_len=image_seq_len, spacing="sd3")

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        import torch

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

    @no_grad
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        latents = latents.to(self.device) / config.scaling_factor + (config.shift_factor or 0.0)
        return to_unit_images(self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0])

