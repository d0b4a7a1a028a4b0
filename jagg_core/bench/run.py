"""One benchmark run of one model: timing, cost model, gradient fidelity, memory and communication, as one JSON dict.

The recipe: build the policy and one stored rollout; time every cell interleaved (:mod:`.timing`); turn the medians into
speedups over exact and compare them with the cost model's ideal from the measured primitive costs; gradient fidelity
for K anchors at the largest W; peak memory per variant in fresh processes (:mod:`.memory`); collective counts with
2 gloo processes (:mod:`.comm`).
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from .models import BenchError, ModelSpec, bench_method, build_policy, fits, make_experience
from .timing import (ROUND_PRIMITIVES, call_cost, call_cost_model, fidelity_by_anchors, ideal_cost, plan_cells,
                     textbook_speedup, time_cells)
from .comm import measure_comm
from .memory import measure_memory
from .rounds import RoundStore
from ..setup.storage import atomic_write_text, read_regular, read_text

__all__ = ["BenchConfig", "run_bench", "save_result", "machine_info", "round_settings", "MEMORY_VARIANTS", "SCHEMA"]

SCHEMA = 2  # 2: batched primitives, rollout and optimizer step, the per-call cost model, the iteration
MEMORY_VARIANTS = ("exact", "jagg-joint", "jagg-sequential", "ablate", "jagg-reuse")
FIDELITY_MAX_PARAMS = 300_000_000  # gradient_fidelity holds three float64 copies of the flat gradient


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. Times are per micro-batch of ``batch`` images over ``steps`` trained steps."""

    windows: tuple[int, ...] = (2, 4, 8)  # W values; K-anchor JAGG and fidelity at the largest
    fracs: tuple[float, ...] = (0.6, 1.0)  # jagg_frac values
    repeats: int = 7  # timed rounds (after one warm-up)
    batch: int = 4  # images per micro-batch (the update's forward batch)
    steps: int = 16  # T: trained steps, a multiple of every W so that groups are full
    threads: int = 1  # torch CPU threads of the timing process (and of each memory probe)
    memory: bool = True  # peak memory per variant (one process each)
    comm: bool = True  # collective counts with 2 gloo processes
    seed: int = 0
    variants: tuple[str, ...] = ()  # the variants timed beside exact (the baseline, always timed); empty: every one

    def validate(self) -> None:
        """One sentence naming the setting and the fix, before any work."""
        if not self.windows or any(w < 2 for w in self.windows) or len(set(self.windows)) != len(self.windows):
            raise BenchError(f"--windows {_csv(self.windows)} must be distinct integers ≥ 2, e.g. 2,4,8.")
        if not self.fracs or any(not 0.0 <= f <= 1.0 for f in self.fracs) or len(set(self.fracs)) != len(self.fracs):
            raise BenchError(f"--fracs {_csv(self.fracs)} must be distinct numbers in [0, 1], e.g. 0.6,1.0.")
        if self.repeats < 1:
            raise BenchError(f"--repeats {self.repeats} must be at least 1.")
        if self.batch < 1:
            raise BenchError(f"--batch {self.batch} must be at least 1.")
        if self.threads < 1:
            raise BenchError(f"--threads {self.threads} must be at least 1.")
        for name in self.variants:
            if name == "exact" or not _known_variant(name):
                raise BenchError(f"--variants {name!r} is not a variant timed beside exact; use names such as "
                                 f"jagg-joint,jagg-sequential,ablate,jagg-reuse,jagg-unbiased,exact-batched,jagg-k3.")
        bad = [w for w in self.windows if self.steps < w or self.steps % w]
        if bad:
            raise BenchError(f"--steps {self.steps} must be a multiple of every window (here {bad[0]}) so that "
                             f"groups are full; use e.g. {_lcm(self.windows) * 2}.")

    @property
    def anchors(self) -> tuple[int, ...]:
        """K values compared at the largest W (K = 2 is the paper's JAGG)."""
        return tuple(k for k in (2, 3, 4) if k <= max(self.windows))


def _known_variant(name: str) -> bool:
    try:
        bench_method(name, 2)
    except BenchError:
        return False
    return True


def _csv(xs) -> str:
    return ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in xs)


def _lcm(xs) -> int:
    import math

    out = 1
    for x in xs:
        out = out * x // math.gcd(out, x)
    return out


def machine_info(device: torch.device) -> dict:
    """Enough to judge a number: CPU model, cores, threads, versions, load, GPU."""
    cpu = "unknown"
    try:
        for line in read_text("/proc/cpuinfo", OSError).splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or cpu
    info = {
        "cpu": cpu, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(), "python": platform.python_version(),
        "platform": platform.platform(), "device": str(device), "loadavg_start": list(os.getloadavg()),
    }
    try:
        import diffusers

        info["diffusers"] = diffusers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _analyse(cells: list[dict], prim: dict, steps: int) -> dict:
    """Speedup over exact (medians of the same run), the ideal from measured costs, and their ratio; the same under the
    extended (per-call) cost model. Returns that model's coefficients."""
    exact = next(c for c in cells if c["mode"] == "exact")
    batched = {c["window"]: c for c in cells if c["variant"] == "exact-batched"}
    f0, f, b = (prim[k]["median"] for k in ("forward_nograd", "forward_grad", "backward"))
    coef = call_cost_model(prim)
    exact_calls = call_cost(exact["per_group"], coef)
    for c in cells:
        # Against the strongest exact baseline too: the same W, every step in one forward call and one backward.
        eb = batched.get(c["window"])
        c["speedup_vs_batched"] = eb["time"]["median"] / c["time"]["median"] if eb and c["mode"] != "exact" else None
        m = bench_method(c["variant"], c["window"])
        c["speedup"] = exact["time"]["median"] / c["time"]["median"]
        c["ideal_speedup"] = steps * (f + b) / ideal_cost(c["per_group"], m, f0=f0, f=f, b=b)
        c["measured_over_ideal"] = c["speedup"] / c["ideal_speedup"]
        c["ideal_calls_speedup"] = exact_calls / call_cost(c["per_group"], coef)
        c["measured_over_ideal_calls"] = c["speedup"] / c["ideal_calls_speedup"]
        c["textbook_speedup"] = textbook_speedup(c["per_group"], m)
        routed = [g for g in c["per_group"] if g["mode"] == c["mode"]]
        c["counts_per_group"] = ({k: x for k, x in routed[0].items() if k not in ("position", "mode")} if routed
                                 else None)
    return coef


def _iteration(cells: list[dict], prim: dict, steps: int) -> dict:
    """A GRPO iteration of one micro-batch built from measured parts: the rollout (all ``steps`` steps), the update
    (forward and backward, per method, every group routed) and one optimizer step; and MixGRPO's iteration, whose
    sliding window of W steps is the only trained group: the same rollout, the update of one group (the cell's time
    over its ``steps / W`` groups) and the optimizer step."""
    roll, opt = prim["rollout"]["median"], prim["optimizer_step"]["median"]
    full = [c for c in cells if c["jagg_frac"] in (None, 1.0)]
    breakdown = []
    for c in full:
        t, bwd = c["time"]["median"], c["backward_time"]["median"]
        breakdown.append({"key": c["key"], "variant": c["variant"], "window": c["window"],
                          "phases": {"rollout": roll, "update forward": t - bwd, "update backward": bwd,
                                     "optimizer": opt},
                          "iteration_s": roll + t + opt})
    mix = []
    for w in sorted({c["window"] for c in full if c["mode"] != "exact"}):
        per_group = {}
        for c in full:
            if c["mode"] == "exact" or c["window"] == w:
                per_group[c["variant"]] = c["time"]["median"] * w / steps
        base = roll + per_group["exact"] + opt
        best = roll + min(per_group["exact"], per_group.get("exact-batched", math.inf)) + opt
        for variant, t in per_group.items():
            it = roll + t + opt
            mix.append({"window": w, "variant": variant, "update_s": t, "iteration_s": it,
                        "iteration_speedup": base / it, "iteration_speedup_vs_best_exact": best / it,
                        "update_share": t / it})
    return {"rollout_steps": steps, "breakdown": breakdown, "mix_grpo": mix}


def run_bench(spec: ModelSpec, cfg: BenchConfig, *, progress: Callable[[str], None] | None = None,
              bar: bool = False, rounds_dir: str | Path | None = None) -> dict:
    """The whole benchmark of one model (see the module docstring).

    ``rounds_dir``: where each timed round is kept as it ends (:mod:`.rounds`); the rounds kept there for the same
    settings are not timed again. Nothing else is written. ``bar``: the timed rounds' progress as a tqdm bar (on a
    terminal), else as lines through ``progress``.

    Runs with ``cfg.threads`` torch threads and gives the caller's thread count back afterwards (a process-wide
    setting: a caller that trains next must not inherit it).
    """
    cfg.validate()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run_bench(spec, cfg, progress, bar, rounds_dir)
    finally:
        torch.set_num_threads(threads)


def round_settings(spec: ModelSpec, cfg: BenchConfig, machine: dict) -> dict:
    """What a kept round was timed with (:mod:`.rounds`): the settings a round's times depend on, the model and the
    machine (its load left out); not ``repeats``, the memory probes or the communication counts."""
    model = spec.to_json()
    if spec.kind == "profile" and spec.params_path and Path(spec.params_path).is_file():
        import hashlib

        model["params_sha256"] = hashlib.sha256(read_regular(spec.params_path, BenchError)).hexdigest()
    timing = {k: v for k, v in asdict(cfg).items() if k not in ("repeats", "memory", "comm")}
    return {"timing": timing, "model": model,
            "machine": {k: v for k, v in machine.items() if not k.startswith("loadavg")}}


def _round_line(record: dict, cfg: BenchConfig, path: Path | None) -> str:
    """A finished round's ratio: the default variant (jagg-joint, the largest jagg_frac) over exact, per W."""
    secs, frac = record["seconds"], max(cfg.fracs)
    ratios = ", ".join(f"W {w} {secs['exact'] / secs[k]:.2f}×" for w in cfg.windows
                       if (k := f"jagg-joint/W{w}/frac{frac:g}") in secs and secs[k] > 0)
    return f"jagg-joint over exact this round: {ratios}" + (f"; kept in {path}" if path else "")


def _run_bench(spec: ModelSpec, cfg: BenchConfig, progress: Callable[[str], None] | None, bar: bool,
               rounds_dir: str | Path | None) -> dict:
    say = progress or (lambda msg: None)
    torch.manual_seed(cfg.seed)
    created = _dt.datetime.now().astimezone()

    # Setup: the policy and one stored rollout.
    policy = build_policy(spec)
    machine = machine_info(policy.device)
    exp = make_experience(policy, spec, steps=cfg.steps, batch=cfg.batch, seed=cfg.seed)
    n_params = sum(p.numel() for p in policy.trainable_parameters())
    say(f"{spec.name}: {n_params / 1e6:.2f} M trainable parameters, latent {tuple(policy.latent_shape())}, "
        f"{cfg.steps} steps, batch {cfg.batch}, {cfg.threads} thread(s)")

    # Timing, interleaved (each round kept as it ends), then the cost model.
    w_max = max(cfg.windows)
    plan = plan_cells(cfg.windows, cfg.fracs, cfg.anchors, cfg.variants)
    store = (RoundStore(rounds_dir, round_settings(spec, cfg, machine), name=spec.name, say=say)
             if rounds_dir is not None else None)
    kept = store.open([c.key for c in plan], ROUND_PRIMITIVES) if store else []
    try:
        def on_round(number: int, record: dict) -> str:
            return _round_line(record, cfg, store.save(number, record) if store else None)

        cells, prim = time_cells(policy, exp, plan, repeats=cfg.repeats, seed=cfg.seed,
                                 progress=lambda m: say(f"{spec.name}: timing {m}"), kept=kept, on_round=on_round,
                                 bar=bar, name=spec.name)
    finally:
        if store:
            store.close()
    cost_model = _analyse(cells, prim, cfg.steps)
    iteration = _iteration(cells, prim, cfg.steps)

    # Speed vs fidelity: K anchors at the largest W.
    if n_params > FIDELITY_MAX_PARAMS:
        fidelity = {"window": w_max, "skipped": f"{n_params / 1e9:.1f} B trainable parameters: gradient_fidelity's "
                                                f"float64 copies of the flat gradient would not fit"}
    else:
        say(f"{spec.name}: gradient fidelity, W = {w_max}, K = {_csv(cfg.anchors)}")
        fidelity = fidelity_by_anchors(policy, exp, w_max, cfg.anchors)
    device = policy.device
    del policy, exp
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the memory probes run on the same GPU

    memory, comm = _memory_and_comm(spec, cfg, w_max, say)
    machine["loadavg_end"] = list(os.getloadavg())
    return {
        "schema": SCHEMA,
        "created": created.isoformat(timespec="seconds"),
        "model": {"name": spec.name, "kind": spec.kind, "spec": spec.to_json(), "trainable_params": n_params,
                  "weights": "random" if spec.kind == "builtin" else "profile"},
        "config": {**asdict(cfg), "anchors": list(cfg.anchors)},
        "machine": machine,
        "resumed_rounds": min(len(kept), cfg.repeats),  # timed rounds read back from a stopped run of the same settings
        "primitives": prim,
        "cost_model": cost_model,
        "cells": cells,
        "iteration": iteration,
        "fidelity": fidelity,
        "memory": memory,
        "comm": comm,
    }


def _memory_and_comm(spec: ModelSpec, cfg: BenchConfig, w_max: int, say: Callable[[str], None]) -> tuple[dict, dict]:
    """The bench's two measurements in processes of their own: each variant's peak memory, and the gradient
    communication of two gloo processes (or why each was skipped)."""
    memory: dict = {"skipped": "--no-memory"}
    if cfg.memory:
        names = [n for n in (*MEMORY_VARIANTS, *(f"jagg-k{k}" for k in cfg.anchors if k > 2))
                 if fits(n, w_max) and (not cfg.variants or n == "exact" or n in cfg.variants)]
        say(f"{spec.name}: peak memory, one process per variant ({len(names)})")
        rows = measure_memory(spec, names, window=w_max, steps=cfg.steps, batch=cfg.batch, seed=cfg.seed,
                              threads=cfg.threads)
        peak = {r["variant"]: r["update_peak_mb"] for r in rows}
        checks = ({"sequential_le_joint": peak["jagg-sequential"] <= peak["jagg-joint"]}
                  if {"jagg-sequential", "jagg-joint"} <= set(peak) else {})
        memory = {"window": w_max, "jagg_frac": 1.0, "variants": rows, "checks": checks}
    comm: dict = {"skipped": "--no-comm"}
    if cfg.comm and spec.kind != "builtin":
        comm = {"skipped": "measured on the built-in models only (two CPU processes cannot hold a real backbone); "
                           "the counts do not depend on the model"}
    elif cfg.comm:
        say(f"{spec.name}: communication, 2 gloo processes")
        comm = measure_comm(spec, windows=list(cfg.windows), steps=cfg.steps, batch=cfg.batch, seed=cfg.seed,
                            threads=max(1, cfg.threads // 2))
    return memory, comm


def save_result(result: dict, out_dir: str | Path) -> Path:
    """``<out_dir>/<timestamp>-<model>.json`` (written atomically)."""
    stamp = _dt.datetime.fromisoformat(result["created"]).strftime("%Y%m%dT%H%M%S")
    path = Path(out_dir) / f"{stamp}-{result['model']['name']}.json"
    atomic_write_text(path, json.dumps(result, indent=1) + "\n")
    return path
