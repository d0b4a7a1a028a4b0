"""Update-stage timing: every variant on the same stored experience, interleaved, with the cost model's ideal.

A *cell* is one (variant, W, jagg_frac). Each repetition runs every cell once in a shuffled order (fixed seed), plus
one measurement of the policy's primitive costs at the micro-batch size (no-grad forward f0, with-grad forward f,
backward b), so slow drifts of a shared machine hit every cell alike. The ideal speedup of a cell is the cost model of
``jagg_core/cost.py`` evaluated with the measured f0, f, b: exact costs ``W·(f + b)`` per group, K-anchor JAGG
``(W − K)·f0 + K·(f + b)`` (the paper's JAGG: K = 2; the joint backward over two graphs ≈ 2 b), with reuse
``K·(f + b)``. The textbook figure is the same model with f0 = f = 1, b = 2: 3W/(W + 4), or W/2 with reuse.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..setup.config import ResolvedMethod
from ..jagg import Group
from ..cost import group_forwards, update_cost
from ..policies.base import Policy
from ..trainer.rollout import rollout
from ..trainer.update import ImageSteps, UpdateContext, UpdateStats, trajectory_fidelity
from .models import Experience, bench_method, fits, run_update, update_groups, zero_grads

__all__ = ["Cell", "plan_cells", "summarize", "time_cells", "ideal_cost", "call_cost", "call_cost_model",
           "textbook_speedup", "fidelity_by_anchors", "COUNT_KEYS", "PRIMITIVES"]

COUNT_KEYS = ("grad_forwards", "forward_calls", "nograd_forwards", "reused_velocities", "backward_calls")


@dataclass(frozen=True)
class Cell:
    """One timed configuration. Exact does not depend on the routing: it is one cell, at the largest W."""

    variant: str
    window: int
    jagg_frac: float | None  # None for exact

    @property
    def key(self) -> str:
        if self.variant == "exact":
            return "exact"
        if self.jagg_frac is None:  # exact-batched: one per W
            return f"{self.variant}/W{self.window}"
        return f"{self.variant}/W{self.window}/frac{self.jagg_frac:g}"


def plan_cells(windows: Sequence[int], fracs: Sequence[float], anchors: Sequence[int],
               variants: Sequence[str] = ()) -> list[Cell]:
    """Exact once (per step, W does not matter); per W exact-batched and, per jagg_frac, the registered variants; and
    K-anchor JAGG (K > 2) and the unbiased JAGG (a random anchor per image) at the largest W. ``variants``: only
    these beside exact (empty: every one)."""
    w_max = max(windows)
    names = ["jagg-joint", "jagg-sequential", "ablate", "jagg-reuse"]
    cells = [Cell("exact", w_max, None)]
    for w in windows:
        cells.append(Cell("exact-batched", w, None))
        extra = [*(f"jagg-k{k}" for k in anchors if k > 2), "jagg-unbiased"] if w == w_max else []
        for frac in fracs:
            cells += [Cell(n, w, frac) for n in names + extra if fits(n, w)]
    return [c for c in cells if not variants or c.variant == "exact" or c.variant in variants]


def summarize(samples: Sequence[float]) -> dict:
    """Median, quartiles (inclusive method), min/max of the repetitions, in seconds."""
    xs = sorted(samples)
    q1, q3 = statistics.quantiles(xs, n=4, method="inclusive")[::2] if len(xs) > 1 else (xs[0], xs[0])
    return {"median": statistics.median(xs), "q1": q1, "q3": q3, "min": xs[0], "max": xs[-1], "n": len(xs),
            "samples": list(samples)}


def _clock(device: torch.device) -> float:
    if device.type == "cuda":  # kernels are asynchronous: time what ran, not what was queued
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _counts(stats: UpdateStats) -> dict[str, int]:
    return {k: int(getattr(stats, k)) for k in COUNT_KEYS}


def _primitives_once(policy: Policy, velocity: Callable[[int], torch.Tensor],
                     velocity_batch: Callable[[Sequence[int]], list[torch.Tensor]], n: int) -> tuple[float, ...]:
    """(f0, f, b, f_n, b_n): one no-grad forward, one with-grad forward, one backward of the policy on one stored
    step; then a with-grad forward and its backward of ``n`` stored steps in one call (the batched case)."""
    dev = policy.device
    with torch.no_grad():
        t0 = _clock(dev)
        velocity(0)
        f0 = _clock(dev) - t0
    t0 = _clock(dev)
    v = velocity(0)
    f = _clock(dev) - t0
    s = torch.ones_like(v)
    t0 = _clock(dev)
    torch.autograd.backward([v], [s])
    b = _clock(dev) - t0
    del v
    zero_grads(policy)
    t0 = _clock(dev)
    vs = velocity_batch(list(range(n)))
    fn = _clock(dev) - t0
    t0 = _clock(dev)
    torch.autograd.backward(vs, [torch.ones_like(x) for x in vs])
    bn = _clock(dev) - t0
    del vs
    zero_grads(policy)
    return f0, f, b, fn, bn


PRIMITIVES = ("forward_nograd", "forward_grad", "backward", "forward_grad_batched", "backward_batched")


def time_cells(policy: Policy, exp: Experience, cells: Sequence[Cell], *, repeats: int, seed: int,
               progress: Callable[[str], None] | None = None, kept: Sequence[dict] = (),
               on_round: Callable[[int, dict], str | None] | None = None, bar: bool = False,
               name: str = "bench") -> tuple[list[dict], dict]:
    """Warm up and count once per cell (group by group), then ``repeats`` shuffled rounds of timed updates.

    ``kept``: rounds already timed (what ``on_round`` was given, e.g. read back from disk by
    :class:`~jagg_core.bench.rounds.RoundStore`): they are not timed again, and the rounds after them run in the
    order an uninterrupted run gives them. ``on_round(number, record)`` is called as each round ends (1-based; its
    seconds per cell and primitive); what it returns is added to the round's progress line. ``bar``: a tqdm bar
    (on a terminal), else progress lines through ``progress``.

    Returns (one dict per cell: groups, per-group counts, totals, time; the primitive costs f0, f, b).
    """
    timer = _CellTimer(policy, exp, n_batched=max(c.window for c in cells), seed=seed)
    weights = timer.warm_up(cells, progress)
    prim = timer.timed_rounds(cells, repeats, progress, kept=kept[:repeats], on_round=on_round, bar=bar,
                              weights=weights, name=name)
    out = []
    for cell in cells:
        res = timer.results[cell.key]
        res["time"] = summarize(res.pop("samples"))
        res["backward_time"] = summarize(res.pop("backward_seconds"))
        out.append(res)
    del timer.optimizer
    out_prim = {k: summarize(x) for k, x in prim.items()}
    out_prim["batched_steps"] = timer.n_batched
    return out, out_prim


ROUND_PIECES = ("primitives", "rollout", "optimizer")  # what a round times besides the cells
ROUND_PRIMITIVES = (*PRIMITIVES, "rollout", "optimizer_step")  # what a round records besides the cells


class _CellTimer:
    """What `time_cells` times: the cells' updates, the primitives (f0, f, b), a rollout and an optimizer step."""

    def __init__(self, policy: Policy, exp: Experience, *, n_batched: int, seed: int):
        self.policy, self.exp, self.n_batched, self.seed = policy, exp, n_batched, seed
        self.dev = policy.device
        step = exp.traj.train_steps[len(exp.traj.train_steps) // 2]
        # the primitives' forwards: the policy alone (the method only matters to the update, not to a forward)
        ctx = UpdateContext(policy, bench_method("exact", 2), exp.sample, exp.train, autocast=contextlib.nullcontext)
        self.velocity = ImageSteps(ctx, exp.traj, exp.rows, exp.advantages, [step], scale=1.0).velocity
        self.velocity_batch = ImageSteps(ctx, exp.traj, exp.rows, exp.advantages, exp.traj.train_steps[:n_batched],
                                            scale=1.0).velocity_batch
        # lr 1e-12 on zero gradients: the step costs what it costs and changes nothing
        self.optimizer = torch.optim.AdamW(list(policy.trainable_parameters()), lr=1e-12, weight_decay=0.0)
        self.plans: dict[str, tuple[ResolvedMethod, list[Group]]] = {}
        self.results: dict[str, dict] = {}

    def primitives(self) -> tuple[float, ...]:
        return _primitives_once(self.policy, self.velocity, self.velocity_batch, self.n_batched)

    def rollout_once(self) -> float:
        """A rollout of the experience's images over all its steps, as the trainer samples (no velocities kept)."""
        traj = self.exp.traj
        t0 = _clock(self.dev)
        rollout(self.policy, traj.prompts, list(range(len(traj.prompts))), self.exp.sample, seed=self.seed,
                iteration=1)
        return _clock(self.dev) - t0

    def optimizer_once(self) -> float:
        """One AdamW step over every trainable parameter (gradients present, as after an update)."""
        params = list(self.policy.trainable_parameters())
        for p in params:
            p.grad = torch.zeros_like(p)
        t0 = _clock(self.dev)
        self.optimizer.step()
        out = _clock(self.dev) - t0
        zero_grads(self.policy)
        return out

    def warm_up(self, cells: Sequence[Cell], progress: Callable[[str], None] | None) -> dict[str, float]:
        """Each group once on its own, which also gives the per-group counts from GroupStats. Returns each piece's
        seconds (what the progress estimate weighs a piece of a round by)."""
        seconds = {}
        for key, run in zip(ROUND_PIECES, (self.primitives, self.rollout_once, self.optimizer_once)):
            t0 = time.perf_counter()
            run()
            seconds[key] = time.perf_counter() - t0
        for i, cell in enumerate(cells):
            t0 = time.perf_counter()
            m = bench_method(cell.variant, cell.window, 1.0 if cell.jagg_frac is None else cell.jagg_frac)
            groups = update_groups(self.exp, m)
            self.plans[cell.key] = (m, groups)
            per_group = []
            for g in groups:
                zero_grads(self.policy)
                per_group.append({"position": g.position, "mode": g.mode, "steps": len(g.steps),
                                  **_counts(run_update(self.policy, self.exp, m, [g]))})
            self.results[cell.key] = {"key": cell.key, "variant": cell.variant, "mode": m.mode, "kind": m.variant,
                                      "anchors": m.anchors, "reuse": m.reuse_rollout_velocity,
                                      "window": cell.window, "jagg_frac": cell.jagg_frac, "per_group": per_group,
                                      "samples": [], "backward_seconds": []}
            seconds[cell.key] = time.perf_counter() - t0
            if progress:
                progress(f"warm-up {i + 1}/{len(cells)} {cell.key}")
        return seconds

    def timed_rounds(self, cells: Sequence[Cell], repeats: int, progress: Callable[[str], None] | None, *,
                     kept: Sequence[dict] = (), on_round: Callable[[int, dict], str | None] | None = None,
                     bar: bool = False, weights: dict[str, float] | None = None,
                     name: str = "bench") -> dict[str, list[float]]:
        """Every cell, the primitives, a rollout and an optimizer step once per round, in a shuffled order; the
        ``kept`` rounds taken as they were recorded (their shuffles drawn all the same: the later rounds' order is
        that of a run never stopped)."""
        from .progress import RoundsProgress, piece_label

        rng = random.Random(self.seed)
        prim: dict[str, list[float]] = {p: [] for p in ROUND_PRIMITIVES}
        meter = None
        if len(kept) < repeats:
            meter = RoundsProgress(name, weights or {}, repeats=repeats, done=len(kept), bar=bar, say=progress)
        try:
            for r in range(repeats):
                order = [c.key for c in cells] + list(ROUND_PIECES)
                rng.shuffle(order)
                if r < len(kept):
                    self._restore(kept[r], prim)
                    continue
                record: dict[str, dict] = {"seconds": {}, "backward_seconds": {}, "totals": {}, "primitives": {}}
                t_round = time.perf_counter()
                for key in order:
                    meter.piece(r + 1, piece_label(key))
                    if key == "primitives":
                        record["primitives"].update(zip(PRIMITIVES, self.primitives()))
                    elif key == "rollout":
                        record["primitives"]["rollout"] = self.rollout_once()
                    elif key == "optimizer":
                        record["primitives"]["optimizer_step"] = self.optimizer_once()
                    else:
                        t, bwd, totals = self._time_update(key)
                        record["seconds"][key], record["backward_seconds"][key] = t, bwd
                        record["totals"][key] = totals
                    meter.done(key)
                zero_grads(self.policy)
                record["wall_seconds"] = time.perf_counter() - t_round
                self._restore(record, prim)
                said = on_round(r + 1, record) if on_round else None
                if progress:
                    progress(f"round {r + 1}/{repeats} done in {record['wall_seconds']:.1f} s"
                             + (f" ({said})" if said else "") + f", about {meter.remaining()} left")
        finally:
            if meter is not None:
                meter.close()
        return prim

    def _restore(self, record: dict, prim: dict[str, list[float]]) -> None:
        """One round's record into the samples (a kept round's, or the one just timed)."""
        for name in ROUND_PRIMITIVES:
            prim[name].append(record["primitives"][name])
        for key, res in self.results.items():
            res["samples"].append(record["seconds"][key])
            res["backward_seconds"].append(record["backward_seconds"][key])
            res["totals"] = dict(record["totals"][key])

    def _time_update(self, key: str) -> tuple[float, float, dict[str, int]]:
        """One timed update of a cell: (seconds, backward seconds, counts)."""
        m, groups = self.plans[key]
        zero_grads(self.policy)
        t0 = _clock(self.dev)
        stats = run_update(self.policy, self.exp, m, groups)
        return _clock(self.dev) - t0, stats.backward_seconds, _counts(stats)


def ideal_cost(per_group: Sequence[dict], method: ResolvedMethod, *, f0: float, f: float, b: float) -> float:
    """The cost model's update time of these groups: exact ``W(f + b)``; K anchors ``(W − K) f0 + K (f + b)``, the
    middle forwards dropped with reuse."""
    total = 0.0
    for g in per_group:
        k, nograd = group_forwards(g["steps"], g["mode"], anchors=method.anchor_count,
                                   reuse=method.reuse_rollout_velocity, random_anchor=method.random_anchor is not None)
        total += update_cost(grad_forwards=k, nograd_forwards=nograd, f0=f0, f=f, b=b)
    return total


def call_cost_model(prim: dict) -> dict[str, float]:
    """The extended cost model's coefficients from the measured primitives: a with-grad forward call of n stored steps
    costs ``c_f + n·s_f``, a backward over n steps' graphs ``c_b + n·s_b`` (per-call cost + per-step cost, fitted
    through the 1-step and the ``batched_steps`` measurements; a negative per-call cost from noise is taken as 0), a
    no-grad forward of one step f0."""
    n = prim["batched_steps"]
    f1, fn = prim["forward_grad"]["median"], prim["forward_grad_batched"]["median"]
    b1, bn = prim["backward"]["median"], prim["backward_batched"]["median"]
    s_f, s_b = (fn - f1) / (n - 1), (bn - b1) / (n - 1)
    c_f, c_b = max(0.0, f1 - s_f), max(0.0, b1 - s_b)
    return {"f0": prim["forward_nograd"]["median"], "c_f": c_f, "s_f": f1 - c_f, "c_b": c_b, "s_b": b1 - c_b,
            "batched_steps": n}


def call_cost(per_group: Sequence[dict], coef: dict[str, float]) -> float:
    """A cell's update time under the extended model, from its counted calls: no-grad forwards (one step each),
    with-grad forward calls (the anchors of a joint group share one), backward calls (one per joint group)."""
    total = 0.0
    for g in per_group:
        nograd = g["nograd_forwards"]
        grad_calls = g["forward_calls"] - nograd
        total += (nograd * coef["f0"] + grad_calls * coef["c_f"] + g["grad_forwards"] * coef["s_f"] +
                  g["backward_calls"] * coef["c_b"] + g["grad_forwards"] * coef["s_b"])
    return total


def textbook_speedup(per_group: Sequence[dict], method: ResolvedMethod) -> float:
    """The cost model with forward = 1, backward = 2: 3W/(W + 4) per JAGG group, W/2 with reuse."""
    steps = sum(g["steps"] for g in per_group)
    return 3 * steps / ideal_cost(per_group, method, f0=1.0, f=1.0, b=2.0)


def fidelity_by_anchors(policy: Policy, exp: Experience, window: int, anchors: Sequence[int]) -> dict:
    """cos(K-anchor JAGG gradient, exact gradient) and cos(ablate, exact) per group, for each K, on the experience."""
    out = {"window": window, "anchors": {}}
    for k in anchors:
        ctx = UpdateContext(policy, bench_method(f"jagg-k{k}", window), exp.sample, exp.train)  # K anchors, joint
        rep = trajectory_fidelity(ctx, exp.traj, exp.advantages, exp.rows)
        out["anchors"][str(k)] = {"positions": rep.positions, "cos_jagg": rep.cos_jagg, "cos_ablate": rep.cos_ablate,
                                  "norm_ratio_jagg": rep.norm_ratio_jagg}
    zero_grads(policy)
    return out
