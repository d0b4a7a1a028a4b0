"""The update stage's cost model (arXiv:2607.17572, §Method; docs/architecture.md), one pure function for the report
and the bench.

A step trained with autograd costs a forward and a backward (``f + b``); a JAGG middle step recomputed under
``no_grad`` costs one forward ``f0``; a velocity reused from the rollout costs nothing. With forward = 1 and
backward = 2 an exact group of W steps costs 3W, a JAGG group W + 4 (two anchors), so the ideal update speedup is
3W/(W + 4): 1.5x at W = 4, 2x at W = 8; with reuse 3W/6 = W/2; with K anchors 3W/(W + 2K) (W/K with reuse); a
random anchor (the unbiased JAGG) is one more graph and one no-grad forward less, so it costs what K + 1 anchors do
(24/14 = 1.71x at W = 8, K = 2). Over several groups (e.g. two groups of W = 4 on an 8-step window) the costs add:
3 × the trained steps over the sum.
"""

from __future__ import annotations

from .modes import EXACT_MODES

__all__ = ["update_cost", "ideal_speedup"]


def group_forwards(steps: int, mode: str, *, anchors: int, reuse: bool,
                   random_anchor: bool = False) -> tuple[int, int]:
    """(with-grad forwards, no-grad forwards) of one group of ``steps`` steps: exact (and exact_batched) keeps a graph
    per step; JAGG and the ablation keep ``anchors`` graphs and recompute the middle velocities without one, unless
    the rollout's are reused; JAGG's random anchor is one graph more and one no-grad forward less (per image: each
    image's drawn step is forwarded with grad instead, so the row-forwards add up to one forward)."""
    if mode in EXACT_MODES:
        return steps, 0
    k = min(anchors, steps)
    k += 1 if random_anchor and mode == "jagg" and k < steps else 0
    return k, 0 if reuse else steps - k


def update_cost(*, grad_forwards: float, nograd_forwards: float, f0: float = 1.0, f: float = 1.0,
                b: float = 2.0) -> float:
    """Cost of an update with ``grad_forwards`` graphs (forward + backward each) and ``nograd_forwards`` forwards."""
    return grad_forwards * (f + b) + nograd_forwards * f0


def ideal_speedup(*, steps: float, grad_forwards: float, nograd_forwards: float, f0: float = 1.0, f: float = 1.0,
                  b: float = 2.0) -> float:
    """Exact's cost for ``steps`` trained steps (one graph each) over the method's :func:`update_cost`."""
    cost = update_cost(grad_forwards=grad_forwards, nograd_forwards=nograd_forwards, f0=f0, f=f, b=b)
    return steps * (f + b) / cost if cost else float("nan")
