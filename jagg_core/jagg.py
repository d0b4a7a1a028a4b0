"""JAGG: Jacobian-Aggregated Group Gradients (arXiv:2607.17572, §Method; map of the code: docs/architecture.md).

For a group of W consecutive denoising steps, the exact GRPO gradient is ``Σ_j J_jᵀ s_j`` with
``J_j = ∂v_θ(z_j, t_j)/∂θ`` and upstream signals ``s_j = ∂L_j/∂v_j``. JAGG interpolates the Jacobians linearly in the
network timestep between the group's endpoints (Eq. 6), ``J_j ≈ (1 − α_j) J_0 + α_j J_{W−1}`` with
``α_j = (t_0 − t_j)/(t_0 − t_{W−1})``, so the whole group needs only two transformer backwards (Eq. 7):
``∇θ ≈ J_0ᵀ s_base + J_{W−1}ᵀ s_corr``, ``s_base = Σ_j (1 − α_j) s_j``, ``s_corr = Σ_j α_j s_j``.

Generalised here to K anchors (K = 2 is the paper's JAGG, K = W is exact): each step's Jacobian is interpolated
between its two neighbouring anchors with the same t-weighted rule, and the signals are aggregated per anchor; the
anchors are spread evenly or placed where the caller says (``anchor_at``).

The random anchor (``random_anchor``, docs/frontier.md) makes the estimator unbiased at the cost of one more graph:
a non-anchor step r is drawn with probability p_r and the interpolation's error at r is corrected, scaled by 1/p_r:
``g_r = JAGG + (1/p_r)(J_rᵀ s_r − Σ_k M[r, k] J_{a_k}ᵀ s_r)``, so ``E_r[g_r] = Σ_j J_jᵀ s_j``, the exact gradient.
The backward is linear in its cotangent, so it is still ONE joint backward: r's output gets ``s_r / p_r`` and each
anchor's cotangent loses ``M[r, k] s_r / p_r``. ``"group"`` draws one r for the whole group; ``"image"`` draws one r
per image (row), stratified over the rows, so one backward averages many draws (the probe forward then takes each row
at its own step: ``velocity_rows``).

Modes (the registry :data:`jagg_core.modes.BACKWARD_MODES`): ``exact`` (W with-grad forwards, W backwards),
``exact_batched`` (the same gradient, all W steps in one with-grad forward call and one backward), ``jagg`` and
``ablate`` (anchors with grad, middle steps under ``no_grad``; ablate keeps only the anchors' own signals and discards
the middle ones). ``ablate_matched`` is the
weight-matched reading of the ablation: each of the K anchors keeps its own signal scaled by W/K, so an ablated group
weighs as much as an exact group beside it (``ablate``'s gradient is about K/W of the exact one's). Variants: ``joint`` (one
``torch.autograd.backward`` over all anchors: one FSDP all-gather per module) and ``sequential`` (one anchor graph
alive at a time, for memory).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

import torch

from .modes import EXACT_MODES, MODES, RANDOM_ANCHOR, VARIANTS, anchor_positions, placed_anchors

__all__ = [
    "AUTO_FALLBACK_JAGG_FRAC",
    "EXACT_MODES",
    "MODES",
    "VARIANTS",
    "Estimator",
    "Group",
    "GroupStats",
    "GroupSteps",
    "RANDOM_ANCHOR",
    "SUBSETS",
    "Surrogate",
    "anchor_positions",
    "anchor_weights",
    "draw_random_anchor",
    "random_anchor_probabilities",
    "resolve_anchors",
    "interpolation_weights",
    "aggregate_upstream",
    "plan_groups",
    "group_backward",
    "group_surrogate",
    "group_timesteps",
    "inner_product",
    "run_group",
]


Velocity = Callable[[int], torch.Tensor]
StepLoss = Callable[[int, torch.Tensor], "torch.Tensor | tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]"]
MiddleVelocity = Callable[[int], "torch.Tensor | None"]  # j -> the rollout's v_j, or None (a no-grad forward)
VelocityBatch = Callable[[Sequence[int]], Sequence[torch.Tensor]]  # [j, ...] -> [v_j, ...] in one policy call
VelocityRows = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows, js) -> each row at its own step


def group_timesteps(t: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """(W,) float64 network timesteps of a group, from the (W,) of one trajectory or the (B, W) that Flow-GRPO and
    DanceGRPO store (``sample["timesteps"][:, steps]``: every image of a batch at the same steps, so the rows must
    agree; per-image timesteps cannot share one interpolation)."""
    t = torch.as_tensor(t, dtype=torch.float64).detach().cpu()
    if t.ndim == 2:
        if t.shape[0] == 0 or not bool((t == t[:1]).all()):
            raise ValueError(f"(B, W) group timesteps must be the same in every row (one trajectory's steps), got "
                             f"{t.shape[0]} rows that differ; pass one row, or one group per set of timesteps.")
        t = t[0]
    if t.ndim > 2:
        raise ValueError(f"group timesteps must be (W,) or (B, W), got shape {tuple(t.shape)}.")
    return t.flatten()


def _as_timesteps(t: torch.Tensor | Sequence[float]) -> torch.Tensor:
    t = group_timesteps(t)
    if t.numel() < 2:
        raise ValueError(f"a group needs at least 2 timesteps, got {t.numel()}.")
    d = t[1:] - t[:-1]
    if not (bool((d < 0).all()) or bool((d > 0).all())):
        raise ValueError(f"group timesteps must be strictly monotone, got {t.tolist()}.")
    return t


def interpolation_weights(t: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """α_j = (t_0 − t_j) / (t_0 − t_{W−1}) (Eq. 6): 0 at the first step, 1 at the last, t-weighted in between.

    Args:
        t: (W,) network timesteps of the group, strictly monotone (denoising order).
    Returns:
        (W,) float64.
    """
    t = _as_timesteps(t)
    return (t[0] - t) / (t[0] - t[-1])


def anchor_weights(t: torch.Tensor | Sequence[float], anchors: Sequence[int] | None = None) -> torch.Tensor:
    """The (W, K) matrix M with ``s_anchor_k = Σ_j M[j, k] s_j``.

    Step j between anchors a_k ≤ j ≤ a_{k+1} gets ``1 − α`` on a_k and ``α`` on a_{k+1} with
    ``α = (t_{a_k} − t_j)/(t_{a_k} − t_{a_{k+1}})``. With anchors (0, W−1) the columns are ``1 − α`` and ``α``.
    """
    t = _as_timesteps(t)
    w = t.numel()
    anchors = tuple(anchors) if anchors is not None else (0, w - 1)
    if anchors[0] != 0 or anchors[-1] != w - 1 or any(b <= a for a, b in zip(anchors, anchors[1:])):
        raise ValueError(f"anchors must increase strictly from 0 to {w - 1}, got {anchors}.")
    m = torch.zeros(w, len(anchors), dtype=torch.float64)
    for k, (a, b) in enumerate(zip(anchors, anchors[1:])):
        alpha = (t[a] - t[a : b + 1]) / (t[a] - t[b])  # (b − a + 1,)
        m[a : b + 1, k] = 1.0 - alpha
        m[a : b + 1, k + 1] = alpha  # the shared anchor b is overwritten to exactly (0, 1)
    return m


def resolve_anchors(window: int, anchors: int = 2, anchor_at: Sequence[int] | None = None) -> tuple[int, ...]:
    """The anchors of a group (:func:`jagg_core.modes.placed_anchors`, the rule the configuration checks too)."""
    return placed_anchors(window, anchors, anchor_at)


def random_anchor_probabilities(t: torch.Tensor | Sequence[float], anchors: Sequence[int],
                                weights: str | Sequence[float] = "uniform") -> torch.Tensor:
    """(W,) float64 p_r of drawing step r as the random anchor: 0 at the anchors, summing to 1 over the others.

    ``"uniform"``: equal; ``"alpha"``: ∝ α(1 − α) with α the step's weight between its two neighbouring anchors (the
    interpolation's error of a smooth velocity grows as α(1 − α)); a sequence: one non-negative weight per step of the
    group (those at anchors are ignored), every non-anchor step's positive — a step that is never drawn would keep
    its interpolation error, and the estimator would not be unbiased.
    """
    m = anchor_weights(t, anchors)
    w = m.shape[0]
    free = torch.ones(w, dtype=torch.bool)
    free[list(anchors)] = False
    if not bool(free.any()):
        raise ValueError(f"a random anchor needs a step that is not an anchor; the group of {w} has none.")
    if isinstance(weights, str):
        if weights == "uniform":
            q = free.to(torch.float64)
        elif weights == "alpha":
            q = (m[:, :-1] * m[:, 1:]).sum(dim=1)  # (1 − α) α between the step's two anchors, 0 at an anchor
        else:
            raise ValueError(f"random anchor weights must be 'uniform', 'alpha' or a list of {w} numbers, "
                             f"got {weights!r}.")
    else:
        q = torch.as_tensor([float(x) for x in weights], dtype=torch.float64)
        if q.numel() != w or not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
            raise ValueError(f"random anchor weights must be {w} finite non-negative numbers, got {list(weights)}.")
    q = torch.where(free, q, torch.zeros_like(q))
    if not bool((q[free] > 0).all()):
        raise ValueError(f"every step that is not an anchor needs a positive random anchor weight, got "
                         f"{[round(float(x), 6) for x in q]} (anchors {list(anchors)}).")
    return q / q.sum()


def draw_random_anchor(p: torch.Tensor, rows: int, per: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """(rows,) int64 steps drawn from ``p``: one for all rows (``per="group"``), or one per row (``"image"``),
    stratified — slot i of a random permutation takes the quantile (i + U)/rows — so every row's step has the law ``p``
    and the rows cover the steps in proportion to it."""
    if per not in RANDOM_ANCHOR:
        raise ValueError(f"random_anchor must be one of {RANDOM_ANCHOR}, got {per!r}.")
    cdf = p.cumsum(0)
    cdf[-1] = 1.0
    u = torch.rand(1, generator=generator, dtype=torch.float64)
    if per == "group":
        return torch.searchsorted(cdf, u, right=True).clamp(max=p.numel() - 1).expand(rows).clone()
    slots = (torch.arange(rows, dtype=torch.float64) + u) / rows
    steps = torch.searchsorted(cdf, slots, right=True).clamp(max=p.numel() - 1)
    out = torch.empty(rows, dtype=torch.int64)
    out[torch.randperm(rows, generator=generator)] = steps
    return out


def aggregate_upstream(
    s: Sequence[torch.Tensor], t: torch.Tensor | Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s_base, s_corr) = (Σ_j (1 − α_j) s_j, Σ_j α_j s_j) (Eq. 7)."""
    alpha = interpolation_weights(t)
    if len(s) != alpha.numel():
        raise ValueError(f"got {len(s)} upstream signals for {alpha.numel()} timesteps.")
    s_base = sum(float(1.0 - a) * s_j for a, s_j in zip(alpha, s))
    s_corr = sum(float(a) * s_j for a, s_j in zip(alpha, s))
    return s_base, s_corr


@dataclass(frozen=True)
class Group:
    """W consecutive trained steps (indices into the trajectory) and how their gradient is computed."""

    steps: tuple[int, ...]
    mode: str  # one of MODES (jagg_core.modes)
    position: int  # index of the group along the trajectory (0 = highest noise)


# jagg_frac 'auto' when the fidelity curve cannot be measured (under FSDP: the probe needs full gradients on one
# rank): the paper's own setting (Flux and Qwen-Image, W = 4).
AUTO_FALLBACK_JAGG_FRAC = 0.6


SUBSETS: tuple[str, ...] = ("prefix", "random")  # plan_groups' timestep subsets: Flow-GRPO's and DanceGRPO's


def plan_groups(
    num_steps: int | Sequence[int],
    window: int,
    jagg_frac: float,
    *,
    mode: str = "jagg",
    fraction: float = 1.0,
    subset: str | None = None,
    generator: torch.Generator | None = None,
) -> list[Group]:
    """Cut the trained steps into groups of ``window`` consecutive steps and route each to a backward mode.

    The first ``round(jagg_frac · n_full)`` full groups in denoising order (high noise first) use ``mode``; the rest
    and a trailing partial group use exact backward. ``window=1`` is the off switch: every step its own exact group,
    the per-step loop of Flow-GRPO and DanceGRPO.

    Args:
        num_steps: the number of trained steps (0..T−1), or the trained step indices in denoising order.
        window: W ≥ 1 (1: JAGG off).
        jagg_frac: fraction of full groups, from the high-noise end, that use ``mode``.
        mode: one of :data:`MODES`: ``"jagg"``, ``"ablate"`` or ``"ablate_matched"`` route the leading groups;
            ``"exact"`` or ``"exact_batched"`` route every group, the partial one included (the baseline).
        fraction: the share of the steps trained, in (0, 1]; below 1, ``subset`` must say which steps:
            ``"prefix"`` is Flow-GRPO's ``timestep_fraction`` (the first ``int(fraction · T)`` steps, then cut into
            groups: the steps Flow-GRPO trains); ``"random"`` is DanceGRPO's (a random subset of whole groups,
            ``max(1, round(fraction · n_groups))`` of them, never single steps out of a group; a kept group keeps
            its routing).
        subset: ``"prefix"`` or ``"random"`` (only with ``fraction < 1``).
        generator: RNG for the random subset.
    """
    steps = list(range(num_steps)) if isinstance(num_steps, int) else [int(s) for s in num_steps]
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer of at least 1 (1: JAGG off, every step exact), got {window!r}.")
    if not 0.0 <= jagg_frac <= 1.0:
        raise ValueError(f"jagg_frac must be in [0, 1], got {jagg_frac}.")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}.")
    if fraction < 1.0 and subset not in SUBSETS:
        raise ValueError(f"fraction {fraction} trains a subset of the steps: say which with subset='prefix' "
                         f"(Flow-GRPO's timestep_fraction: the first int(fraction · T) steps) or subset='random' "
                         f"(DanceGRPO's: random whole groups), got subset={subset!r}.")
    if fraction < 1.0 and subset == "prefix":
        keep = int(len(steps) * fraction)  # as Flow-GRPO: int(num_steps * timestep_fraction)
        if keep < 1:
            raise ValueError(f"fraction {fraction} of {len(steps)} trained steps keeps none (int() rounds down).")
        steps = steps[:keep]
    chunks = [tuple(steps[i : i + window]) for i in range(0, len(steps), window)]
    n_full = len(steps) // window
    if mode in EXACT_MODES or window == 1:  # the exact baselines and the off switch: every group, the partial one too
        groups = [Group(c, "exact" if window == 1 else mode, i) for i, c in enumerate(chunks)]
    else:
        n_routed = math.floor(jagg_frac * n_full + 0.5)  # round half up
        groups = [Group(c, mode if i < n_routed else "exact", i) for i, c in enumerate(chunks)]
    if fraction < 1.0 and subset == "random" and groups:
        keep = max(1, round(fraction * len(groups)))
        chosen = torch.randperm(len(groups), generator=generator)[:keep].sort().values
        groups = [groups[int(i)] for i in chosen]
    return groups


@dataclass(frozen=True)
class Estimator:
    """How an anchored group's gradient is estimated, beyond its mode: one value instead of a list of arguments.

    ``anchors``: K, the steps kept with autograd graphs, evenly spread (2: the paper's JAGG; W: exact);
    ``anchor_at``: their positions instead (both endpoints included); ``random_anchor``: ``None`` (the deterministic
    interpolation), ``"group"`` or ``"image"``: one more anchor drawn at random, per group or per image, which makes
    the estimator unbiased (jagg mode only; module docstring); ``random_anchor_p``: its law over the non-anchor steps
    (:func:`random_anchor_probabilities`); ``random_anchor_weight``: λ, the share of its correction applied (1:
    unbiased, 0: JAGG; in between the expectation is JAGG + λ (exact − JAGG), the variance λ² the unbiased one's).
    """

    anchors: int = 2
    anchor_at: tuple[int, ...] | None = None
    random_anchor: str | None = None
    random_anchor_p: str | tuple[float, ...] = "uniform"
    random_anchor_weight: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.anchors, bool) or not isinstance(self.anchors, int) or self.anchors < 2:
            raise ValueError(f"anchors must be an integer of at least 2, got {self.anchors!r}.")
        if self.anchor_at is not None:
            object.__setattr__(self, "anchor_at", tuple(int(a) for a in self.anchor_at))
        if not isinstance(self.random_anchor_p, str):
            object.__setattr__(self, "random_anchor_p", tuple(float(x) for x in self.random_anchor_p))
        if self.random_anchor is not None and self.random_anchor not in RANDOM_ANCHOR:
            raise ValueError(f"random_anchor must be None or one of {RANDOM_ANCHOR}, got {self.random_anchor!r}.")
        w = self.random_anchor_weight
        if isinstance(w, bool) or not (isinstance(w, (int, float)) and 0.0 <= w <= 1.0):
            raise ValueError(f"random_anchor_weight must be a number in [0, 1], got {w!r}.")

    def positions(self, window: int) -> tuple[int, ...]:
        """The anchors of a group of ``window`` steps (:func:`resolve_anchors`)."""
        return resolve_anchors(window, self.anchors, self.anchor_at)


@dataclass
class GroupStats:
    """What one call of :func:`group_backward` (or :func:`group_surrogate`) did."""

    mode: str
    variant: str
    window: int
    loss: float = 0.0  # Σ_j of the values step_loss returned
    grad_forwards: int = 0  # step velocities computed with autograd recording
    forward_calls: int = 0  # policy calls (a batched anchor forward is one call for several steps)
    nograd_forwards: int = 0  # velocity calls under no_grad
    reused_velocities: int = 0  # middle velocities taken from middle_velocity instead of a forward
    backward_calls: int = 0  # transformer backward passes (group_surrogate: the caller's one)
    backward_seconds: float = 0.0  # wall time inside those calls (group_surrogate: 0, the caller runs it)
    random_anchor: list[int] = field(default_factory=list)  # the drawn step of each row (random_anchor only)
    extras: dict[str, float] = field(default_factory=dict)  # mean over steps of step_loss's extra stats


def _clock(like: torch.Tensor) -> float:
    if like.is_cuda:  # kernels are asynchronous: wait for them so the time is the backward's own
        torch.cuda.synchronize(like.device)
    return time.perf_counter()


def _check_scalar(loss: object) -> None:
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        raise ValueError(f"step_loss must return a scalar tensor (or (scalar, {{name: stat}})), got "
                         f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}.")


def _upstream(step_loss: StepLoss, j: int, v: torch.Tensor) -> tuple[torch.Tensor, float, dict[str, float]]:
    """s_j = ∂L_j/∂ṽ_j on a detached proxy ṽ_j: only the SDE step and the PPO objective are differentiated."""
    proxy = v.detach().to(torch.promote_types(v.dtype, torch.float32)).requires_grad_(True)
    with torch.enable_grad():
        out = step_loss(j, proxy)
        loss, extras = (out if isinstance(out, tuple) else (out, {}))
        _check_scalar(loss)
        (s,) = torch.autograd.grad(loss, proxy, allow_unused=True)
    s = torch.zeros_like(proxy) if s is None else s  # a loss that ignores v (e.g. zero advantages)
    return s, float(loss.detach()), {k: float(x) for k, x in extras.items()}


def inner_product(outputs: Sequence[torch.Tensor], cotangents: Sequence[torch.Tensor]) -> torch.Tensor:
    """() ``Σ_i ⟨outputs_i, cotangents_i⟩`` with the cotangents detached: its gradient reaches each output as exactly
    its cotangent (kept in float32 or wider, so a GradScaler's scale multiplies it before any cast to the output's
    half precision, as it would the loss's own gradient), so backpropagating it is ``torch.autograd.backward(outputs,
    cotangents)`` by any caller's backward (``accelerator.backward``, a GradScaler, DeepSpeed's engine)."""
    total = None
    for o, c in zip(outputs, cotangents):
        term = (o * c.detach()).sum()
        total = term if total is None else total + term
    return total


def group_backward(
    velocity: Velocity,
    step_loss: StepLoss,
    t: torch.Tensor | Sequence[float],
    mode: str,
    variant: str = "joint",
    *,
    estimator: Estimator | None = None,
    generator: torch.Generator | None = None,
    draw: int | torch.Tensor | None = None,
    middle_velocity: MiddleVelocity | None = None,
    velocity_batch: VelocityBatch | None = None,
    velocity_rows: VelocityRows | None = None,
    before_backward: Callable[[bool], None] | None = None,
    backward: Callable[[torch.Tensor], None] | None = None,
) -> GroupStats:
    """Accumulate the group's GRPO gradient into the parameters' ``.grad``, like ``loss.backward()``.

    A dispatcher over one function per path: :func:`_exact_backward` (``exact``), :func:`_exact_batched_backward`
    (``exact_batched``) and :func:`_anchored_backward` (``jagg``, ``ablate``, ``ablate_matched``: Eq. 7), whose
    anchors go through :func:`_joint_anchors` or :func:`_sequential_anchors`. :func:`group_surrogate` is the form
    whose one backward the caller runs.

    Args:
        velocity: ``j -> v_j`` runs the policy on stored step j (0 ≤ j < W) of the group; this function decides the
            grad mode around each call.
        step_loss: ``(j, v) -> L_j`` (or ``(L_j, {name: stat})``), a scalar differentiable in ``v`` only. Its scale
            is the caller's (e.g. ``L_j / W``).
        t: the group's network timesteps, (W,) or Flow-GRPO's (B, W) with equal rows (:func:`group_timesteps`).
        mode: one of :data:`MODES` (``jagg_core.modes``): ``"exact"``, ``"exact_batched"`` (exact, all W steps in one
            forward call and one backward), ``"jagg"``, ``"ablate"`` or ``"ablate_matched"`` (anchor signals scaled
            by W/K).
        variant: ``"joint"`` (one backward over all anchors) or ``"sequential"`` (one anchor graph at a time); the
            exact modes ignore it.
        estimator: the anchors and the random anchor (:class:`Estimator`; default: the paper's two endpoints).
        generator: the random anchor's RNG (a trainer seeds one per iteration, so a resumed run draws the same steps).
        draw: the drawn step(s) instead of a draw: an int for every row, or a (B,) tensor, one per row (tests,
            studies that enumerate every draw).
        middle_velocity: ``j -> v_j or None``: a velocity already known for a non-anchor step (e.g. kept by the
            rollout while the policy is unchanged); None falls back to a no-grad forward.
        velocity_batch: ``[j, ...] -> [v_j, ...]`` in ONE policy call (e.g. the anchors concatenated along the batch):
            the joint variant then builds a single graph, so FSDP all-gathers each module once in its backward;
            ``exact_batched`` forwards all W steps through it (W separate calls without it).
        velocity_rows: ``(rows, js) -> v`` for the image rows ``rows`` (int64), each at its own step ``js[i]``, in one
            call: what ``random_anchor="image"`` forwards its drawn steps and the rest of the middle steps with.
        before_backward: called with ``last`` before each backward pass (``last`` for the group's final one); a
            data-parallel caller uses it to synchronise gradients only once.
        backward: the caller's backward (``accelerator.backward``, ``lambda x: scaler.scale(x).backward()``, DeepSpeed's
            ``engine.backward``), called once per backward pass with a scalar whose gradient is that pass's: an exact
            step's own loss ``L_j(v_j)`` (the per-step loop bit for bit), an anchored pass's :func:`inner_product`
            (whose value is not the loss); default ``torch.autograd.backward`` of the outputs.
    """
    t = group_timesteps(t)
    run = _GroupRun(velocity, step_loss, GroupStats(mode=mode, variant=variant, window=t.numel()), middle_velocity,
                    velocity_batch, velocity_rows, before_backward, backward)
    return _dispatch(run, t, mode, variant, estimator or Estimator(), generator, draw)


@dataclass
class Surrogate:
    """The group's update as a scalar the caller differentiates: ``loss``'s value is the group's loss ``Σ_j L_j``, its
    gradient the estimator's (every graph the group keeps is alive until the caller's backward)."""

    loss: torch.Tensor  # () differentiable
    stats: GroupStats


def group_surrogate(
    velocity: Velocity,
    step_loss: StepLoss,
    t: torch.Tensor | Sequence[float],
    mode: str,
    *,
    estimator: Estimator | None = None,
    generator: torch.Generator | None = None,
    draw: int | torch.Tensor | None = None,
    middle_velocity: MiddleVelocity | None = None,
    velocity_batch: VelocityBatch | None = None,
    velocity_rows: VelocityRows | None = None,
) -> Surrogate:
    """The group's update with the backward left to the caller: ``accelerator.backward(surrogate.loss)``, a GradScaler's
    ``scaler.scale(surrogate.loss).backward()``, DeepSpeed's ``engine.backward``, inside DDP's ``no_sync`` or not.

    The scalar is ``Σ_k ⟨v_k, c_k⟩`` (:func:`inner_product`) over the graphs the group keeps — the joint variant's
    anchors and their aggregated cotangents (Eq. 7); ``exact_batched``'s W steps and signals; an ``exact`` group's
    own ``Σ_j L_j(v_j)`` — shifted so its value is the group's loss. Its gradient is :func:`group_backward`'s to the
    last bit in float32 and float64 (tests/test_jagg.py; an exact group's equals the per-step loop's to rounding, and
    a single step's, the off switch's, bit for bit). Memory: the joint variant's (K anchor graphs alive, K + 1 with a
    random anchor); an exact group keeps all W graphs: for the per-step loop's memory use :func:`group_backward` with
    ``backward=``, which also runs the sequential variant. Arguments as :func:`group_backward`'s.
    """
    t = group_timesteps(t)
    run = _GroupRun(velocity, step_loss, GroupStats(mode=mode, variant="joint", window=t.numel()), middle_velocity,
                    velocity_batch, velocity_rows, collected=[])
    stats = _dispatch(run, t, mode, "joint", estimator or Estimator(), generator, draw)
    inner = run.collected[0]
    for scalar in run.collected[1:]:
        inner = inner + scalar
    loss = inner + (torch.as_tensor(stats.loss, dtype=inner.dtype, device=inner.device) - inner.detach())
    stats.backward_calls = 1
    return Surrogate(loss, stats)


def _dispatch(run: "_GroupRun", t: torch.Tensor, mode: str, variant: str, estimator: Estimator,
              generator: torch.Generator | None, draw: int | torch.Tensor | None) -> GroupStats:
    """The group's path by mode (both forms share it): the exact loop, the batched exact, or the anchors of Eq. 7."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}.")
    if not isinstance(estimator, Estimator):
        raise ValueError(f"estimator must be a jagg_core.Estimator, got {type(estimator).__name__}.")
    if estimator.random_anchor == "image" and run.velocity_rows is None and mode == "jagg":
        raise ValueError("random_anchor='image' forwards each image at its own drawn step: it needs velocity_rows.")
    if mode == "exact" or t.numel() < 2:
        run.stats.mode = "exact"
        _exact_backward(run, t.numel())
    elif mode == "exact_batched":
        _exact_batched_backward(run, t.numel())
    else:
        pos = estimator.positions(t.numel())
        probe = None
        if estimator.random_anchor is not None and mode == "jagg" and len(pos) < t.numel():
            probe = _Probe(random_anchor_probabilities(t, pos, estimator.random_anchor_p), estimator.random_anchor,
                           generator, draw, float(estimator.random_anchor_weight))
        _anchored_backward(run, t, mode, variant, pos, probe)
    run.stats.extras = {k: sum(x) / len(x) for k, x in run.extras.items()}
    return run.stats


class GroupSteps(Protocol):
    """One group's stored steps as one object: what :func:`run_group` hands to :func:`group_backward`.

    ``velocity`` and ``step_loss`` are required (:func:`group_backward`'s two callables); ``middle_velocity``,
    ``velocity_batch``, ``velocity_rows`` and ``before_backward`` are optional members, used where the object has
    them (not None).
    """

    def velocity(self, j: int) -> torch.Tensor: ...

    def step_loss(self, j: int, v: torch.Tensor) -> "torch.Tensor | tuple[torch.Tensor, Mapping[str, float]]": ...


def run_group(steps: GroupSteps, t: torch.Tensor | Sequence[float], mode: str, variant: str = "joint", *,
              estimator: Estimator | None = None, **options) -> GroupStats:
    """:func:`group_backward` of the group ``steps`` holds: its two callables and the optional ones it has;
    ``options`` are :func:`group_backward`'s other keyword options (``generator``, ``draw``, ``backward``)."""
    return group_backward(
        steps.velocity, steps.step_loss, t, mode, variant, estimator=estimator,
        middle_velocity=getattr(steps, "middle_velocity", None),
        velocity_batch=getattr(steps, "velocity_batch", None),
        velocity_rows=getattr(steps, "velocity_rows", None),
        before_backward=getattr(steps, "before_backward", None),
        **options,
    )


@dataclass
class _GroupRun:
    """What every path shares: the group's callables, the step losses' signals and the counted backward passes.

    ``collected`` (the surrogate form) gathers each pass's scalar for the caller's one backward instead of running it;
    ``backward_fn`` is the caller's backward of each pass's scalar: :func:`inner_product` of its outputs and
    cotangents, or an exact step's own loss.
    """

    velocity: Velocity
    step_loss: StepLoss
    stats: GroupStats
    middle_velocity: MiddleVelocity | None = None
    velocity_batch: VelocityBatch | None = None
    velocity_rows: VelocityRows | None = None
    before_backward: Callable[[bool], None] | None = None
    backward_fn: Callable[[torch.Tensor], None] | None = None
    collected: list[torch.Tensor] | None = None
    extras: dict[str, list[float]] = field(default_factory=dict)

    def signal(self, j: int, v: torch.Tensor) -> torch.Tensor:
        """s_j = ∂L_j/∂v_j, with L_j and its extra stats recorded."""
        s, loss, ex = _upstream(self.step_loss, j, v)
        self.stats.loss += loss
        for k, x in ex.items():
            self.extras.setdefault(k, []).append(x)
        return s

    def forward(self, j: int) -> torch.Tensor:
        """v_j with autograd recording: one graph, one policy call."""
        self.stats.grad_forwards += 1
        self.stats.forward_calls += 1
        return self.velocity(j)

    def own_loss(self, j: int, v: torch.Tensor) -> torch.Tensor:
        """L_j(v_j) itself, differentiable through v_j, with L_j and its extra stats recorded."""
        out = self.step_loss(j, v)
        loss, extras = (out if isinstance(out, tuple) else (out, {}))
        _check_scalar(loss)
        self.stats.loss += float(loss.detach())
        for k, x in extras.items():
            self.extras.setdefault(k, []).append(float(x))
        return loss

    def backward(self, outputs: list[torch.Tensor], grads: list[torch.Tensor], last: bool) -> None:
        """One transformer backward pass: ``Σ_i outputs_iᵀ grads_i`` into ``.grad`` (or kept for the caller's)."""
        if self.collected is None and self.backward_fn is None:
            if self.before_backward is not None:
                self.before_backward(last)
            t0 = _clock(outputs[0])
            torch.autograd.backward(outputs, [g.to(o.dtype) for g, o in zip(grads, outputs)])
            self.stats.backward_seconds += _clock(outputs[0]) - t0
            self.stats.backward_calls += 1
        else:
            self.backward_scalar(inner_product(outputs, grads), last)

    def backward_scalar(self, scalar: torch.Tensor, last: bool) -> None:
        """The caller's backward of one pass's scalar (or, in the surrogate form, kept for its one backward)."""
        if self.collected is not None:
            self.collected.append(scalar)
            return
        if self.before_backward is not None:
            self.before_backward(last)
        t0 = _clock(scalar)
        self.backward_fn(scalar)
        self.stats.backward_seconds += _clock(scalar) - t0
        self.stats.backward_calls += 1


def _exact_backward(run: _GroupRun, w: int) -> None:
    """The baseline: every step forwards with grad and backwards on its own (at most one graph alive). Under the
    caller's backward each step's scalar is its own loss ``L_j(v_j)``, so the caller's per-step loop is reproduced
    bit for bit (a loss scale or a GradScaler applied where the loop applied it)."""
    for j in range(w):
        v = run.forward(j)
        if run.backward_fn is not None or run.collected is not None:
            run.backward_scalar(run.own_loss(j, v), last=j == w - 1)
        else:
            run.backward([v], [run.signal(j, v)], last=j == w - 1)
        del v


def _exact_batched_backward(run: _GroupRun, w: int) -> None:
    """The exact gradient ``Σ_j J_jᵀ s_j`` with every step's graph alive at once: all W steps in one with-grad forward
    call (``velocity_batch``; W calls without it) and one backward over them all."""
    steps = list(range(w))
    if run.velocity_batch is not None:
        outputs = list(run.velocity_batch(steps))
        run.stats.forward_calls += 1
    else:
        outputs = [run.velocity(j) for j in steps]
        run.stats.forward_calls += w
    run.stats.grad_forwards += w
    grads = [run.signal(j, v) for j, v in zip(steps, outputs)]
    run.backward(outputs, grads, last=True)
    del outputs


@dataclass
class _Probe:
    """The random anchor of one group: its law over the group's steps and how it is drawn."""

    p: torch.Tensor  # (W,) float64
    per: str  # "group" or "image"
    generator: torch.Generator | None
    draw: int | torch.Tensor | None
    weight: float = 1.0  # λ: the share of the correction applied (1: unbiased)

    def steps(self, rows: int) -> torch.Tensor:
        """(rows,) the drawn step of every row."""
        if self.draw is None:
            return draw_random_anchor(self.p, rows, self.per, self.generator)
        r = torch.as_tensor(self.draw, dtype=torch.int64).flatten().expand(rows).clone()
        if bool((self.p[r] <= 0).any()):
            raise ValueError(f"a drawn random anchor must be a step that is not an anchor, got "
                             f"{sorted(set(r.tolist()))}.")
        return r


def _anchored_backward(run: _GroupRun, t: torch.Tensor, mode: str, variant: str, pos: tuple[int, ...],
                       probe: _Probe | None = None) -> None:
    """Eq. 7 with K anchors: ``∇θ ≈ Σ_k J_{a_k}ᵀ s_anchor_k``, ``s_anchor_k = Σ_j M[j, k] s_j`` (:func:`anchor_weights`;
    K = 2: ``J_0ᵀ s_base + J_{W−1}ᵀ s_corr``). The middle steps' signals come first, under no_grad (no graph alive);
    then the anchors forward with grad and their aggregated signals go through one backward (joint) or one each
    (sequential). ``ablate`` keeps only the anchors' own signals (``ablate_matched``: scaled by W/K). With a random
    anchor (:class:`_Probe`) its rows are forwarded with grad first and every middle step's other rows without."""
    w = t.numel()
    weights = anchor_weights(t, pos) if mode == "jagg" else None  # (W, K)
    own = w / len(pos) if mode == "ablate_matched" else 1.0  # ablate's anchor weight: 1, or W/K weight-matched
    s_anchor: list[torch.Tensor | None] = [None] * len(pos)

    def accumulate(j: int, s: torch.Tensor) -> None:
        for k in range(len(pos)):
            if weights is None:  # ablate: an anchor keeps its own signal, middle signals are discarded
                c = own if pos[k] == j else 0.0
            else:
                c = float(weights[j, k])
            if c != 0.0:
                s_anchor[k] = c * s if s_anchor[k] is None else s_anchor[k] + c * s

    if probe is not None:
        _probed_backward(run, variant, pos, weights, probe, accumulate, s_anchor)
        return
    for j in range(w):
        if j not in pos:
            accumulate(j, run.signal(j, _middle_velocity(run, j)))
    if variant == "joint":
        _joint_anchors(run, pos, accumulate, s_anchor)
    else:
        _sequential_anchors(run, pos, accumulate, s_anchor)


def _probed_backward(run: _GroupRun, variant: str, pos: tuple[int, ...], weights: torch.Tensor, probe: _Probe,
                     accumulate: Callable[[int, torch.Tensor], None], s_anchor: list[torch.Tensor | None]) -> None:
    """JAGG plus the random anchor's correction (module docstring), in one joint backward or one per graph.

    The first anchor forwards with grad (in the joint variant with ``velocity_batch``, every anchor in one call, and
    with ``per="group"`` the drawn step too); then each row's step r_i is drawn and forwarded with grad (the probe:
    :func:`_probe_forwards`); each middle step is forwarded under no_grad only on the rows that did not draw it
    (:func:`_probe_middle_signals`), so the group costs the forwards of K + 1 anchors. The probe's cotangent is
    ``λ s_{r_i} / p_{r_i}`` per row and anchor k's loses ``λ M[r_i, k] s_{r_i} / p_{r_i}`` (λ =
    ``random_anchor_weight``, 1: unbiased). Joint: one backward over the K + 1 graphs. Sequential: the first
    anchor's and the probe's backward once the middle signals are known (two graphs alive at most), then one anchor
    at a time."""
    outputs, v_probe, r = _probe_forwards(run, variant, pos, probe)
    n = len(r)
    mids = [j for j in range(weights.shape[0]) if j not in pos]
    signals = _probe_middle_signals(run, mids, r, v_probe, accumulate)
    # the correction: row i's signal at its drawn step, scaled by 1/p
    slot = torch.tensor([mids.index(int(x)) for x in r])
    s_r = torch.stack([signals[j] for j in mids])[slot, torch.arange(n)]  # (n, ...)
    shape = (n,) + (1,) * (s_r.ndim - 1)
    inv_p = (probe.weight / probe.p[r]).to(s_r.dtype).reshape(shape)
    probe_cot = s_r * inv_p
    for k in range(len(pos)):
        c = (probe.weight * weights[r, k] / probe.p[r]).to(s_r.dtype).reshape(shape)
        if bool((c != 0).any()):
            s_anchor[k] = s_anchor[k] - s_r * c if s_anchor[k] is not None else -s_r * c
    if variant == "joint":
        for j in pos:
            if j not in outputs:
                outputs[j] = run.forward(j)
        for j in pos:
            accumulate(j, run.signal(j, outputs[j]))
        outs = [outputs[j] for j in pos] + [v_probe]
        run.backward(outs, [s_anchor[k] for k in range(len(pos))] + [probe_cot], last=True)
        del outs, outputs, v_probe
        return
    # sequential: the first anchor and the probe now, the other anchors one at a time
    accumulate(pos[0], run.signal(pos[0], outputs[pos[0]]))
    v0 = outputs.pop(pos[0])
    run.backward([v0, v_probe], [s_anchor[0], probe_cot], last=len(pos) == 1)
    s_anchor[0] = None
    del v0, v_probe
    _sequential_anchors(run, pos, accumulate, s_anchor, start=1)


def _probe_forwards(run: _GroupRun, variant: str, pos: tuple[int, ...],
                    probe: _Probe) -> tuple[dict[int, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The random anchor's with-grad forwards: the first anchor (joint with ``velocity_batch``: every anchor, and a
    group's drawn step, in one call), then the probe. Returns (anchor position -> output, the probe's output, (n,)
    each row's drawn step)."""
    per_group = probe.per == "group"
    r_group = probe.steps(1) if per_group else None  # a group's draw needs no batch size
    outputs: dict[int, torch.Tensor] = {}
    v_probe = None
    if variant == "joint" and run.velocity_batch is not None:  # the anchors (and a group's drawn step) in one call
        batch = list(run.velocity_batch([*pos, int(r_group[0])] if per_group else list(pos)))
        outputs.update(zip(pos, batch[: len(pos)]))
        v_probe = batch[-1] if per_group else None
        run.stats.forward_calls += 1
        run.stats.grad_forwards += len(batch)
    else:
        outputs[pos[0]] = run.forward(pos[0])
    n = int(outputs[pos[0]].shape[0])
    r = r_group.expand(n).clone() if per_group else probe.steps(n)
    run.stats.random_anchor = r.tolist()
    if v_probe is None:
        if per_group:
            v_probe = run.forward(int(r[0]))
        else:
            v_probe = run.velocity_rows(torch.arange(n), r)
            run.stats.forward_calls += 1
            run.stats.grad_forwards += 1
    return outputs, v_probe, r


def _probe_middle_signals(run: _GroupRun, mids: list[int], r: torch.Tensor, v_probe: torch.Tensor,
                          accumulate: Callable[[int, torch.Tensor], None]) -> dict[int, torch.Tensor]:
    """Each middle step's signal: from a reused velocity, from the probe (the rows that drew it), and from no-grad
    forwards of the rows that did not."""
    n = len(r)
    signals: dict[int, torch.Tensor] = {}
    nograd_rows = 0
    for j in mids:
        v = run.middle_velocity(j) if run.middle_velocity is not None else None
        drew = r == j
        if v is not None:
            run.stats.reused_velocities += 1
        elif bool(drew.all()):
            v = v_probe.detach()
        else:
            with torch.no_grad():
                if bool(drew.any()):
                    rows = torch.nonzero(~drew).flatten()
                    v = v_probe.detach().clone()
                    v[rows] = run.velocity_rows(rows, torch.full_like(rows, j))
                    nograd_rows += len(rows)
                else:
                    v = run.velocity(j)
                    nograd_rows += n
            run.stats.forward_calls += 1
        signals[j] = run.signal(j, v)
        accumulate(j, signals[j])
    run.stats.nograd_forwards += nograd_rows // n
    return signals


def _middle_velocity(run: _GroupRun, j: int) -> torch.Tensor:
    """v_j of a non-anchor step: the rollout's own if kept, else a forward under no_grad."""
    v = run.middle_velocity(j) if run.middle_velocity is not None else None
    if v is None:
        with torch.no_grad():
            v = run.velocity(j)
        run.stats.nograd_forwards += 1
        run.stats.forward_calls += 1
    else:
        run.stats.reused_velocities += 1
    return v


def _joint_anchors(run: _GroupRun, pos: tuple[int, ...], accumulate: Callable[[int, torch.Tensor], None],
                   s_anchor: list[torch.Tensor | None]) -> None:
    """Every anchor's graph alive at once, one backward over them all (one FSDP all-gather per module)."""
    if run.velocity_batch is not None:
        outputs = list(run.velocity_batch(pos))
        run.stats.forward_calls += 1
    else:
        outputs = [run.velocity(j) for j in pos]
        run.stats.forward_calls += len(pos)
    run.stats.grad_forwards += len(pos)
    for j, v in zip(pos, outputs):
        accumulate(j, run.signal(j, v))
    run.backward(outputs, list(s_anchor), last=True)
    del outputs


def _sequential_anchors(run: _GroupRun, pos: tuple[int, ...], accumulate: Callable[[int, torch.Tensor], None],
                        s_anchor: list[torch.Tensor | None], start: int = 0) -> None:
    """One anchor graph alive at a time, one backward each (for memory), from anchor ``start`` on (the random
    anchor's sequential path has backpropagated the first already)."""
    for k in range(start, len(pos)):
        v = run.forward(pos[k])
        accumulate(pos[k], run.signal(pos[k], v))
        run.backward([v], [s_anchor[k]], last=k == len(pos) - 1)
        s_anchor[k] = None
        del v  # the graph of this anchor is freed before the next anchor's forward
