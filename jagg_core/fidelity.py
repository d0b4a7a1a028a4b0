"""Gradient fidelity: how close the JAGG (and ablate) group gradients are to the exact one, along a trajectory.

For every full group of W steps, the exact, JAGG and ablate gradients of that group alone are computed on the same
stored trajectory and compared by cosine similarity (paper Appendix E). The paper reads ``jagg_frac`` off this curve:
JAGG is used on the leading (high-noise) groups whose cosine stays above a threshold (0.5 in the paper).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from .jagg import Estimator, StepLoss, group_backward, plan_groups

__all__ = ["FidelityReport", "gradient_fidelity", "jagg_frac_from_cosines"]


def jagg_frac_from_cosines(cosines: Sequence[float], threshold: float) -> float:
    """The fraction of groups, counted from the high-noise end, before the first cosine below ``threshold``."""
    if not cosines:
        return 0.0
    lead = 0
    for c in cosines:
        if not c >= threshold:  # also stops at NaN
            break
        lead += 1
    return lead / len(cosines)


@dataclass
class FidelityReport:
    """Per-group cosines, in denoising order."""

    window: int
    anchors: int
    positions: list[int] = field(default_factory=list)  # group index along the trajectory
    steps: list[tuple[int, ...]] = field(default_factory=list)
    cos_jagg: list[float] = field(default_factory=list)
    cos_ablate: list[float] = field(default_factory=list)
    norm_ratio_jagg: list[float] = field(default_factory=list)  # ‖g_jagg‖ / ‖g_exact‖

    def jagg_frac(self, threshold: float = 0.5) -> float:
        """The jagg_frac this curve implies at a cosine threshold (the paper uses 0.5)."""
        return jagg_frac_from_cosines(self.cos_jagg, threshold)

    def as_dict(self) -> dict:
        return {
            "window": self.window,
            "anchors": self.anchors,
            "positions": self.positions,
            "steps": [list(s) for s in self.steps],
            "cos_jagg": self.cos_jagg,
            "cos_ablate": self.cos_ablate,
            "norm_ratio_jagg": self.norm_ratio_jagg,
        }


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = a.norm(), b.norm()
    if na == 0 or nb == 0:
        return float("nan")
    return float(a @ b / (na * nb))


def gradient_fidelity(
    parameters: Iterable[torch.nn.Parameter],
    velocity: Callable[[int], torch.Tensor],
    step_loss: StepLoss,
    t: torch.Tensor | Sequence[float],
    window: int,
    *,
    steps: Sequence[int] | None = None,
    anchors: int = 2,
    variant: str = "joint",
) -> FidelityReport:
    """cos(JAGG, exact) and cos(ablate, exact) for each full group of ``window`` steps of one trajectory.

    Args:
        parameters: the trained parameters; their ``.grad`` is restored on return.
        velocity: ``i -> v_i`` for trajectory step i (as for :func:`group_backward`, but indexed by step).
        step_loss: ``(i, v) -> L_i`` for trajectory step i.
        t: (T,) network timesteps of all trajectory steps.
        window: W.
        steps: the trained step indices in denoising order (default: all T steps).
        anchors: K for the JAGG gradient.
    """
    params = [p for p in parameters if p.requires_grad]
    t = torch.as_tensor(t, dtype=torch.float64).detach().cpu().flatten()
    steps = list(range(t.numel())) if steps is None else list(steps)
    saved = [None if p.grad is None else p.grad.detach().clone() for p in params]
    report = FidelityReport(window=window, anchors=anchors)
    estimator = Estimator(anchors=anchors)

    def group_grad(group_steps: tuple[int, ...], mode: str) -> torch.Tensor:
        for p in params:
            p.grad = None
        group_backward(
            lambda j: velocity(group_steps[j]),
            lambda j, v: step_loss(group_steps[j], v),
            t[list(group_steps)],
            mode,
            variant,
            estimator=estimator,
        )
        flat = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).to(torch.float64)
            for p in params
        ]
        return torch.cat(flat)

    try:
        for g in plan_groups(steps, window, 1.0, mode="jagg"):
            if len(g.steps) < window:
                continue  # a trailing partial group is always exact: nothing to compare
            g_exact = group_grad(g.steps, "exact")
            g_jagg = group_grad(g.steps, "jagg")
            g_ablate = group_grad(g.steps, "ablate")
            report.positions.append(g.position)
            report.steps.append(g.steps)
            report.cos_jagg.append(_cosine(g_jagg, g_exact))
            report.cos_ablate.append(_cosine(g_ablate, g_exact))
            n = g_exact.norm()
            report.norm_ratio_jagg.append(float(g_jagg.norm() / n) if n > 0 else float("nan"))
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    return report
