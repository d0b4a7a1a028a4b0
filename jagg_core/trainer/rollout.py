"""Rollouts: G images per prompt sampled with the SDE, stored compactly with their log-probs.

Three recipes (``sample.recipe``):
- ``dance_grpo``: SDE on every step, every step trainable (DanceGRPO); the update may train a random subset of
  whole groups (``timestep_fraction``).
- ``flow_grpo_fast``: SDE inside a window of ``sde_window_size`` steps whose start is drawn from
  ``sde_window_range``, ODE elsewhere; only the window is trained (Flow-GRPO-Fast).
- ``mix_grpo``: SDE inside a window of ``sde_window_size`` steps that slides along the trajectory over training, ODE
  elsewhere; only the window is trained (MixGRPO, arXiv:2507.21802). The window starts at ``sde_window_range[0]``,
  moves ``window_stride`` steps every ``window_shift_every`` iterations and rolls back to the start once it would pass
  ``sde_window_range[1] - 1`` (MixGRPO's progressive strategy with roll-back). With ``sde_window_size`` = ``jagg.window``
  the window is one JAGG group: 2 graphs instead of W per rollout.

Every random draw comes from a generator seeded by (seed, iteration, global image index), so a rollout does not depend
on how images are batched or split over processes, and a resumed run repeats it exactly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..setup.config import SampleConfig
from ..policies.base import Policy, PromptEmbeds
from ..sampling import denoise, derive_seed, seeded_generators

__all__ = ["Trajectory", "rollout", "choose_train_steps", "image_layout"]


@dataclass
class Trajectory:
    """One process's share of an iteration's rollout (B = local prompts × G images)."""

    prompts: list[str]  # (P,) local prompts, each once
    embeds: PromptEmbeds  # (P, ...) their encodings, once per prompt
    prompt_index: torch.Tensor  # (B,) row of each image in prompts / embeds
    group_ids: torch.Tensor  # (B,) global prompt index: the advantage group
    latents: torch.Tensor  # (B, T + 1, *latent) z_0 .. z_T, float32
    log_probs: torch.Tensor  # (B, T) rollout log-probs (0 on ODE steps)
    sigmas: torch.Tensor  # (T + 1,)
    timesteps: torch.Tensor  # (T,) network timesteps
    train_steps: list[int]  # trained (SDE) steps in denoising order
    images: torch.Tensor  # (B, 3, H, W) in [0, 1]
    velocities: dict[int, torch.Tensor] = field(default_factory=dict)  # step -> (B, *latent) rollout velocity
    policy_version: int = 0  # optimizer steps taken before this rollout

    @property
    def batch_size(self) -> int:
        return int(self.latents.shape[0])

    def image_prompts(self) -> list[str]:
        """(B,) the prompt of each image (what the rewards score it against)."""
        return [self.prompts[int(i)] for i in self.prompt_index]

    def image_embeds(self, index: torch.Tensor | Sequence[int]) -> PromptEmbeds:
        return self.embeds[self.prompt_index[torch.as_tensor(index, dtype=torch.long)]]


def image_layout(global_prompt_ids: Sequence[int], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout's rows: (B,) each image's local prompt row and (B,) its group id (its global prompt index), G
    consecutive images per prompt in the prompts' order."""
    p = len(global_prompt_ids)
    prompt_index = torch.arange(p).repeat_interleave(group_size)  # (B,)
    group_ids = torch.as_tensor(list(global_prompt_ids), dtype=torch.long).repeat_interleave(group_size)
    return prompt_index, group_ids


def choose_train_steps(cfg: SampleConfig, generator: torch.Generator, iteration: int = 0) -> list[int]:
    """The trained (SDE) steps of the rollout of ``iteration`` (0-based), in denoising order."""
    if cfg.recipe == "dance_grpo":
        return list(range(cfg.trained_steps))
    lo, hi = cfg.sde_window_range
    if cfg.recipe == "mix_grpo":  # a function of the iteration alone: a resumed run slides the same way
        positions = (hi - 1 - lo) // cfg.window_stride + 1
        start = lo + cfg.window_stride * ((iteration // cfg.window_shift_every) % positions)
    else:
        start = int(torch.randint(lo, hi, (1,), generator=generator))
    return list(range(start, start + cfg.sde_window_size))


@torch.no_grad()
def rollout(
    policy: Policy,
    prompts: Sequence[str],
    global_prompt_ids: Sequence[int],
    cfg: SampleConfig,
    *,
    seed: int,
    iteration: int,
    keep_velocities: bool = False,
    policy_version: int = 0,
    autocast: Callable[[], object] = contextlib.nullcontext,
    on_images: Callable[[torch.Tensor], None] | None = None,
) -> Trajectory:
    """Sample G = ``cfg.group_size`` images for each local prompt; ``autocast`` wraps every policy call (the
    trainer's mixed precision, the same as the update's). ``on_images`` gets each micro-batch's decoded images
    (b, 3, H, W) on the CPU as soon as they are sampled, in batch order (the trainer scores them beside the sampling
    of the next ones: rewards/weighted.py)."""
    g_size = cfg.group_size
    p = len(prompts)
    embeds = policy.encode_prompts(list(prompts))
    prompt_index, group_ids = image_layout(global_prompt_ids, g_size)
    train_steps = choose_train_steps(cfg, torch.Generator().manual_seed(derive_seed(seed, iteration, -1)), iteration)
    levels = [cfg.noise_level if j in train_steps else 0.0 for j in range(cfg.num_steps)]
    image_ids = [int(gid) * g_size + k for gid in global_prompt_ids for k in range(g_size)]
    gens = seeded_generators([derive_seed(seed, iteration, i) for i in image_ids])
    if cfg.shared_noise:  # the G images of a prompt share z_0 and differ by the SDE noise only (DanceGRPO)
        noise = torch.cat([policy.initial_noise(1, gens[k * g_size]).expand(g_size, *policy.latent_shape())
                           for k in range(p)])
    else:
        noise = torch.cat([policy.initial_noise(1, g) for g in gens])
    keep = train_steps if keep_velocities else []
    parts, images = [], []
    for i in range(0, len(image_ids), cfg.batch_size):
        sl = slice(i, i + cfg.batch_size)
        parts.append(
            denoise(policy, noise[sl], embeds[prompt_index[sl]], cfg.num_steps, noise_level=levels,
                    sde_kind=cfg.sde_kind, generators=gens[sl], keep_velocities=keep, autocast=autocast)
        )
        images.append(policy.decode(parts[-1].latents[:, -1]).cpu())  # decoded as sampled, with or without on_images
        if on_images is not None:
            on_images(images[-1])
    latents = torch.cat([d.latents for d in parts])
    sched = policy.schedule(cfg.num_steps)
    return Trajectory(
        prompts=list(prompts),
        embeds=embeds,
        prompt_index=prompt_index,
        group_ids=group_ids,
        latents=latents,
        log_probs=torch.cat([d.log_probs for d in parts]),
        sigmas=sched.sigmas,
        timesteps=sched.timesteps,
        train_steps=train_steps,
        images=torch.cat(images),
        velocities={j: torch.cat([d.velocities[j] for d in parts]) for j in keep},
        policy_version=policy_version,
    )
