"""Communication per optimizer step with 2 CPU processes (gloo): what data parallelism costs each method.

(a) ``AllReduceSync`` (the trainer's DDP replacement): gradient all-reduces per optimizer step, next to the number of
backward calls — what a naive DDP that syncs in every backward would multiply its all-reduces by.
(b) FSDP2 (``fully_shard`` via ``shard_transformer``): parameter all-gathers issued *inside*
``torch.autograd.backward``, per group and per FSDP module. In torch 2.14 FSDP2 all-gathers with
``torch.distributed.all_gather_single`` (``_fsdp_collectives.DefaultAllGather``); the counter wraps it and its
siblings. The root module keeps its parameters unsharded from forward to backward (FSDP2 sets the root's
``post_forward_mesh_info`` to None), so only the other modules (the transformer blocks) all-gather during backward:
per-module figures divide by those. Expected: exact W, jagg-joint 1 (one batched anchor forward, one graph),
jagg-sequential 2.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from ..setup.json_read import read_json
from ..setup.storage import atomic_write_text

import torch
import torch.distributed as dist

from .models import (BenchError, ModelSpec, bench_method, build_policy, fits, make_experience, run_update, update_groups,
                     zero_grads)
from ..trainer.distributed import AllReduceSync, Fsdp2Sync, shard_transformer

__all__ = ["CollectiveCounter", "measure_comm", "ALLREDUCE_VARIANTS", "FSDP_VARIANTS"]

ALLREDUCE_VARIANTS = ("exact", "jagg-joint", "jagg-sequential", "ablate", "jagg-reuse")
FSDP_VARIANTS = ("exact", "jagg-joint", "jagg-sequential")
_OPS = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce", "reduce_scatter_single",
        "reduce_scatter_tensor")


class CollectiveCounter:
    """Counts ``torch.distributed`` collectives by name, split into calls made inside ``torch.autograd.backward``
    (``"backward"``) and elsewhere (``"other"``). A context manager: patches on enter, restores on exit."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self._in_backward = 0
        self._saved: dict[str, Callable] = {}

    def count(self, prefix: str, phase: str | None = None) -> int:
        return sum(n for (op, ph), n in self.counts.items() if op.startswith(prefix) and phase in (None, ph))

    def __enter__(self) -> "CollectiveCounter":
        self.counts.clear()
        for op in _OPS:
            if hasattr(dist, op):
                self._saved[op] = getattr(dist, op)
                setattr(dist, op, self._wrap(op, self._saved[op]))
        self._saved["backward"] = torch.autograd.backward
        original = self._saved["backward"]

        def backward(*args: Any, **kwargs: Any) -> Any:
            self._in_backward += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._in_backward -= 1

        torch.autograd.backward = backward
        return self

    def _wrap(self, op: str, fn: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[(op, "backward" if self._in_backward else "other")] += 1
            return fn(*args, **kwargs)

        return counted

    def __exit__(self, *exc: Any) -> None:
        torch.autograd.backward = self._saved.pop("backward")
        for op, fn in self._saved.items():
            setattr(dist, op, fn)
        self._saved.clear()


def _worker(rank: int, job: dict, folder: str) -> None:
    """One of the 2 processes: same model, same experience, same collectives; rank 0 writes the result."""
    from torch.distributed.fsdp import FSDPModule

    # Flux returns its output as a view; FSDP2 warns in case it is modified in place, which nothing here does.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    torch.set_num_threads(job["threads"])
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    try:
        spec = ModelSpec.from_json(job["spec"])
        policy = build_policy(spec)
        exp = make_experience(policy, spec, steps=job["steps"], batch=job["batch"], seed=job["seed"])
        params = policy.trainable_parameters()
        grad_mb = sum(p.numel() * p.element_size() for p in params) / 2**20
        counter = CollectiveCounter()

        # (a) One optimizer step per method: every group's backward, then AllReduceSync.reduce once.
        all_reduce = []
        for w in job["windows"]:
            for name in ALLREDUCE_VARIANTS:
                if not fits(name, w):
                    continue
                m = bench_method(name, w)
                groups = update_groups(exp, m)
                sync = AllReduceSync(world_size=2)
                zero_grads(policy)
                sync.start_step()
                with counter:
                    stats = run_update(policy, exp, m, groups, sync=sync)
                    sync.reduce(params)
                all_reduce.append({
                    "window": w, "variant": name, "groups": len(groups), "backward_calls": stats.backward_calls,
                    "all_reduces": sync.all_reduces, "all_reduce_calls": counter.count("all_reduce"),
                    "naive_ddp_all_reduces": stats.backward_calls * sync.all_reduces,
                })

        # (b) The same policy sharded with FSDP2 (blocks, then the root), gradient sync on the last backward only.
        zero_grads(policy)
        shard_transformer(policy.transformer)
        modules = [m for m in policy.transformer.modules() if isinstance(m, FSDPModule)]
        resharding = len(modules) - 1  # all but the root
        sync = Fsdp2Sync(policy.transformer)
        fsdp = []
        for w in job["windows"]:
            for name in FSDP_VARIANTS:
                m = bench_method(name, w)
                groups = update_groups(exp, m)
                zero_grads(policy)
                with counter:
                    stats = run_update(policy, exp, m, groups, sync=sync)
                during = counter.count("all_gather", "backward")
                fsdp.append({
                    "window": w, "variant": name, "groups": len(groups), "backward_calls": stats.backward_calls,
                    "all_gathers_backward": during, "all_gathers_forward": counter.count("all_gather", "other"),
                    "reduce_scatters": counter.count("reduce_scatter"),
                    "all_gathers_per_group_per_module": during / len(groups) / resharding,
                })
        if rank == 0:
            result = {"world_size": 2, "backend": "gloo", "threads_per_process": job["threads"],
                      "grad_mb": grad_mb, "bucket_mb": AllReduceSync(2).bucket_bytes / 2**20,
                      "fsdp_modules": len(modules), "fsdp_modules_resharding": resharding,
                      "all_gather_op": "torch.distributed.all_gather_single",
                      "allreduce": all_reduce, "fsdp2": fsdp}
            atomic_write_text(Path(folder) / "comm.json", json.dumps(result))
    finally:
        dist.destroy_process_group()


def measure_comm(spec: ModelSpec, *, windows: list[int], steps: int, batch: int, seed: int, threads: int) -> dict:
    """Spawn the 2 gloo processes on CPU (``jagg_frac`` 1.0: every group routed) and return rank 0's counts."""
    import torch.multiprocessing as mp

    cpu_spec = ModelSpec.from_json({**spec.to_json(), "device": "cpu"})
    job = {"spec": cpu_spec.to_json(), "windows": list(windows), "steps": steps, "batch": batch, "seed": seed,
           "threads": threads}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # inherited by the spawned processes
    with tempfile.TemporaryDirectory(prefix="jagg-bench-comm-") as folder:
        mp.spawn(_worker, args=(job, folder), nprocs=2, join=True)
        return read_json(Path(folder) / "comm.json", BenchError)
