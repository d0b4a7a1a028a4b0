"""Data parallelism for the update stage: gradients are synchronised once per optimizer step, whatever the method.

PyTorch's DDP decides at *forward* time whether a backward will all-reduce, and its reducer marks each parameter
ready once per backward: the joint JAGG variant (two anchor forwards, one backward over both graphs) breaks both
assumptions. So data-parallel training here keeps the module unwrapped, accumulates local gradients over every
backward call of the optimizer step, and averages them with one coalesced all-reduce (DDP's bucketed semantics,
without its forward-time bookkeeping). Under FSDP2 (``fully_shard``) the reduce-scatter happens inside backward;
gradient sync is switched on only for the last backward call of the optimizer step.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

__all__ = ["GradSync", "NoSync", "AllReduceSync", "Fsdp2Sync", "gather_objects", "make_grad_sync", "shard_transformer"]


class GradSync:
    """How gradients of one optimizer step are synchronised across processes."""

    all_reduces: int = 0  # collective calls issued by reduce() in the current optimizer step
    # Parameters sharded over processes (FSDP2): every rank must run the same collectives (no rank may skip rows),
    # optimizer state is gathered to save, and no rank holds full gradients (no fidelity probe).
    sharded: bool = False
    final_group: bool = False  # set by the trainer before the optimizer step's last group

    def start_step(self) -> None:
        self.all_reduces = 0

    def before_backward(self, last: bool) -> None:
        """Called before each backward call; ``last`` for the final one of the optimizer step."""

    def reduce(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Called once after all backward calls of the optimizer step."""


class NoSync(GradSync):
    """One process."""


class AllReduceSync(GradSync):
    """Average the accumulated gradients over processes with coalesced all-reduces of ≤ ``bucket_mb`` each."""

    def __init__(self, world_size: int, bucket_mb: float = 25.0):
        self.world_size = world_size
        self.bucket_bytes = int(bucket_mb * 2**20)

    def reduce(self, params: Iterable[torch.nn.Parameter]) -> None:
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:  # a parameter this rank never used still takes part in the sum
                p.grad = torch.zeros_like(p)
        buckets: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in params:
            nbytes = p.grad.numel() * p.grad.element_size()
            if buckets[-1] and (size + nbytes > self.bucket_bytes or p.grad.dtype != buckets[-1][0].grad.dtype):
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += nbytes
        for bucket in buckets:
            if not bucket:
                continue
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            dist.all_reduce(flat)
            self.all_reduces += 1
            flat /= self.world_size
            offset = 0
            for p in bucket:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n


class Fsdp2Sync(GradSync):
    """FSDP2: reduce-scatter only in the last backward call of the optimizer step (accumulate unsharded before)."""

    sharded = True

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def before_backward(self, last: bool) -> None:
        self.module.set_requires_gradient_sync(bool(last and self.final_group))


def process_group():
    """``torch.distributed`` when a process group is initialised, else None (one process)."""
    return dist if dist.is_available() and dist.is_initialized() else None


def gather_objects(obj: object) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def shard_transformer(transformer: torch.nn.Module, block_classes: Iterable[str] | None = None) -> torch.nn.Module:
    """``fully_shard`` every transformer block, then the root.

    Args:
        block_classes: class names of the blocks (an accelerate FSDP config's ``fsdp_transformer_layer_cls_to_wrap``);
            default: the members of ``transformer_blocks`` and ``single_transformer_blocks`` (Flux, SD3, Qwen-Image)
            and of ``blocks`` (Wan).
    """
    from torch.distributed.fsdp import fully_shard

    names = set(block_classes or ())
    module = getattr(transformer, "base_model", transformer)  # through a peft wrapper
    if names:
        blocks = [m for m in module.modules() if type(m).__name__ in names]
        if not blocks:
            raise ValueError(f"no module of class {sorted(names)} to shard in {type(module).__name__}.")
    else:
        blocks = [b for name in ("transformer_blocks", "single_transformer_blocks", "blocks")
                  for b in getattr(getattr(module, "model", module), name, [])]
    for block in blocks:
        fully_shard(block)
    fully_shard(transformer)
    return transformer


def make_grad_sync(strategy: str, world_size: int, module: torch.nn.Module) -> GradSync:
    if world_size == 1:
        return NoSync()
    if strategy == "fsdp":
        return Fsdp2Sync(module)
    return AllReduceSync(world_size)
