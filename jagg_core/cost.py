"""The update stage's cost model (arXiv:2607.17572, §Method; docs/architecture.md), one pure function for the report
and the bench.

A step trained with autograd costs a forward and a backward (``f + b``); a JAGG middle step recomputed under
``no_grad`` costs one forward ``f0``; a velocity reused from the rollout costs nothing. With forward = 1 and
backward = 2 an exact group of W steps costs 3W, a JAGG group W + 4 (two anchors), so the ideal update speedup is
3W/(W + 4): 1.5x at W = 4, 2x at W = 8; with reuse 3W/6 = W/2; with K anchors 3W/(W + 2K) (W/K with reuse); a
random anchor (the unbiased JAGG) is one more graph and one no-grad forward less, so it costs what K + 1 anchors do
(24/14 = 1.71x at W = 8, K = 2). Over several groups (e.g. two groups of W = 4 on an 8-step window) the costs add:
3 × the trained steps over the sum.

The backward's cost b (in forwards) is the model's (:func:`backward_factor`): 2 for a full fine-tune, 1 with LoRA
(the frozen base's weight gradients are never computed, only the activations'), one more with gradient
checkpointing (the recompute). With LoRA the gain of skipping a backward shrinks: 3W/(W + 4) becomes 2W/(W + 2),
1.33x at W = 4. A β > 0 KL adds a reference forward per trained step in every mode, and the steps a method leaves
exact (``jagg_frac`` < 1, a trailing partial group) cost what they cost the baseline: both dilute the speedup.
"""

from __future__ import annotations

from .modes import EXACT_MODES

__all__ = ["backward_factor", "group_forwards", "update_cost", "ideal_speedup"]


def backward_factor(*, lora: bool, checkpointing: bool) -> tuple[float, str]:
    """(b, why): a backward pass's cost in forwards, and the sentence that says why.

    A full fine-tune's backward computes the activations' gradients and the weights' (two matmuls per forward matmul):
    2. With LoRA the frozen base's weight gradients are skipped: 1 (measured 0.8–0.93 of a forward on a tiny SD3 on
    CPU, docs/trainers.md). Gradient checkpointing recomputes the forward inside the backward: one more.
    """
    b = 1.0 if lora else 2.0
    why = ("LoRA: the frozen base's weight gradients are skipped, only the activations' are computed"
           if lora else "full fine-tune: the activations' and the weights' gradients")
    if checkpointing:
        b += 1.0
        why += "; gradient checkpointing recomputes the forward"
    return b, why


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
