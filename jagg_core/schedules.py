"""Sigma schedules and network timesteps of rectified-flow samplers, with the SD3 / Flux shifts.

Reproduces diffusers' `FlowMatchEulerDiscreteScheduler.set_timesteps` for the two ways pipelines call it, so every
backbone shares one schedule implementation that tests compare against diffusers itself:

- ``spacing="flux"``: the pipeline passes ``sigmas = linspace(1, 1/N, N)`` (FluxPipeline, QwenImagePipeline).
- ``spacing="sd3"``: the scheduler's own ``linspace(sigma_max, sigma_min, N)`` in timestep units (StableDiffusion3).

Then either a static shift ``s·σ / (1 + (s − 1)·σ)`` (SD3: ``shift=3.0``) or the resolution-dependent exponential
shift ``e^μ / (e^μ + (1/σ − 1))`` (Flux, Qwen-Image: ``mu`` from :func:`resolution_mu`). A terminal ``σ = 0`` is
appended. Network timesteps are ``σ · num_train_timesteps``, as diffusers feeds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Schedule", "fixed_shift_schedule", "flow_match_schedule", "resolution_mu", "shift_sigmas"]


@dataclass(frozen=True)
class Schedule:
    """A sampling schedule of ``T`` steps."""

    sigmas: torch.Tensor  # (T + 1,) float64, from 1 (pure noise) down to 0
    timesteps: torch.Tensor  # (T,) float64, network timesteps = sigmas[:-1] * num_train_timesteps

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])


def shift_sigmas(sigmas: torch.Tensor, *, shift: float = 1.0, mu: float | None = None) -> torch.Tensor:
    """Static (``shift``) or exponential resolution-dependent (``mu``) time shift of sigmas in (0, 1]."""
    if mu is not None:
        return math.exp(mu) / (math.exp(mu) + (1.0 / sigmas - 1.0))
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def resolution_mu(
    image_seq_len: int,
    *,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """Flux's ``calculate_shift``: μ linear in the number of image tokens."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + base_shift - m * base_seq_len


def flow_match_schedule(
    num_steps: int,
    *,
    shift: float = 1.0,
    mu: float | None = None,
    spacing: str = "flux",
    num_train_timesteps: int = 1000,
) -> Schedule:
    """The ``T = num_steps`` sigmas (plus the terminal 0) and network timesteps of a flow-matching sampler."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be at least 1, got {num_steps}.")
    if mu is None and shift <= 0:
        raise ValueError(f"shift must be positive, got {shift}.")
    n = num_steps
    if spacing == "flux":
        base = torch.linspace(1.0, 1.0 / n, n, dtype=torch.float64)
    elif spacing == "sd3":
        # The scheduler's sigma_min is the last of its 1000 training sigmas, already shifted once at init
        # (dynamic-shifting schedulers skip that first shift).
        sigma_min = torch.tensor(1.0 / num_train_timesteps, dtype=torch.float64)
        if mu is None:
            sigma_min = shift_sigmas(sigma_min, shift=shift)
        base = torch.linspace(1.0, float(sigma_min), n, dtype=torch.float64)
    else:
        raise ValueError(f"spacing must be 'flux' or 'sd3', got {spacing!r}.")
    sigmas = shift_sigmas(base, shift=shift, mu=mu)
    # diffusers computes in float32; round there so schedules match it bit for bit, then carry float64.
    sigmas = sigmas.to(torch.float32).to(torch.float64)
    timesteps = sigmas * num_train_timesteps
    return Schedule(sigmas=torch.cat([sigmas, sigmas.new_zeros(1)]), timesteps=timesteps)


def fixed_shift_schedule(num_steps: int, shift: float, *, num_train_timesteps: int = 1000) -> Schedule:
    """DanceGRPO's training schedule: ``T + 1`` equally spaced sigmas from 1 to 0, statically shifted by ``shift``
    (``s·σ / (1 + (s − 1)·σ)``), whatever the resolution (the recipe fixes it instead of Flux's dynamic shift)."""
    if num_steps < 1 or shift <= 0:
        raise ValueError(f"a fixed-shift schedule needs num_steps ≥ 1 and shift > 0, got {num_steps} and {shift}.")
    sigmas = shift_sigmas(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64), shift=shift)
    return Schedule(sigmas=sigmas, timesteps=sigmas[:-1] * num_train_timesteps)
