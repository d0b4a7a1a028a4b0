"""One SDE step of a rectified-flow sampler that both samples and scores (as in Flow-GRPO / DanceGRPO).

One function does both so that the rollout and the update cannot drift apart (the idea of DDPO's
``ddim_step_with_logprob``): with ``prev_sample=None`` it draws ``z' = μ + std·ε``; given a stored ``prev_sample`` it
re-scores it under the current velocity. Everything is computed in float32 or wider; the log-density is averaged over
all non-batch dimensions, as both reference implementations do.

Conventions (docs/architecture.md#conventions): ``z`` at noise level ``σ``, velocity ``v = ε − x₀``, ``dt = σ_next − σ < 0``.

- ``kind="flow_grpo"``: ``s = a·sqrt(σ / (1 − σ))`` with ``a = noise_level`` (at ``σ = 1`` the denominator uses the
  next sigma, which is the schedule's second sigma at step 0, as Flow-GRPO's ``sigma_max = sigmas[1]``),
  ``μ = z·(1 + s²·dt/(2σ)) + v·(1 + s²(1 − σ)/(2σ))·dt``, ``std = s·sqrt(−dt)``.
- ``kind="dance_grpo"``: ``std = η·sqrt(σ − σ_next)`` with ``η = noise_level``,
  ``μ = z + dt·v − ½η²·score·dt`` with ``score = −(z − (1 − σ)(z − σv)) / σ²``.
- ``kind="cps"``: coefficients-preserving sampling (CPS, arXiv:2509.05952), ``η = noise_level`` in [0, 1]:
  ``x̂₀ = z − σv``, ``x̂₁ = z + (1 − σ)v``, ``std = σ_next·sin(ηπ/2)``,
  ``μ = (1 − σ_next)·x̂₀ + sqrt(σ_next² − std²)·x̂₁`` (``= σ_next·cos(ηπ/2)·x̂₁``, computed so); the next latent keeps
  the flow's coefficients: ``(1 − σ_next)`` on the clean sample, ``σ_next`` in total on noise.
- ``noise_level = 0`` is the deterministic Euler (ODE) step ``z' = z + v·dt`` (CPS at η = 0 is the same step); it
  has no density, so ``log_prob`` is returned as zeros and ``std`` as zeros. So is any sample whose step has zero
  noise: CPS's last step (``σ_next = 0``, where ``z'`` is the predicted clean sample): log-prob 0, PPO ratio 1.

The log-probability is the true Gaussian log-density for every kind, CPS included. CPS's authors drop every
constant of theirs, the ``1/(2·std²)`` factor too (``−‖z' − μ‖²`` averaged). ``std`` does not depend on θ, so in the
ratio of the current to the rollout's density at one step ``−log std − ½·log 2π`` cancels; ``1/(2·std²)`` does
not: it scales the log-ratio, so their ratio is ours raised to the power ``2·std²`` — a different trust region per
step (PPO's clip acts on ``2·std²``·log-ratio), with step weights in the gradient rescaled by ``2·std²``, and the KL
of the loss and of ``train/kl_ref`` no longer a KL. Keeping the density makes the ratio, ``approx_kl``, the KL and
the clip range mean the same thing whatever the SDE, and the first ratio is exactly 1 as for the other kinds.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

__all__ = ["SdeStep", "randn", "sde_step_with_logprob", "SDE_KINDS"]

SDE_KINDS = ("flow_grpo", "dance_grpo", "cps")
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


class SdeStep(NamedTuple):
    prev_sample: torch.Tensor  # (B, ...) the next latent z_{j+1}, sampled or the given one
    log_prob: torch.Tensor  # (B,) log N(prev_sample; mean, std²) averaged over non-batch dims
    mean: torch.Tensor  # (B, ...) μ, differentiable in v
    std: torch.Tensor  # (B, 1, ...) broadcastable standard deviation of the step


def randn(
    shape: Sequence[int],
    generator: torch.Generator | Sequence[torch.Generator] | None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Standard normal noise drawn on the generator's device, then moved; a list draws sample i from generator i."""
    if generator is None or isinstance(generator, torch.Generator):
        src = generator.device if generator is not None else device
        return torch.randn(tuple(shape), generator=generator, dtype=dtype, device=src).to(device)
    if len(generator) != shape[0]:
        raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}.")
    return torch.cat([randn((1, *shape[1:]), g, dtype=dtype, device=device) for g in generator])


def _per_sample(x: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scalar or per-sample (B,) value as a (B, 1, ..., 1) tensor broadcastable against ``like``."""
    x = torch.as_tensor(x, dtype=like.dtype, device=like.device)
    if x.ndim == 0:
        x = x.expand(like.shape[0])
    if x.ndim != 1 or x.shape[0] != like.shape[0]:
        raise ValueError(f"sigma must be a float or a ({like.shape[0]},) tensor, got shape {tuple(x.shape)}.")
    return x.view(-1, *([1] * (like.ndim - 1)))


def sde_step_with_logprob(
    z: torch.Tensor,
    v: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    noise_level: float,
    kind: str = "flow_grpo",
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> SdeStep:
    """Sample (``prev_sample=None``) or re-score one SDE step from ``z`` at ``sigma`` to ``sigma_next``.

    Args:
        z: (B, ...) current latent; treated as a fixed sample (no gradient flows into it by design).
        v: (B, ...) velocity ``v_θ(z, t)``; gradients of ``log_prob`` and ``mean`` flow into it.
        sigma, sigma_next: floats or (B,) tensors with ``0 ≤ sigma_next < sigma ≤ 1``.
        noise_level: Flow-GRPO's ``a``, DanceGRPO's ``η`` or CPS's ``η`` (at most 1); 0 gives the ODE step.
        kind: ``"flow_grpo"``, ``"dance_grpo"`` or ``"cps"``.
        prev_sample: (B, ...) a stored next latent to score instead of sampling.
        generator: RNG for the sampled noise, or one generator per sample (as diffusers' ``randn_tensor``), which
            makes each sample's noise independent of how samples are batched or split over processes.
    """
    if kind not in SDE_KINDS:
        raise ValueError(f"kind must be one of {SDE_KINDS}, got {kind!r}.")
    if noise_level < 0:
        raise ValueError(f"noise_level must be non-negative, got {noise_level}.")
    if kind == "cps" and noise_level > 1:
        raise ValueError(f"noise_level of the cps SDE must be in [0, 1] (std = sigma_next·sin(noise_level·π/2)), "
                         f"got {noise_level}.")
    if z.shape != v.shape:
        raise ValueError(f"z and v must have the same shape, got {tuple(z.shape)} and {tuple(v.shape)}.")
    # Upcast to avoid precision issues: the log-density of a near-deterministic step is a small difference of
    # large numbers; bf16 velocities are common on GPUs.
    dtype = torch.promote_types(torch.promote_types(z.dtype, v.dtype), torch.float32)
    z_ = z.detach().to(dtype)
    v_ = v.to(dtype)
    sig = _per_sample(sigma, z_)
    sig_next = _per_sample(sigma_next, z_)
    dt = sig_next - sig  # (B, 1, ...) negative

    if noise_level == 0:
        mean = z_ + v_ * dt
        std = torch.zeros_like(sig)
        sample = mean.detach() if prev_sample is None else prev_sample.to(dtype)
        return SdeStep(sample, torch.zeros(z.shape[0], dtype=dtype, device=z.device), mean, std)

    if kind == "flow_grpo":
        denom = 1.0 - torch.where(sig == 1.0, sig_next, sig)
        s = noise_level * torch.sqrt(sig / denom)  # diffusion coefficient
        mean = z_ * (1.0 + s**2 * dt / (2.0 * sig)) + v_ * (1.0 + s**2 * (1.0 - sig) / (2.0 * sig)) * dt
        std = s * torch.sqrt(-dt)
    elif kind == "dance_grpo":
        x0 = z_ - sig * v_  # predicted clean sample
        score = -(z_ - (1.0 - sig) * x0) / sig**2
        mean = z_ + dt * v_ - 0.5 * noise_level**2 * score * dt
        std = noise_level * torch.sqrt(-dt)
    else:  # cps
        x0 = z_ - sig * v_  # predicted clean sample x̂₀
        x1 = z_ + (1.0 - sig) * v_  # predicted noise x̂₁
        angle = noise_level * math.pi / 2
        std = sig_next * math.sin(angle)
        mean = x0 * (1.0 - sig_next) + x1 * (sig_next * math.cos(angle))

    if prev_sample is None:
        noise = randn(z_.shape, generator, dtype=dtype, device=z.device)
        sample = mean.detach() + std * noise
    else:
        if prev_sample.shape != z.shape:
            raise ValueError(f"prev_sample must have shape {tuple(z.shape)}, got {tuple(prev_sample.shape)}.")
        sample = prev_sample.detach().to(dtype)

    # A sample whose step has no noise (CPS at sigma_next = 0) has no density: log-prob 0, as the ODE step's.
    noiseless = std == 0
    safe = torch.where(noiseless, torch.ones_like(std), std)
    log_prob = -((sample - mean) ** 2) / (2.0 * safe**2) - torch.log(safe) - _LOG_SQRT_2PI
    log_prob = torch.where(noiseless, torch.zeros_like(log_prob), log_prob)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))  # (B,)
    return SdeStep(sample, log_prob, mean, std)
