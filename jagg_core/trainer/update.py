"""The update stage: the method's backward over stored experience, then one optimizer step (per chunk).

``plan_groups`` cuts the trained steps into groups of W and routes them (a mode of ``jagg_core.modes.MODES``); for
each micro-batch of images, :func:`jagg_core.group_backward` accumulates each group's gradient. Per-step losses are
scaled so that the accumulated gradient is that of ``mean_images mean_steps L_j`` over the chunk, whatever the method,
micro-batching or number of processes. The trainer differs between methods only in the ``mode`` handed to
``group_backward``. What every update of a run shares (the policy, the method, the sample and train sections, the
gradient sync, the autocast) is one :class:`UpdateContext`, built once per run.
"""

from __future__ import annotations

import contextlib
import time

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..setup.config import ResolvedMethod, SampleConfig, TrainConfig
from ..fidelity import FidelityReport, gradient_fidelity
from ..jagg import Estimator, Group, run_group
from ..loss import kernel_kl, ppo_step_loss
from ..policies.base import Policy
from ..sde import sde_step_with_logprob
from .distributed import GradSync, NoSync
from .rollout import Trajectory

__all__ = ["ImageSteps", "UpdateContext", "UpdateStats", "accumulate_gradients", "method_estimator",
           "trajectory_fidelity"]


def _clock(like: torch.Tensor) -> float:
    if like.is_cuda:  # kernels are asynchronous: wait for them so the time is the reference forward's own
        torch.cuda.synchronize(like.device)
    return time.perf_counter()


@dataclass(frozen=True)
class UpdateContext:
    """What every update of one run shares; the trainer builds it once per run, the benchmark once per timed update.

    ``method`` gives the mode, the window, the anchors and the variant (:func:`trajectory_fidelity` reads its window,
    anchors and variant too); ``sync`` is only used by :func:`accumulate_gradients` (the last group of an optimizer
    step's chunk starts the gradient sync); ``autocast`` wraps every policy forward.
    """

    policy: Policy
    method: ResolvedMethod
    sample: SampleConfig
    train: TrainConfig
    sync: GradSync = field(default_factory=NoSync)
    autocast: Callable[[], object] = contextlib.nullcontext


@dataclass
class UpdateStats:
    loss: float = 0.0
    grad_forwards: int = 0
    nograd_forwards: int = 0
    reused_velocities: int = 0
    forward_calls: int = 0
    backward_calls: int = 0
    backward_seconds: float = 0.0
    kl_ref_seconds: float = 0.0  # the reference forwards of train/kl_ref alone (not part of any method's update)
    extras: dict[str, list[float]] = field(default_factory=dict)

    def add(self, other) -> None:
        """Add another UpdateStats or a GroupStats."""
        for k in ("loss", "grad_forwards", "nograd_forwards", "reused_velocities", "forward_calls", "backward_calls",
                  "backward_seconds"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.kl_ref_seconds += getattr(other, "kl_ref_seconds", 0.0)
        for k, v in other.extras.items():
            self.extras.setdefault(k, []).extend(v if isinstance(v, list) else [v])


class ImageSteps:
    """One group of stored steps over one set of image rows: the object :func:`jagg_core.run_group` backpropagates.

    ``velocity(j)`` runs the policy on stored step j of the group; ``velocity_batch([j, ...])`` runs several in one
    call; ``step_loss(j, v)`` is the scaled PPO loss L_j (and its diagnostics); ``middle_velocity(j)`` is the
    rollout's own v_j when ``reuse`` is on and it was kept (None otherwise: a no-grad forward); ``before_backward``
    is the gradient sync's.

    ``kl_ref``: also report ``kl_ref``, KL(policy ‖ reference) of the group's two endpoint steps (the steps whose
    graphs JAGG keeps, the same steps whatever the method; the β term's KL, :func:`kernel_kl`), under no_grad from one
    reference forward on the step's stored inputs (none more when β > 0: then every step's β-term KL is reported);
    at β = 0 that forward's seconds add up in ``kl_ref_seconds`` (the trainer keeps them out of the update's time,
    which the methods' speed comparison reads).
    """

    def __init__(self, ctx: UpdateContext, traj: Trajectory, images: torch.Tensor, advantages: torch.Tensor,
                 steps: Sequence[int], *, scale: float, kl_ref: bool = False, reuse: bool = False):
        self.ctx, self.traj, self.images, self.steps = ctx, traj, images, steps
        self.scale, self.kl_ref, self.reuse = scale, kl_ref, reuse
        self.embeds = traj.image_embeds(images)
        self.n = len(images)
        self.device = ctx.policy.device
        self.latents = traj.latents[images]  # (n, T + 1, *latent)
        self.advantages = advantages[images].to(self.device)
        self.before_backward = ctx.sync.before_backward
        self.kl_ref_seconds = 0.0  # seconds of train/kl_ref's reference forwards (β = 0) so far

    def _inputs(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.steps[j]
        return (self.latents[:, step].to(self.device),
                self.traj.timesteps[step].to(self.device, torch.float32).expand(self.n))

    def velocity(self, j: int) -> torch.Tensor:
        z, t = self._inputs(j)
        with self.ctx.autocast():
            return self.ctx.policy.velocity(z, t, self.embeds)

    def velocity_batch(self, js: Sequence[int]) -> list[torch.Tensor]:
        zs, ts = zip(*(self._inputs(j) for j in js))
        with self.ctx.autocast():
            v = self.ctx.policy.velocity(torch.cat(zs), torch.cat(ts), type(self.embeds).cat([self.embeds] * len(js)))
        return list(v.split(self.n))

    def velocity_rows(self, rows: torch.Tensor, js: torch.Tensor) -> torch.Tensor:
        """v of the images ``rows`` (indices into this object's images), each at its own group step ``js[i]``: the
        random anchor's per-image forward (``jagg.random_anchor: image``)."""
        steps = torch.as_tensor(self.steps, dtype=torch.int64)[js]
        z = self.latents[rows, steps].to(self.device)
        t = self.traj.timesteps[steps].to(self.device, torch.float32)
        with self.ctx.autocast():
            return self.ctx.policy.velocity(z, t, self.embeds[rows])

    def middle_velocity(self, j: int) -> torch.Tensor | None:
        v = self.traj.velocities.get(self.steps[j]) if self.reuse else None
        return None if v is None else v[self.images].to(self.device)

    def _sde_step(self, j: int, v: torch.Tensor):
        step, traj, sample = self.steps[j], self.traj, self.ctx.sample
        return sde_step_with_logprob(self.latents[:, step].to(self.device), v, float(traj.sigmas[step]),
                                     float(traj.sigmas[step + 1]), noise_level=sample.noise_level,
                                     kind=sample.sde_kind, prev_sample=self.latents[:, step + 1].to(self.device))

    def _dt(self, j: int) -> float:
        """dt = σ_next − σ of stored step j (Flow-GRPO's KL convention divides by std²/(−dt))."""
        step = self.steps[j]
        return float(self.traj.sigmas[step + 1]) - float(self.traj.sigmas[step])

    def _reference_mean(self, j: int) -> torch.Tensor:
        """The SDE step's mean under the reference policy (no_grad); at β = 0 its seconds go to kl_ref_seconds."""
        z = self.latents[:, self.steps[j]].to(self.device)
        t0 = _clock(z)
        with torch.no_grad(), self.ctx.policy.reference():
            zz, t = self._inputs(j)
            with self.ctx.autocast():
                v_ref = self.ctx.policy.velocity(zz, t, self.embeds)
            mean = self._sde_step(j, v_ref).mean
        if self.ctx.train.beta == 0:
            self.kl_ref_seconds += _clock(z) - t0
        return mean

    def step_loss(self, j: int, v: torch.Tensor) -> tuple[torch.Tensor, dict]:
        train = self.ctx.train
        res = self._sde_step(j, v)
        kl_here = self.kl_ref and (train.beta > 0 or j in (0, len(self.steps) - 1))
        ref_mean = self._reference_mean(j) if train.beta > 0 or kl_here else None
        kl = {"convention": train.kl_convention, "dt": self._dt(j)}
        out = ppo_step_loss(res.log_prob, self.traj.log_probs[self.images, self.steps[j]].to(self.device),
                            self.advantages, clip_range=train.clip_range, mean=res.mean, ref_mean=ref_mean,
                            std=res.std, beta=train.beta, kl_convention=kl["convention"], dt=kl["dt"])
        extras = {"policy_loss": out.policy_loss, "kl": out.kl, "approx_kl": out.approx_kl, "clipfrac": out.clipfrac}
        if kl_here:
            extras["kl_ref"] = out.kl if train.beta > 0 else kernel_kl(res.mean.detach(), ref_mean, res.std, **kl)
        return out.loss * self.scale, extras


def accumulate_gradients(
    ctx: UpdateContext,
    traj: Trajectory,
    advantages: torch.Tensor,
    rows: torch.Tensor,
    groups: Sequence[Group],
    *,
    reuse: bool,
    measure_kl_ref: bool = True,
    generator: torch.Generator | None = None,
    draw: int | None = None,
) -> UpdateStats:
    """Backward of every group over this process's image ``rows`` (one optimizer step's chunk), in micro-batches.

    With ``train.kl_ref``, ``measure_kl_ref`` (the trainer's cadence, ``train.kl_ref_every``; at β > 0 the loss's KL
    is reported whatever it says) and a reference at hand (LoRA, or the copy :meth:`Policy.keep_reference` froze)
    each group's endpoint steps also report ``kl_ref`` (:class:`ImageSteps`); the seconds of its reference forwards
    (β = 0) are the returned ``kl_ref_seconds``.

    Each step loss is scaled by ``len(mb) / len(rows) / n_steps``: the accumulated gradient is that of the mean over
    the rows and the trained steps; the gradient sync then averages processes (which hold equally many rows).

    ``generator`` draws the method's random anchors (``jagg.random_anchor``), group after group in order; ``draw``
    fixes every group's drawn step instead (the fidelity study, which enumerates them).
    """
    method, train, sync = ctx.method, ctx.train, ctx.sync
    stats = UpdateStats()
    n_steps = sum(len(g.steps) for g in groups)
    local = len(rows)
    kl_ref = train.kl_ref and (measure_kl_ref or train.beta > 0) and ctx.policy.has_reference()
    kl_seconds = 0.0
    micro = [rows[i : i + train.micro_batch] for i in range(0, local, train.micro_batch)]
    estimator = method_estimator(method)
    for m, mb in enumerate(micro):
        for k, g in enumerate(groups):
            sync.final_group = m == len(micro) - 1 and k == len(groups) - 1
            steps = ImageSteps(ctx, traj, mb, advantages, g.steps, scale=len(mb) / local / n_steps, kl_ref=kl_ref,
                               reuse=reuse)
            stats.add(run_group(steps, traj.timesteps[list(g.steps)], g.mode, method.variant, estimator=estimator,
                                generator=generator, draw=draw if method.random_anchor is not None else None))
            kl_seconds += steps.kl_ref_seconds
    stats.kl_ref_seconds = kl_seconds
    return stats


def method_estimator(method: ResolvedMethod) -> Estimator:
    """The :class:`jagg_core.Estimator` of ``method``: its anchors, their placement and its random anchor."""
    return Estimator(anchors=method.anchors, anchor_at=method.anchor_at, random_anchor=method.random_anchor,
                     random_anchor_p=method.random_anchor_p, random_anchor_weight=method.random_anchor_weight)


def trajectory_fidelity(ctx: UpdateContext, traj: Trajectory, advantages: torch.Tensor,
                        rows: torch.Tensor) -> FidelityReport:
    """cos(JAGG, exact) and cos(ablate, exact) per group position on the image ``rows`` of a stored rollout.

    The groups are ``ctx.method``'s (its window, anchors and variant). Each step's loss at its own scale; the
    parameters' gradients are left as they were. Shared by the trainer's fidelity monitor and the benchmark.
    """
    steps = traj.train_steps
    method = ctx.method

    def fns(i: int) -> ImageSteps:
        return ImageSteps(ctx, traj, rows, advantages, [steps[i]], scale=1.0)

    return gradient_fidelity(ctx.policy.trainable_parameters(), lambda i: fns(i).velocity(0),
                             lambda i, v: fns(i).step_loss(0, v), traj.timesteps[steps], method.window,
                             anchors=method.anchors, variant=method.variant)
