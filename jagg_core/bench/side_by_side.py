"""Every method's update stage timed side by side: the speed figures no machine load can tilt.

Each training run times its own iterations at its own time, so on a shared machine two methods' times can differ by
what else the machine was doing (one fresh run printed JAGG's update at 3.12x the baseline's because the baseline's
rollout, the same work in every method, ran slower). This module times the *update stage* of every method of a
profile on one stored rollout of the run's own model and batch — the profile's base policy, ``sample.group_size`` x
``sample.prompts_per_iteration`` images of its training prompts, its micro-batches, its window and routing — in
rounds, each round every method once (and the rollout once) in a shuffled order. A load that comes and goes hits every
method alike, so the *ratios* hold (docs/results.md, "Speed, side by side").

Interleaving alone does not hold on an oversubscribed machine (a test suite beside it on 2 cores: every update 4x
slower, the ratios tilted by 0.3x). So each piece is timed by two clocks: the wall clock, and the device's own -- on a
CPU the calling thread's CPU time (``time.thread_time``; with one torch thread every kernel of the update, backward
included, runs in that thread, and the time another process holds the core is not counted), on a GPU CUDA events.
A method's figure is the mean of its fastest half of the rounds (``fastest_half``): what disturbs a thread's CPU time
-- caches another process emptied, a core shared under the hypervisor -- only adds to it, so the fastest rounds are
the least disturbed, and averaging half of them keeps one lucky round from deciding (medians moved the ratios by up
to 9% between a quiet run and one beside three busy processes, the fastest half by under 5%: docs/timings.md). The
ratios are taken from the steadier clock (the smaller spread of its fastest half, :func:`steadier_clock`); a round
whose wall time exceeds its CPU time by more than :data:`DISTURBED` is named (:func:`disturbed_rounds`). Where even
the steadier clock's fastest half spreads more than :data:`TRUSTED_SPREAD`, or where the load kept the thread off its
core most of the time (the median round's wall time over :data:`MAX_WALL_OVER_CPU` times its CPU time: beside three
busy processes on 2 cores the CPU time itself then grew by the load's cost, cold caches after every switch, and
unequally -- the per-step baseline's by 17%, exact-batched's not at all, in the same rounds: docs/timings.md), the
measurement says it cannot be trusted and the report shows that instead of its figures.

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
from ..setup.json_read import read_json
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
# A round is disturbed where its pieces' wall time exceeds their CPU time by more than this share (the thread waited
# for a core that long); on a GPU, where the host's own time is in the wall clock, beyond the quietest round's ratio.
DISTURBED = 0.10
# The figures are trusted where the chosen clock's fastest half of the rounds spreads at most this much ((max - min) /
# mean, the worst method's): the mean of three or more such rounds is then within about 5% of its value.
TRUSTED_SPREAD = 0.15
# Past this wall / CPU time in the median round the thread held its core less than half of the time, and its CPU time
# is no longer the work's alone (module docstring).
MAX_WALL_OVER_CPU = 2.0
# What a null of speed.json (a number that is not one: NaN) stands for.
NULL_NOTE = "null: not a number (a ratio whose ideal or baseline is not a positive time), not measured"


class _Stopwatch:
    """One timed piece by two clocks: ``wall`` (seconds) and ``own``, the device's -- the calling thread's CPU seconds
    (valid with one torch thread: ``own_clock`` is None otherwise) or the GPU's, by CUDA events."""

    def __init__(self, device: torch.device):
        self.device = device
        self.own_clock = ("cuda" if device.type == "cuda" else
                          "cpu" if torch.get_num_threads() == 1 else None)

    def __enter__(self) -> "_Stopwatch":
        if self.device.type == "cuda":  # kernels are asynchronous: time what ran, not what was queued
            torch.cuda.synchronize(self.device)
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._t0, self._c0 = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            self._events[1].record()
            torch.cuda.synchronize(self.device)
        self.wall = time.perf_counter() - self._t0
        if self.own_clock == "cuda":
            self.own = self._events[0].elapsed_time(self._events[1]) / 1000.0
        else:
            self.own = time.thread_time() - self._c0 if self.own_clock == "cpu" else float("nan")


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

    def update(self, method: ResolvedMethod) -> tuple[_Stopwatch, UpdateStats]:
        ctx = UpdateContext(self.policy, method, self.params.sample, self.params.train)
        groups = plan_groups(self.traj.train_steps, method.window, _frac(method), mode=method.mode)
        stats = UpdateStats()
        self._zero()
        with _Stopwatch(self.policy.device) as watch:
            for chunk in self.rows.tensor_split(self.params.train.optimizer_steps_per_epoch):
                stats.add(accumulate_gradients(ctx, self.traj, self.advantages, chunk, groups,
                                               reuse=method.reuse_rollout_velocity))
        self._zero()
        return watch, stats

    def rollout(self) -> _Stopwatch:
        with _Stopwatch(self.policy.device) as watch:
            rollout(self.policy, self.prompts, list(range(len(self.prompts))), self.params.sample, seed=self.seed,
                    iteration=1)
        return watch


def _summary(xs: Sequence[float]) -> dict[str, Any]:
    s = sorted(xs)
    q1, q3 = statistics.quantiles(s, n=4, method="inclusive")[::2] if len(s) > 1 else (s[0], s[0])
    fastest = s[: max(1, len(s) // 2)]
    return {"fastest_half": statistics.fmean(fastest), "median": statistics.median(s), "q1": q1, "q3": q3,
            "min": s[0], "max": s[-1], "n": len(s), "samples": list(xs)}


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
    pieces = [*resolved, ROLLOUT]
    times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "own": []} for n in pieces}  # piece -> clock -> rounds
    own_clock = _Stopwatch(policy.device).own_clock
    rng = random.Random(seed)
    t_start = time.time()
    for r in range(rounds):
        order = list(pieces)
        rng.shuffle(order)
        for name in order:
            watch = timer.rollout() if name == ROLLOUT else timer.update(resolved[name])[0]
            times[name]["wall"].append(watch.wall)
            times[name]["own"].append(watch.own)
        if progress:
            progress(f"side by side: round {r + 1}/{rounds}")
    clocks = {"wall": {n: t["wall"] for n, t in times.items()}}
    if own_clock:
        clocks[own_clock] = {n: t["own"] for n, t in times.items()}
    chosen, spreads = steadier_clock({c: {n: v for n, v in by.items() if n != ROLLOUT} for c, by in clocks.items()})
    by_round = [(sum(t["wall"][r] for t in times.values()), sum(t["own"][r] for t in times.values()))
                for r in range(rounds)]
    disturbed = disturbed_rounds(by_round, own_clock)
    held = statistics.median(w / c for w, c in by_round) if own_clock == "cpu" else 1.0  # wall / CPU, median round
    result = {
        "rounds": rounds, "seed": seed, "images": timer.traj.batch_size, "prompts": len(prompts),
        "trained_steps": list(timer.traj.train_steps), "threads": torch.get_num_threads(),
        "device": str(policy.device), "wall_seconds": round(time.time() - t_start, 2),
        # the clock the figures are from, each clock's spread, the rounds a load disturbed, and whether to trust them
        "clock": chosen, "spread": spreads, "disturbed_rounds": disturbed,
        "trusted": spreads[chosen] <= TRUSTED_SPREAD and held <= MAX_WALL_OVER_CPU,
        "rollout": {**_summary(clocks[chosen][ROLLOUT]), "clocks": {c: _summary(v[ROLLOUT]) for c, v in clocks.items()}},
        "methods": {name: {"mode": resolved[name].mode, "window": resolved[name].window,
                           "jagg_frac": _frac(resolved[name]), "reuse": resolved[name].reuse_rollout_velocity,
                           "update": _summary(clocks[chosen][name]),
                           "clocks": {c: _summary(v[name]) for c, v in clocks.items()},
                           "counts": counts[name]} for name in resolved},
    }
    if held > MAX_WALL_OVER_CPU:
        result["untrusted"] = (f"the machine's load kept its thread off the core most of the time (wall time "
                               f"{held:.1f} times its CPU time in the median round), which makes even the CPU time "
                               f"grow with the load, unequally by method; time it again on a quieter machine")
    elif not result["trusted"]:
        result["untrusted"] = (f"its rounds spread too much to trust a ratio: the fastest half of a method's rounds "
                               f"{spreads[chosen]:.0%} apart by the steadier clock ({chosen}), more than "
                               f"{TRUSTED_SPREAD:.0%}; time it again on a quieter machine")
    result["table"] = speed_rows(result)
    # what it timed, and its fingerprint: the report shows it only beside runs of the same settings
    made_from = speed_made_from(params, methods)
    result["made_from"], result["fingerprint"] = made_from, fingerprint(made_from)
    return result


ROLLOUT = "(rollout)"  # the rollout's piece of a round, beside the methods' updates


def _spread(xs: Sequence[float]) -> float:
    """(max - min) / mean of a clock's fastest half of the rounds; infinite where it has no finite positive mean."""
    if not xs or any(x != x for x in xs):
        return float("inf")
    fastest = sorted(xs)[: max(1, len(xs) // 2)]
    mean = statistics.fmean(fastest)
    return (fastest[-1] - fastest[0]) / mean if mean > 0 else float("inf")


def steadier_clock(clocks: dict[str, dict[str, Sequence[float]]]) -> tuple[str, dict[str, float]]:
    """The clock whose rounds spread least (its worst method's :func:`_spread`), and every clock's spread;
    ``clocks``: clock -> method -> seconds per round. A tie goes to the wall clock (the first)."""
    spreads = {c: max((_spread(v) for v in by.values()), default=float("inf")) for c, by in clocks.items()}
    return min(spreads, key=spreads.__getitem__), spreads


def disturbed_rounds(by_round: Sequence[tuple[float, float]], own_clock: str | None) -> list[dict[str, Any]]:
    """The rounds a load disturbed, by their (wall, own) seconds summed over the round's pieces: on a CPU where the
    wall time exceeds the thread's CPU time by more than :data:`DISTURBED` (the thread waited that long for a core);
    on a GPU beyond the quietest round's wall / GPU ratio by as much. None without a device clock (several threads)."""
    if own_clock is None:
        return []
    ratios = [wall / own if own > 0 else float("inf") for wall, own in by_round]
    quiet = 1.0 if own_clock == "cpu" else min(ratios)
    return [{"round": r + 1, "wall_over_" + own_clock: round(x, 3)} for r, x in enumerate(ratios)
            if x > quiet * (1 + DISTURBED)]


def speed_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per method: its update seconds (the mean of its fastest half of the rounds), speedups against the per-step exact baseline and against the better
    of the two exact backwards (per step, batched), the cost model's ideal from its counted forwards, measured/ideal
    and a flag where the measurement is above the ideal by more than :data:`ABOVE_IDEAL_TOLERANCE`."""
    methods = result["methods"]
    med = {name: m["update"].get("fastest_half", m["update"]["median"]) for name, m in methods.items()}
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


def write_result(result: dict[str, Any], path: Path) -> Path:
    """Write ``result`` to ``path`` (``runs/<outputs>/speed.json``); returns where it went. A measurement that cannot
    be trusted does not replace a trusted one of the same settings (the same fingerprint): it goes beside it, to
    :data:`UNTRUSTED_ASIDE`, and the trusted figures stay what the report shows (a `dvc repro` or `jagg speed` on a
    busy machine used to put "cannot be trusted" in place of good figures)."""
    import json

    if result.get("trusted") is False and _trusted_at(path, result.get("fingerprint")):
        path = path.with_name(UNTRUSTED_ASIDE)
    path.parent.mkdir(parents=True, exist_ok=True)
    result, nulls = finite_json(result)  # strict JSON: a ratio with nothing to divide by is null, said in words
    if nulls:
        result["null"] = NULL_NOTE
    atomic_write_text(path, json.dumps(result, indent=2, allow_nan=False) + "\n")
    return path


UNTRUSTED_ASIDE = "speed.untrusted.json"


def _trusted_at(path: Path, made: Any) -> bool:
    """Whether ``path`` holds a trusted measurement whose fingerprint is ``made`` (absent or unreadable: no)."""
    try:
        old = read_json(path, ValueError, limit=64 << 20)
    except ValueError:
        return False
    return isinstance(old, dict) and old.get("trusted") is True and made is not None and old.get("fingerprint") == made
