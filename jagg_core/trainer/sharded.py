"""Sharded (FSDP2) checkpoints: one torch.distributed.checkpoint folder that every rank writes its own shards into.

``checkpoint-<iteration:06d>/dcp/`` holds ``.metadata`` and one ``__<rank>_0.distcp`` per rank: the trained weights
(``model``), the optimizer state (``optim``) and the EMA (``ema``), written in parallel without gathering anything, so
no rank ever holds the full state. ``state.json`` and the manifest (covering the ``dcp/`` files too) are those of
:mod:`jagg_core.trainer.checkpoint`, whose guarantees hold here as well. Such a checkpoint resumes on any number of
processes (DCP reshards on load), and :func:`~jagg_core.trainer.dcp_read.read_full_tensors` reads it back as full
tensors in one process (for ``jagg export``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch

from ..setup.faults import fault
from ..setup.storage import atomic_write_text, replace_dir
from .checkpoint import DCP_DIR, Checkpoint, CheckpointError, file_sha256, rotate
from .dcp_read import single_process_quietly
from .distributed import gather_objects, process_group

__all__ = ["load_sharded_state", "save_sharded_checkpoint"]


def _trained(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters by name, as they are held (DTensor shards under FSDP2): no copy, no gather."""
    return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}


def _on_main(fn, *args):
    """Run ``fn`` on rank 0 and give every rank its result; an exception there is raised on every rank."""
    dist = process_group()
    rank = dist.get_rank() if dist else 0
    box: list[Any] = [None]
    if rank == 0:
        try:
            box = [("ok", fn(*args))]
        except OSError as e:
            box = [("error", f"{e.strerror or e}")]
        except Exception as e:  # noqa: BLE001  (any failure here must reach every rank, or they wait forever)
            box = [("error", str(e) or type(e).__name__)]
    if dist:
        dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise CheckpointError(value)
    return value


def save_sharded_checkpoint(
    root: str | Path,
    iteration: int,
    *,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, Any],
    ema: Mapping[str, torch.Tensor] | None = None,
    keep: int = 2,
) -> Checkpoint:
    """Write ``checkpoint-<iteration>`` of sharded training under ``root``: a collective, every rank calls it.

    Every rank writes its own shards of the trained weights, the optimizer state and the EMA into one
    torch.distributed.checkpoint folder, in parallel and without gathering anything; rank 0 then writes ``state.json``
    and the manifest and renames the folder into place. ``root`` must be a path every process (every machine) sees.
    The same guarantees as :func:`~jagg_core.trainer.checkpoint.save_checkpoint`: non-finite weights are refused, an
    error leaves earlier checkpoints untouched and no partial folder, the newest ``keep`` are kept.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    root = Path(root)
    dist = process_group()
    weights = _trained(module)
    _refuse_non_finite(weights, iteration)
    write = _ShardedWrite(root, iteration, rank=dist.get_rank() if dist else 0,
                          world_size=dist.get_world_size() if dist else 1)
    try:
        _on_main(write.start)
        entries: dict[str, Any] = {"model": weights, "optim": get_optimizer_state_dict(module, optimizer)}
        if ema is not None:
            entries["ema"] = dict(ema)
        try:
            dcp.save(entries, storage_writer=dcp.FileSystemWriter(write.tmp / DCP_DIR, sync_files=True))
            fault("checkpoint", iteration)  # reliability tests: killed (or out of space) after the shards
        except (Exception, CheckpointException) as e:  # noqa: BLE001  (DCP re-raises any rank's failure everywhere)
            raise CheckpointError(_reason(e)) from None
        hashed = gather_objects(write.own_files())
        problems = [h["error"] for h in hashed if "error" in h]
        if problems:
            raise CheckpointError(problems[0])
        _on_main(write.finish, hashed, state, keep)
    except CheckpointError as e:
        if write.rank == 0:
            shutil.rmtree(write.tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {iteration} under {root} ({e}); earlier checkpoints are "
                              f"intact.") from None
    return Checkpoint(write.final, iteration)


def _refuse_non_finite(weights: Mapping[str, torch.Tensor], iteration: int) -> None:
    """A collective: every rank refuses when any rank's shard of a trained parameter holds NaN or inf."""
    dist = process_group()
    local = [getattr(t, "_local_tensor", t) for t in weights.values()]
    device = local[0].device if local else torch.device("cpu")  # NCCL reduces only tensors on the GPU
    bad = torch.tensor([float(any(t.is_floating_point() and not torch.isfinite(t).all() for t in local))],
                       device=device)
    if dist:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        raise CheckpointError(f"refusing to save checkpoint {iteration}: a trained parameter is not finite.")


class _ShardedWrite:
    """The folders of one sharded save: ``tmp`` (the same on every rank, each writes its own files) and ``final``."""

    def __init__(self, root: Path, iteration: int, *, rank: int, world_size: int):
        self.root, self.iteration, self.rank, self.world_size = root, iteration, rank, world_size
        self.final = root / f"checkpoint-{iteration:06d}"
        self.tmp = root / f".tmp-{self.final.name}-sharded"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        (self.tmp / DCP_DIR).mkdir(parents=True)

    def own_files(self) -> dict[str, Any]:
        """This rank's shard files (rank 0: and the metadata) with their sizes and checksums: hashed in parallel."""
        try:
            files = sorted((self.tmp / DCP_DIR).glob(f"__{self.rank}_*.distcp"))
            if self.rank == 0:
                files.append(self.tmp / DCP_DIR / ".metadata")
            return {str(f.relative_to(self.tmp)): {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
                    for f in files}
        except OSError as e:
            return {"error": f"{e.strerror or e}"}

    def finish(self, entries: list[dict[str, Any]], state: Mapping[str, Any], keep: int) -> None:
        """Rank 0: ``state.json``, the manifest of every rank's files, the rename into place, old ones removed."""
        tmp = self.tmp
        text = json.dumps({"iteration": self.iteration, "format": "dcp", "world_size": self.world_size, **state},
                          indent=2, default=str) + "\n"
        atomic_write_text(tmp / "state.json", text)
        manifest = {k: v for e in entries for k, v in e.items()}
        manifest["state.json"] = {"bytes": (tmp / "state.json").stat().st_size, "sha256": file_sha256(tmp / "state.json")}
        atomic_write_text(tmp / "manifest.json", json.dumps(manifest, indent=2) + "\n")
        replace_dir(tmp, self.final)
        rotate(self.root, keep)


def _reason(e: BaseException) -> str:
    """What went wrong, in a few words: DCP's CheckpointException wraps each failed rank's exception."""
    failures = getattr(e, "failures", None)
    if failures:
        e = next(iter(failures.values()))[0]
    if isinstance(e, OSError):
        return f"{e.strerror or e}"
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def load_sharded_state(
    ckpt: Checkpoint,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: dict[str, torch.Tensor] | None = None,
) -> None:
    """Load a sharded checkpoint into ``module``'s trainable parameters, ``optimizer`` and ``ema`` (in place; a
    collective); each rank reads only the shards it holds, whatever the number of processes that wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    weights = _trained(module)
    # The parameters themselves (detached views, DTensor shards under FSDP2) are the load targets: read in place.
    entries: dict[str, Any] = {"model": weights, "optim": get_optimizer_state_dict(module, optimizer)}
    if ema is not None and ckpt.has("ema"):
        entries["ema"] = ema
    try:
        with single_process_quietly():
            dcp.load(entries, storage_reader=dcp.FileSystemReader(ckpt.path / DCP_DIR),
                     no_dist=process_group() is None)
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        raise CheckpointError(f"{ckpt.path} could not be loaded into this run ({_reason(e)}); it was written for "
                              f"other parameters or is damaged: move it aside to resume from an earlier one.") from None
    set_optimizer_state_dict(module, optimizer, entries["optim"])
