"""Prefect flow: the update-stage benchmark (`jagg bench`) as a flow run, e.g. on a quiet machine's worker."""

from __future__ import annotations

import os

from prefect import flow

from jagg_core.bench import BUILTIN_MODELS, BenchConfig, BenchError
from tasks.bench import bench
from tasks.common import load


@flow(name="jagg-bench", log_prints=True)
def bench_flow(
    model: str = "toy",
    windows: list[int] | None = None,
    fracs: list[float] | None = None,
    repeats: int = 7,
    batch: int = 4,
    steps: int = 16,
    threads: int | None = None,
    memory: bool = True,
    comm: bool = True,
    out: str = "bench",
    write_docs: str | None = None,
    profile: str | None = None,
    mlflow: bool = True,
) -> list[str]:
    """Exact vs JAGG vs ablate side by side; returns the JSON files written.

    Args:
        model: toy | large | both (built-in, random weights); ignored with ``profile``.
        windows: group sizes W (default 2, 4, 8).
        fracs: jagg_frac values (default 0.6, 1.0).
        profile: benchmark this profile's real policy instead (its weights and device).
        write_docs: also render the markdown tables to this repository-relative path.
    """
    if not profile and model not in (*BUILTIN_MODELS, "both"):
        raise BenchError(f"model {model!r} is not one of toy, large, both.")
    params = load(profile)
    cfg = BenchConfig(windows=tuple(windows or (2, 4, 8)), fracs=tuple(fracs or (0.6, 1.0)), repeats=repeats,
                      batch=batch, steps=steps,
                      threads=threads or params.resources.num_threads or len(os.sched_getaffinity(0)),
                      memory=memory, comm=comm)
    models = list(BUILTIN_MODELS) if model == "both" else [model]
    paths = bench(params, cfg, models=models, profile=bool(profile), out=out, write_docs=write_docs, mlflow=mlflow)
    return [str(p) for p in paths]
