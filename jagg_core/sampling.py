"""Sampling a policy: the denoising loop shared by rollouts and evaluation (image grids: :mod:`jagg_core.media`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .policies.base import Policy, PromptEmbeds
from .sde import sde_step_with_logprob

__all__ = ["Denoised", "denoise", "derive_seed", "sample_images", "to_uint8", "seeded_generators"]


def derive_seed(*parts: int) -> int:
    """A 63-bit seed mixing integers (splitmix64), for independent per-(seed, iteration, index) streams."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
    return x & 0x7FFFFFFFFFFFFFFF


def seeded_generators(seeds: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per sample: a sample's noise then depends on its seed only, not on batching."""
    return [torch.Generator().manual_seed(int(s) % (2**63)) for s in seeds]


@dataclass
class Denoised:
    latents: torch.Tensor  # (B, T + 1, *latent) z_0 .. z_T, float32
    log_probs: torch.Tensor  # (B, T) log-probs of the sampled steps (0 on ODE steps)
    velocities: dict[int, torch.Tensor]  # step j -> (B, *latent) velocity used at step j (only steps asked for)


@torch.no_grad()
def denoise(
    policy: Policy,
    noise: torch.Tensor,
    embeds: PromptEmbeds,
    num_steps: int,
    *,
    noise_level: float | Sequence[float],
    sde_kind: str = "flow_grpo",
    generators: Sequence[torch.Generator] | None = None,
    keep_velocities: Sequence[int] = (),
    autocast: Callable[[], object] = contextlib.nullcontext,
) -> Denoised:
    """Run the sampler from ``noise`` (B, *latent); ``noise_level`` per step (0 = ODE step). ``autocast`` wraps each
    policy call: the trainer passes the update's own, so that under mixed precision the rollout's log-probs and
    velocities come from the same precision as the update's (the first PPO ratio is exactly 1)."""
    sched = policy.schedule(num_steps)
    levels = [float(noise_level)] * num_steps if np.isscalar(noise_level) else [float(x) for x in noise_level]
    z = noise.to(policy.device, torch.float32)
    b = z.shape[0]
    latents, log_probs, kept = [z], [], {}
    for j in range(num_steps):
        t = sched.timesteps[j].to(device=policy.device, dtype=torch.float32).expand(b)
        with autocast():
            v = policy.velocity(z, t, embeds)
        step = sde_step_with_logprob(
            z, v, float(sched.sigmas[j]), float(sched.sigmas[j + 1]), noise_level=levels[j], kind=sde_kind,
            generator=generators,
        )
        if j in keep_velocities:
            kept[j] = v.detach()
        z = step.prev_sample.to(torch.float32)
        latents.append(z)
        log_probs.append(step.log_prob.to(torch.float32))
    return Denoised(torch.stack(latents, 1), torch.stack(log_probs, 1), kept)


@torch.no_grad()
def sample_images(
    policy: Policy,
    prompts: Sequence[str],
    *,
    num_steps: int,
    seeds: Sequence[int],
    batch_size: int = 32,
    noise_level: float = 0.0,
    sde_kind: str = "flow_grpo",
) -> torch.Tensor:
    """Images (N, 3, H, W) in [0, 1] for ``prompts``, prompt i from ``seeds[i]`` (ODE sampler by default)."""
    if len(seeds) != len(prompts):
        raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts.")
    out = []
    for i in range(0, len(prompts), batch_size):
        gens = seeded_generators(seeds[i : i + batch_size])
        noise = torch.cat([policy.initial_noise(1, g) for g in gens])
        embeds = policy.encode_prompts(prompts[i : i + batch_size])
        res = denoise(policy, noise, embeds, num_steps, noise_level=noise_level, sde_kind=sde_kind, generators=gens)
        out.append(policy.decode(res.latents[:, -1]).cpu())
    return torch.cat(out)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) in [0, 1] -> (B, H, W, 3) uint8."""
    return (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
