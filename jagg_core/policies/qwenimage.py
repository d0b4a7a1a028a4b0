"""Qwen-Image as a policy: diffusers' QwenImagePipeline denoising step with true CFG and its norm rescale.

Prompts are encoded by the Qwen2.5-VL text encoder through the pipeline's own template; their lengths differ, so
``encode_prompts`` pads every prompt to ``max_sequence_length`` with a mask (batches then concatenate), and
``velocity`` trims the padding no prompt of its batch uses before calling the transformer (masked tokens are never
attended to, so this changes nothing but cost). The conditional and the negative-prompt halves run as one batched
call (one forward per ``velocity``, as DDP wants), then combine as the pipeline does:
``v = v_neg + w (v_cond − v_neg)``, rescaled per token to the norm of ``v_cond``.
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
from .flux import unpack_latents
from .tiny import build_qwenimage

if TYPE_CHECKING:
    import torch

    from ..schedules import Schedule

__all__ = ["QwenImagePolicy"]

HUB_ID = "Qwen/Qwen-Image"
DEFAULTS: dict[str, Any] = {
    "height": 512,  # pixels; a multiple of 16
    "width": 512,
    "guidance_scale": 4.0,  # the pipeline's true_cfg_scale; <= 1 turns CFG off
    "negative_prompt": " ",  # the negative prompt of Qwen-Image's examples
    "max_sequence_length": 512,  # text tokens after the template (QwenImagePipeline's default)
    "lora": None,  # {rank, alpha, target_modules, dropout}; None or rank 0: full fine-tune
    "gradient_checkpointing": False,
}
# model.options: what each takes (read strictly before any work: jagg_core/setup/options.py)
OPTIONS = {**DIFFUSERS_COMMON, "negative_prompt": (str, None)}
# jagg plan's arithmetic: the published architecture
COST = CostFacts(
    "Qwen-Image", 20.4e9, 60, 3072, 16, 64, 8.3e9 + 0.13e9,
    "60 MMDiT blocks of width 3072; VAE ×8 and 2×2 patches; ~64 prompt tokens assumed (HPDv2 prompts, "
    "unpadded); Qwen2.5-VL-7B 8.3 B + VAE 0.13 B frozen", true_cfg=True)


def _pad(embeds: torch.Tensor, mask: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L, D), (B, L) or None → (B, length, D) zero-padded and its (B, length) long mask."""
    import torch

    b, n, d = embeds.shape
    if mask is None:  # the pipeline drops an all-ones mask
        mask = torch.ones(b, n, dtype=torch.long, device=embeds.device)
    padded = embeds.new_zeros(b, length, d)
    padded[:, :n] = embeds
    full_mask = mask.new_zeros(b, length)
    full_mask[:, :n] = mask
    return padded, full_mask


@diffusers_backbone("qwenimage", options=OPTIONS, cost=COST, stand_in=build_qwenimage)
class QwenImagePolicy(DiffusersPolicy):
    """Qwen-Image transformer (trained) + Qwen2.5-VL text encoder and 3-D VAE (frozen)."""

    hub_id, defaults = HUB_ID, DEFAULTS
    pipeline, transformer_class = "QwenImagePipeline", "QwenImageTransformer2DModel"
    vae_class = "AutoencoderKLQwenImage"
    embeds = ("prompt_embeds", "prompt_embeds_mask")  # (B, max_sequence_length, D), (B, max_sequence_length)
    true_cfg = True

    def _layout(self, folder: Path, opts: Mapping[str, Any]) -> None:
        vae_scale = 2 ** len(read_config(folder, "vae")["temperal_downsample"])
        check_image_size(opts["height"], opts["width"], vae_scale * 2)
        self.height, self.width = opts["height"], opts["width"]
        self.latent_h, self.latent_w = 2 * (self.height // (vae_scale * 2)), 2 * (self.width // (vae_scale * 2))
        self.scheduler_config = load_scheduler_config(folder)

    def _read_transformer(self, config: Any) -> None:
        self.latent_channels = config.in_channels // 4
        self._last_block = f"transformer_blocks.{config.num_layers - 1}."

    def _loaded(self, opts: Mapping[str, Any]) -> None:
        # The last block's text-stream output is discarded, so its output projection and text MLP never get a
        # gradient; freezing them lets DDP run without find_unused_parameters.
        import torch

        for name, p in self.transformer.named_parameters():
            if self._last_block in name and (".attn.to_add_out." in name or ".txt_mlp." in name):
                p.requires_grad_(False)
        self.latents_mean = torch.tensor(self.vae.config.latents_mean).view(1, -1, 1, 1, 1)
        self.latents_std = torch.tensor(self.vae.config.latents_std).view(1, -1, 1, 1, 1)

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask = self.encoders.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return _pad(embeds.to(self.dtype), mask, self.max_sequence_length)

    def latent_shape(self) -> tuple[int, ...]:
        return ((self.latent_h // 2) * (self.latent_w // 2), self.latent_channels * 4)

    def schedule(self, num_steps: int) -> Schedule:
        image_seq_len = (self.latent_h // 2) * (self.latent_w // 2)
        return pipeline_schedule(self.scheduler_config, num_steps, image_seq_len=image_seq_len, spacing="flux")

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        import torch

        b = latents.shape[0]
        x = latents.to(self.device, self.dtype)
        # QwenImagePipeline: timestep cast to the latents' dtype, then t/1000.
        t = timesteps.to(device=self.device, dtype=torch.float32).expand(b).to(self.dtype) / 1000
        text = embeds.tensors["prompt_embeds"].to(self.device)
        mask = embeds.tensors["prompt_embeds_mask"].to(self.device)
        if self.do_cfg:  # conditional half first, then the negative prompt
            x, t = torch.cat([x, x]), torch.cat([t, t])
            text = torch.cat([text, embeds.tensors["negative_prompt_embeds"].to(self.device)])
            mask = torch.cat([mask, embeds.tensors["negative_prompt_embeds_mask"].to(self.device)])
        # Valid tokens come first: keep the longest prompt of the batch; a full mask is dropped, as the pipeline does.
        length = int(mask.sum(dim=1).max())
        text, mask = text[:, :length], mask[:, :length]
        out = self.transformer(
            hidden_states=x,
            timestep=t,
            encoder_hidden_states=text,
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            img_shapes=[[(1, self.latent_h // 2, self.latent_w // 2)]] * x.shape[0],
            return_dict=False,
        )[0].float()  # (B or 2B, tokens, 4C); the guidance arithmetic is upcast
        if not self.do_cfg:
            return out
        cond, uncond = out.chunk(2)
        combined = uncond + self.guidance_scale * (cond - uncond)
        return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))

    @no_grad
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        # Packed exactly as Flux; the VAE is a video VAE: one frame.
        latents = unpack_latents(latents.to(self.device), self.latent_h, self.latent_w).unsqueeze(2)  # (B, C, 1, h, w)
        mean = self.latents_mean.to(latents.device, latents.dtype)
        std = self.latents_std.to(latents.device, latents.dtype)
        latents = latents * std + mean
        image = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0][:, :, 0]  # (B, 3, H, W)
        return to_unit_images(image)

