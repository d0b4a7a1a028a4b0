"""Peak memory of the update stage per variant, each in a fresh process (``python -m jagg_core.bench.memory JOB``).

A probe builds the model and the experience, notes the resident memory after setup, resets the kernel's peak-RSS
counter (``/proc/self/clear_refs`` ← 5), runs the update twice, and reports the peak minus the setup RSS; on a GPU
also ``torch.cuda.max_memory_allocated`` minus what was allocated after setup. A fresh process per variant keeps one
variant's allocator caches out of another's number. ``ru_maxrss`` is the fallback where the peak cannot be reset
(it cannot go below the setup peak, e.g. the rollout's, and after fork+exec may even carry the parent's).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import torch

from ..setup.storage import read_text
from .models import (BenchError, ModelSpec, bench_method, build_policy, make_experience, run_update, update_groups,
                     zero_grads)

__all__ = ["probe", "measure_memory", "MARK"]

MARK = "JAGG_BENCH_MEMORY "  # the probe's result line on stdout (libraries may print too)


def _status_mb(field: str) -> float | None:
    try:
        for line in read_text("/proc/self/status", OSError).splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux ≥ 4.0)
        return True
    except OSError:
        return False


def probe(job: dict) -> dict:
    """Run in the probe process: setup, reset the peak, the update twice, the peak over setup in MiB."""
    torch.set_num_threads(job["threads"])
    spec = ModelSpec.from_json(job["spec"])
    m = bench_method(job["variant"], job["window"])
    policy = build_policy(spec)
    exp = make_experience(policy, spec, steps=job["steps"], batch=job["batch"], seed=job["seed"])
    groups = update_groups(exp, m)
    gc.collect()
    cuda = policy.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(policy.device)
        torch.cuda.reset_peak_memory_stats(policy.device)
        allocated = torch.cuda.memory_allocated(policy.device)
    setup = _status_mb("VmRSS")
    reset = setup is not None and _reset_peak_rss()
    for _ in range(2):
        zero_grads(policy)
        stats = run_update(policy, exp, m, groups)
    if reset:
        peak, how = _status_mb("VmHWM"), "VmHWM reset after setup"
    else:
        setup = setup or 0.0
        peak, how = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "ru_maxrss"
    out = {"variant": m.name, "window": job["window"], "setup_rss_mb": setup, "peak_rss_mb": peak,
           "update_peak_mb": peak - setup, "method": how, "backward_calls": stats.backward_calls}
    if cuda:
        torch.cuda.synchronize(policy.device)
        out["cuda_update_peak_mb"] = (torch.cuda.max_memory_allocated(policy.device) - allocated) / 2**20
    return out


def measure_memory(spec: ModelSpec, variants: Sequence[str], *, window: int, steps: int, batch: int, seed: int,
                   threads: int) -> list[dict]:
    """One probe process per variant, in the given order; ``jagg_frac`` 1.0 (every group routed)."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    env.setdefault("HF_HUB_OFFLINE", "1")
    out = []
    for name in variants:
        job = {"spec": spec.to_json(), "variant": name, "window": window, "steps": steps, "batch": batch,
               "seed": seed, "threads": threads}
        res = subprocess.run([sys.executable, "-m", "jagg_core.bench.memory", json.dumps(job)], env=env,
                             capture_output=True, text=True)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith(MARK)]
        if res.returncode or not lines:
            tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise BenchError(f"the memory probe of {name} failed (exit {res.returncode}): {tail}")
        out.append(json.loads(lines[-1][len(MARK):]))
    return out


if __name__ == "__main__":
    print(MARK + json.dumps(probe(json.loads(sys.argv[1]))), flush=True)
