"""Prefect flow: the update-stage benchmark (`jagg bench`) as a flow run, e.g. on a quiet machine's worker."""

from __future__ import annotations

import dataclasses
import os

from prefect import flow

from jagg_core.bench import BUILTIN_MODELS, BenchConfig, BenchError
from tasks.bench import bench
from tasks.common import load

from .reproduce import sweep_name


@flow(name="jagg-bench", log_prints=True)
def bench_flow(
    model: str = "toy",
    windows: list[int] | None = None,
    fracs: list[float] | None = None,
    repeats: int | None = None,
    batch: int | None = None,
    steps: int | None = None,
    threads: int | None = None,
    memory: bool = True,
    comm: bool = True,
    out: str = "bench",
    write_docs: str | None = None,
    profile: str | None = None,
    mlflow: bool = True,
    sweep: str | None = None,
) -> list[str]:
    """Exact vs JAGG vs ablate side by side; returns the JSON files written.

    Args:
        model: toy | large | both (built-in, random weights); ignored with ``profile``.
        windows, fracs, repeats, batch, steps: as `jagg bench`; None keeps BenchConfig's default.
        profile: benchmark this profile's real policy instead (its weights and device).
        write_docs: also render the markdown tables to this repository-relative path.
    """
    if not profile and model not in (*BUILTIN_MODELS, "both"):
        raise BenchError(f"model {model!r} is not one of toy, large, both.")
    params = load(profile)
    given = {"windows": tuple(windows) if windows else None, "fracs": tuple(fracs) if fracs else None,
             "repeats": repeats, "batch": batch, "steps": steps}
    cfg = dataclasses.replace(BenchConfig(), **{k: v for k, v in given.items() if v is not None},
                              threads=threads or params.resources.num_threads or len(os.sched_getaffinity(0)),
                              memory=memory, comm=comm)
    models = list(BUILTIN_MODELS) if model == "both" else [model]
    paths = bench(params, cfg, models=models, profile=bool(profile), out=out, write_docs=write_docs, mlflow=mlflow,
                  sweep=sweep_name(sweep))
    return [str(p) for p in paths]
