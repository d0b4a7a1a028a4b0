"""Every method's update stage timed side by side: the speed figures no machine load can tilt.

Each training run times its own iterations at its own time, so on a shared machine two methods' times can differ by
what else the machine was doing (one fresh run printed JAGG's update at 3.12x the baseline's because the baseline's
rollout, the same work in every method, ran slower). This module times the *update stage* of every method of a
profile on one stored rollout of the run's own model and batch — the profile's base policy, ``sample.group_size`` x
``sample.prompts_per_iteration`` images of its training prompts, its micro-batches, its window and routing — in
rounds, each round every method once (and the rollout once) in a shuffled order; the figures are medians over rounds.
A load that comes and goes hits every method alike, so the *ratios* hold (docs/results.md, "Speed, side by side").

The ideal speedup is the cost model's (forward 1, backward 2; :func:`jagg_core.cost.ideal_speedup`) from the forwards
each method counted; a measured speedup above it is flagged, never reported as a gain.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..cost import ideal_speedup
from ..jagg import AUTO_FALLBACK_JAGG_FRAC, plan_groups
from ..policies.base import Policy
from ..setup.config import Params, ResolvedMethod
from ..setup.paths import Layout
from ..setup.provenance import fingerprint, speed_made_from
from ..setup.storage import atomic_write_text, finite_json, read_prompts
from ..trainer.rollout import rollout
from ..trainer.update import UpdateContext, UpdateStats, accumulate_gradients

__all__ = ["ABOVE_IDEAL_TOLERANCE", "side_by_side", "speed_rows"]

# A measured speedup above the cost model's ideal by more than this is flagged. Zero: any excess is flagged, noise
# included (the model predicts the benchmark's rows within 0.95-1.04, docs/benchmarks.md), so that no ratio beyond
# what the counted work allows is ever read as a gain.
ABOVE_IDEAL_TOLERANCE = 0.0
# What a null of speed.json (a number that is not one: NaN) stands for.
NULL_NOTE = "null: not a number (a ratio whose ideal or baseline is not a positive time), not measured"


def _clock(device: torch.device) -> float:
    if device.type == "cuda":  # kernels are asynchronous: time what ran, not what was queued
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _frac(method: ResolvedMethod) -> float:
    return AUTO_FALLBACK_JAGG_FRAC if method.jagg_frac == "auto" else float(method.jagg_frac)


class _Timer:
    """The stored rollout and one update per method, as the trainer's ``_optimizer_steps`` runs it (every chunk's
    gradients accumulated; the optimizer step itself, the same in every method, left out)."""

    def __init__(self, params: Params, policy: Policy, prompts: Sequence[str], seed: int):
        self.params, self.policy, self.seed = params, policy, seed
        self.prompts = list(prompts)
        self.traj = rollout(policy, self.prompts, list(range(len(self.prompts))), params.sample, seed=seed,
                            iteration=0, keep_velocities=True)
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(self.traj.batch_size, generator=gen)
        self.advantages = a.sign() * (a.abs() + 0.5)  # |A| >= 0.5: every image carries signal, as in a real batch
        self.rows = torch.arange(self.traj.batch_size)

    def _zero(self) -> None:
        for p in self.policy.trainable_parameters():
            p.grad = None

    def update(self, method: ResolvedMethod) -> tuple[float, UpdateStats]:
        ctx = UpdateContext(self.policy, method, self.params.sample, self.params.train)
        groups = plan_groups(self.traj.train_steps, method.window, _frac(method), mode=method.mode)
        stats = UpdateStats()
        self._zero()
        t0 = _clock(self.policy.device)
        for chunk in self.rows.tensor_split(self.params.train.optimizer_steps_per_epoch):
            stats.add(accumulate_gradients(ctx, self.traj, self.advantages, chunk, groups,
                                           reuse=method.reuse_rollout_velocity))
        seconds = _clock(self.policy.device) - t0
        self._zero()
        return seconds, stats

    def rollout(self) -> float:
        t0 = _clock(self.policy.device)
        rollout(self.policy, self.prompts, list(range(len(self.prompts))), self.params.sample, seed=self.seed,
                iteration=1)
        return _clock(self.policy.device) - t0


def _summary(xs: Sequence[float]) -> dict[str, Any]:
    s = sorted(xs)
    q1, q3 = statistics.quantiles(s, n=4, method="inclusive")[::2] if len(s) > 1 else (s[0], s[0])
    return {"median": statistics.median(s), "q1": q1, "q3": q3, "min": s[0], "max": s[-1], "n": len(s),
            "samples": list(xs)}


def side_by_side(params: Params, layout: Layout, methods: Sequence[str], *, policy: Policy, rounds: int = 7,
                 seed: int = 0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time the update stage of every method of ``methods`` interleaved on ``policy`` (the profile's own model).

    One warm-up update per method (which also counts its forwards and backwards), then ``rounds`` rounds, each running
    every method's update and one rollout once in a shuffled order (fixed seed). Returns the per-method medians and
    quartiles, the rollout's, and :func:`speed_rows`' table.
    """
    if rounds < 3:
        raise ValueError(f"rounds {rounds} must be at least 3 for a median that one disturbed round cannot move.")
    if not methods:
        raise ValueError("no method to time.")
    p = params.sample.prompts_per_iteration
    prompts = read_prompts(layout.train_prompts)[:p]
    timer = _Timer(params, policy, prompts, seed)
    resolved = {name: params.method(name) for name in methods}
    counts: dict[str, dict[str, float]] = {}
    for name, method in resolved.items():  # warm-up: allocator, caches, and the counts
        _, stats = timer.update(method)
        counts[name] = {k: float(getattr(stats, k)) for k in ("grad_forwards", "nograd_forwards",
                                                               "reused_velocities", "backward_calls")}
    timer.rollout()
    samples: dict[str, list[float]] = {name: [] for name in resolved}
    rollouts: list[float] = []
    rng = random.Random(seed)
    t_start = time.time()
    for r in range(rounds):
        order = [*resolved, "(rollout)"]
        rng.shuffle(order)
        for name in order:
            if name == "(rollout)":
                rollouts.append(timer.rollout())
            else:
                samples[name].append(timer.update(resolved[name])[0])
        if progress:
            progress(f"side by side: round {r + 1}/{rounds}")
    result = {
        "rounds": rounds, "seed": seed, "images": timer.traj.batch_size, "prompts": len(prompts),
        "trained_steps": list(timer.traj.train_steps), "threads": torch.get_num_threads(),
        "device": str(policy.device), "wall_seconds": round(time.time() - t_start, 2),
        "rollout": _summary(rollouts),
        "methods": {name: {"mode": resolved[name].mode, "window": resolved[name].window,
                           "jagg_frac": _frac(resolved[name]), "reuse": resolved[name].reuse_rollout_velocity,
                           "update": _summary(samples[name]), "counts": counts[name]} for name in resolved},
    }
    result["table"] = speed_rows(result)
    # what it timed, and its fingerprint: the report shows it only beside runs of the same settings
    made_from = speed_made_from(params, methods)
    result["made_from"], result["fingerprint"] = made_from, fingerprint(made_from)
    return result


def speed_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per method: its median update seconds, speedups against the per-step exact baseline and against the better
    of the two exact backwards (per step, batched), the cost model's ideal from its counted forwards, measured/ideal
    and a flag where the measurement is above the ideal by more than :data:`ABOVE_IDEAL_TOLERANCE`."""
    methods = result["methods"]
    med = {name: m["update"]["median"] for name, m in methods.items()}
    exact = next((n for n, m in methods.items() if m["mode"] == "exact"), None)
    batched = next((n for n, m in methods.items() if m["mode"] == "exact_batched"), None)
    best = min((med[n] for n in (exact, batched) if n), default=None)
    rows = []
    for name, m in methods.items():
        c = m["counts"]
        steps = c["grad_forwards"] + c["nograd_forwards"] + c["reused_velocities"]
        ideal = ideal_speedup(steps=steps, grad_forwards=c["grad_forwards"], nograd_forwards=c["nograd_forwards"])
        row: dict[str, Any] = {"method": name, "mode": m["mode"], "update_s": med[name],
                               "update_q1": m["update"]["q1"], "update_q3": m["update"]["q3"], "ideal": ideal}
        if exact:
            row["speedup"] = med[exact] / med[name]
            row["measured_over_ideal"] = row["speedup"] / ideal if ideal == ideal and ideal > 0 else float("nan")
            row["above_ideal"] = bool(row["speedup"] > ideal * (1 + ABOVE_IDEAL_TOLERANCE))
        if best is not None:
            row["speedup_vs_best_exact"] = best / med[name]
        rows.append(row)
    return rows


def write_result(result: dict[str, Any], path: Path) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    result, nulls = finite_json(result)  # strict JSON: a ratio with nothing to divide by is null, said in words
    if nulls:
        result["null"] = NULL_NOTE
    atomic_write_text(path, json.dumps(result, indent=2, allow_nan=False) + "\n")
