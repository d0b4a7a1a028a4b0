"""Small float64 velocity models and trajectories for the algorithm tests.

``AffineVelocity`` is affine in (z, t) but nonlinear in θ — the premise of Theorem 1. ``NonlinearVelocity`` is not
affine in z, so Theorem 1 must fail on it.
"""

from __future__ import annotations

import torch

from jagg_core import ppo_step_loss, sde_step_with_logprob

D = 6  # latent size per sample


class AffineVelocity(torch.nn.Module):
    """v_θ(z, t) = tanh(W1) W2 z + sin(b) t + c²: affine in (z, t), nonlinear in θ."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(D, D, generator=g, dtype=torch.float64) * 0.7)
        self.w2 = torch.nn.Parameter(torch.randn(D, D, generator=g, dtype=torch.float64) * 0.7)
        self.b = torch.nn.Parameter(torch.randn(D, generator=g, dtype=torch.float64))
        self.c = torch.nn.Parameter(torch.randn(D, generator=g, dtype=torch.float64))

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # z: (B, D), t: (B,)
        a = torch.tanh(self.w1) @ self.w2
        return z @ a.T + t[:, None] * torch.sin(self.b) + self.c**2


class NonlinearVelocity(AffineVelocity):
    """v_θ(z, t) = tanh(W1) W2 tanh(z) + sin(b) t + c²: nonlinear in z."""

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.w1) @ self.w2
        return torch.tanh(2.0 * z) @ a.T + t[:, None] * torch.sin(self.b) + self.c**2


def segment_group(t: list[float], batch: int = 5, seed: int = 1, off_segment: float = 0.0):
    """Inputs (z_j, t_j) on the segment between the endpoints with parameter α_j = (t_0 − t_j)/(t_0 − t_{W−1}).

    ``off_segment > 0`` pushes the middle latents off the segment by that much.
    """
    g = torch.Generator().manual_seed(seed)
    t = torch.tensor(t, dtype=torch.float64)
    alpha = (t[0] - t) / (t[0] - t[-1])
    z0 = torch.randn(batch, D, generator=g, dtype=torch.float64)
    z1 = torch.randn(batch, D, generator=g, dtype=torch.float64)
    zs = [(1 - a) * z0 + a * z1 for a in alpha]
    for j in range(1, len(zs) - 1):
        zs[j] = zs[j] + off_segment * torch.randn(batch, D, generator=g, dtype=torch.float64)
    return t, zs


def ppo_problem(model, t, zs, *, clip_range=0.2, seed=2, noise_level=0.8, kind="flow_grpo", policy_shift=0.05):
    """Stored next latents and old log-probs from a slightly different policy; returns (velocity, step_loss).

    Sigmas are t/1000 (network timesteps in diffusers units); the losses are real SDE + PPO-clip losses, nonlinear in v.
    """
    g = torch.Generator().manual_seed(seed)
    batch = zs[0].shape[0]
    sig = t / 1000.0
    sig_next = torch.cat([sig[1:], (sig[-1] * 0.5).reshape(1)])
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    stored = []
    with torch.no_grad():
        for j, z in enumerate(zs):
            v_old = model(z, t[j].expand(batch)) + policy_shift * torch.randn(z.shape, generator=g, dtype=z.dtype)
            step = sde_step_with_logprob(z, v_old, float(sig[j]), float(sig_next[j]), noise_level=noise_level,
                                         kind=kind, generator=g)
            stored.append((step.prev_sample, step.log_prob))

    def velocity(j: int) -> torch.Tensor:
        return model(zs[j], t[j].expand(batch))

    def step_loss(j: int, v: torch.Tensor) -> torch.Tensor:
        nxt, old_lp = stored[j]
        step = sde_step_with_logprob(zs[j], v, float(sig[j]), float(sig_next[j]), noise_level=noise_level, kind=kind,
                                     prev_sample=nxt)
        out = ppo_step_loss(step.log_prob, old_lp, adv, clip_range=clip_range)
        return out.loss / len(zs), {"clipfrac": out.clipfrac, "approx_kl": out.approx_kl}

    return velocity, step_loss


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


class PiecewiseAffineVelocity(AffineVelocity):
    """v_θ(z, t) = tanh(W1) W2 z + sin(b) t + c² + cos(d)·relu(t_knot − t): affine in (z, t) on each side of t_knot."""

    def __init__(self, t_knot: float, seed: int = 0):
        super().__init__(seed)
        self.t_knot = t_knot
        g = torch.Generator().manual_seed(seed + 100)
        self.d = torch.nn.Parameter(torch.randn(D, generator=g, dtype=torch.float64))

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        kink = torch.relu(self.t_knot - t)[:, None] * torch.cos(self.d) / 100.0
        return super().forward(z, t) + kink


def piecewise_segment_group(t: list[float], anchors: tuple[int, ...], batch: int = 5, seed: int = 1):
    """Inputs on the polyline through random knots at the anchors, parameterised by the t-weighted α of each piece."""
    g = torch.Generator().manual_seed(seed)
    t = torch.tensor(t, dtype=torch.float64)
    knots = {a: torch.randn(batch, D, generator=g, dtype=torch.float64) for a in anchors}
    zs = []
    for j in range(len(t)):
        a, b = next((a, b) for a, b in zip(anchors, anchors[1:]) if a <= j <= b)
        al = (t[a] - t[j]) / (t[a] - t[b])
        zs.append((1 - al) * knots[a] + al * knots[b])
    return t, zs
