"""Atomic, verified checkpoints: written to a temporary folder and renamed; a manifest of SHA-256 sums comes last.

A checkpoint folder ``checkpoint-<iteration:06d>`` holds ``trainable.safetensors`` (the trained tensors),
``ema.safetensors`` (optional), ``optimizer.pt`` (loaded with ``weights_only=True``), ``state.json`` (iteration,
policy version, resolved params, metrics) and ``manifest.json`` (file sizes and SHA-256 sums). A folder without a
manifest, or whose files do not match it, is not a checkpoint: resume falls back to the previous complete one.

Sharded training (FSDP2) writes a *sharded* checkpoint instead: ``dcp/`` is a ``torch.distributed.checkpoint``
folder (``.metadata`` and one ``__<rank>_0.distcp`` per rank) holding the trained weights (``model``), the optimizer
state (``optim``) and the EMA (``ema``), each rank writing only its own shards, in parallel; no rank ever holds the
full state. ``state.json`` and the manifest (which covers the ``dcp/`` files too) are the same as above. Such a
checkpoint resumes on any number of processes (DCP reshards on load) and :meth:`Checkpoint.tensors` reads it back as
full tensors in one process (for ``jagg export``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..errors import UserError
from ..pipeline.faults import fault
from ..pipeline.storage import atomic_write_text, replace_dir
from .distributed import gather_objects
from .rotation import ROTATED, check_checkpoint, rotate, rotated_out

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "file_sha256",
    "latest_checkpoint",
    "latest_checkpoint_together",
    "list_checkpoints",
    "load_sharded_state",
    "load_tensors",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "verify_checkpoint",
]

log = logging.getLogger(__name__)
_NAME = re.compile(r"^checkpoint-(\d{6})$")
_DCP = "dcp"  # the torch.distributed.checkpoint folder of a sharded checkpoint
_DCP_KEYS = {"trainable": "model", "ema": "ema"}  # Checkpoint.tensors(name) → the DCP state-dict entry


class CheckpointError(UserError, RuntimeError):
    """No usable checkpoint, or one that cannot be written; the message is for the user."""


@dataclass
class Checkpoint:
    path: Path
    iteration: int

    def state(self) -> dict[str, Any]:
        """The checkpoint's ``state.json``; garbage there (its manifest rewritten to match) is a :class:`CheckpointError`
        sentence in the worker, not a traceback that its launcher would take for a died process and retry."""
        f = self.path / "state.json"
        try:
            state = json.loads(f.read_bytes().decode("utf-8"))
        except (ValueError, OSError) as e:
            raise CheckpointError(f"{f} cannot be read as JSON ({type(e).__name__}); the checkpoint is damaged: move "
                                  f"{self.path.name} aside to resume from the one before it.") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{f} holds a {type(state).__name__}, not a checkpoint state; the checkpoint is "
                                  f"damaged: move {self.path.name} aside to resume from the one before it.")
        return state

    @property
    def sharded(self) -> bool:
        """Written by sharded (FSDP2) training as a torch.distributed.checkpoint folder."""
        return (self.path / _DCP).is_dir()

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds the tensors ``name`` (``trainable`` always; ``ema`` when training kept one)."""
        if self.sharded:
            return any(k.startswith(_DCP_KEYS[name] + ".") for k in _dcp_tensor_metadata(self.path / _DCP))
        return (self.path / f"{name}.safetensors").exists()

    def tensors(self, name: str = "trainable") -> dict[str, torch.Tensor]:
        """The full tensors ``name`` (``trainable`` or ``ema``) by parameter name, on the CPU, in one process."""
        try:
            if self.sharded:
                return _read_full_tensors(self.path / _DCP, _DCP_KEYS[name])
            return load_tensors(self.path / f"{name}.safetensors")
        except OSError:
            if self.path.exists():
                raise
            raise CheckpointError(rotated_out(self)) from None

    def optimizer_state(self) -> dict[str, Any]:
        path = self.path / "optimizer.pt"
        try:  # tensors and plain containers only: a pickle that would run code is refused, never executed
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001  (UnpicklingError, RuntimeError, ...: all mean "not loadable")
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{path} cannot be loaded as tensors only ({first}); it was not written by jagg "
                                  f"or was tampered with: move checkpoint {self.iteration} aside.") from None


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB chunks (what manifests record)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    return st_load(Path(path).read_bytes())


def save_checkpoint(
    root: str | os.PathLike,
    iteration: int,
    *,
    trainable: Mapping[str, torch.Tensor],
    optimizer: Mapping[str, Any] | None,
    state: Mapping[str, Any],
    ema: Mapping[str, torch.Tensor] | None = None,
    keep: int = 2,
) -> Checkpoint:
    """Write ``checkpoint-<iteration>`` atomically under ``root`` and keep the newest ``keep`` checkpoints.

    Refuses non-finite tensors (NaN weights are never saved). On any error (disk full, ...) the temporary folder is
    removed and earlier checkpoints are untouched.
    """
    root = Path(root)
    for name, t in trainable.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(f"refusing to save checkpoint {iteration}: parameter {name} is not finite.")
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"checkpoint-{iteration:06d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{final.name}-"))
    try:
        files = {"trainable.safetensors": st_save({k: v.detach().contiguous().cpu() for k, v in trainable.items()})}
        if ema is not None:
            files["ema.safetensors"] = st_save({k: v.detach().contiguous().cpu() for k, v in ema.items()})
        if optimizer is not None:
            buf = io.BytesIO()
            torch.save(optimizer, buf)
            files["optimizer.pt"] = buf.getvalue()
        files["state.json"] = (json.dumps({"iteration": iteration, **state}, indent=2, default=str) + "\n").encode()
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        fault("checkpoint", iteration)  # reliability tests: killed or out of space mid-write
        manifest = {name: {"bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)} for name in files}
        atomic_write_text(tmp / "manifest.json", json.dumps(manifest, indent=2) + "\n")
        replace_dir(tmp, final)  # a re-run of the same iteration replaces it; a complete copy is always there
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"could not write checkpoint {iteration} under {root} ({e.strerror or e}); earlier checkpoints are intact."
        ) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    rotate(root, keep)
    return Checkpoint(final, iteration)


def _dcp_tensor_metadata(folder: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(folder).read_metadata().state_dict_metadata
    return {k: m for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}


def _read_full_tensors(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor under ``prefix`` of a DCP folder, assembled from all ranks' shards (one process, no group)."""
    import torch.distributed.checkpoint as dcp

    meta = {k: m for k, m in _dcp_tensor_metadata(folder).items() if k.startswith(prefix + ".")}
    full = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()}
    if full:
        with _single_process_quietly():
            dcp.load(full, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return {k[len(prefix) + 1:]: v for k, v in full.items()}


@contextlib.contextmanager
def _single_process_quietly():
    """DCP warns that it assumes one process when no process group exists: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _trained(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters by name, as they are held (DTensor shards under FSDP2): no copy, no gather."""
    return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _on_main(fn, *args):
    """Run ``fn`` on rank 0 and give every rank its result; an exception there is raised on every rank."""
    dist = _dist()
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
    root: str | os.PathLike,
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
    The same guarantees as :func:`save_checkpoint`: non-finite weights are refused, an error leaves earlier checkpoints
    untouched and no partial folder, the newest ``keep`` are kept.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    root = Path(root)
    dist = _dist()
    weights = _trained(module)
    local = [getattr(t, "_local_tensor", t) for t in weights.values()]
    device = local[0].device if local else torch.device("cpu")  # NCCL reduces only tensors on the GPU
    bad = torch.tensor([float(any(t.is_floating_point() and not torch.isfinite(t).all() for t in local))],
                       device=device)
    if dist:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        raise CheckpointError(f"refusing to save checkpoint {iteration}: a trained parameter is not finite.")
    final = root / f"checkpoint-{iteration:06d}"
    tmp = root / f".tmp-{final.name}-sharded"  # the same folder on every rank: each writes its own files into it
    rank = dist.get_rank() if dist else 0

    def start() -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / _DCP).mkdir(parents=True)

    def own_files() -> dict[str, Any]:
        """This rank's shard files (rank 0: and the metadata) with their sizes and checksums: hashed in parallel."""
        try:
            files = sorted((tmp / _DCP).glob(f"__{rank}_*.distcp"))
            if rank == 0:
                files.append(tmp / _DCP / ".metadata")
            return {str(f.relative_to(tmp)): {"bytes": f.stat().st_size, "sha256": file_sha256(f)} for f in files}
        except OSError as e:
            return {"error": f"{e.strerror or e}"}

    def finish(entries: list[dict[str, Any]]) -> None:
        text = json.dumps({"iteration": iteration, "format": "dcp", "world_size": dist.get_world_size() if dist else 1,
                           **state}, indent=2, default=str) + "\n"
        atomic_write_text(tmp / "state.json", text)
        manifest = {k: v for e in entries for k, v in e.items()}
        manifest["state.json"] = {"bytes": (tmp / "state.json").stat().st_size, "sha256": file_sha256(tmp / "state.json")}
        atomic_write_text(tmp / "manifest.json", json.dumps(manifest, indent=2) + "\n")
        replace_dir(tmp, final)
        rotate(root, keep)

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        _on_main(start)
        entries: dict[str, Any] = {"model": weights, "optim": get_optimizer_state_dict(module, optimizer)}
        if ema is not None:
            entries["ema"] = dict(ema)
        try:
            dcp.save(entries, storage_writer=dcp.FileSystemWriter(tmp / _DCP, sync_files=True))
            fault("checkpoint", iteration)  # reliability tests: killed (or out of space) after the shards
        except (Exception, CheckpointException) as e:  # noqa: BLE001  (DCP re-raises any rank's failure everywhere)
            raise CheckpointError(_reason(e)) from None
        hashed = gather_objects(own_files())
        problems = [h["error"] for h in hashed if "error" in h]
        if problems:
            raise CheckpointError(problems[0])
        _on_main(finish, hashed)
    except CheckpointError as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {iteration} under {root} ({e}); earlier checkpoints are "
                              f"intact.") from None
    return Checkpoint(final, iteration)


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
        with _single_process_quietly():
            dcp.load(entries, storage_reader=dcp.FileSystemReader(ckpt.path / _DCP), no_dist=_dist() is None)
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        raise CheckpointError(f"{ckpt.path} could not be loaded into this run ({_reason(e)}); it was written for "
                              f"other parameters or is damaged: move it aside to resume from an earlier one.") from None
    set_optimizer_state_dict(module, optimizer, entries["optim"])


def verify_checkpoint(path: Path, part: tuple[int, int] = (0, 1)) -> str | None:
    """None if the checkpoint folder is complete and matches its manifest, else what is wrong.

    ``part`` = (rank, world): hash only file ``k % world == rank`` of the manifest (the ranks of a run verify a
    checkpoint together, see :func:`latest_checkpoint_together`)."""
    mf = path / "manifest.json"
    if not mf.exists():
        return "no manifest (interrupted while writing)"
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError:
        return "unreadable manifest"
    rank, world = part
    for k, (name, meta) in enumerate(manifest.items()):
        if k % world != rank:
            continue
        f = path / name
        if not f.exists():
            return f"{name} is missing"
        if f.stat().st_size != meta["bytes"] or file_sha256(f) != meta["sha256"]:
            return f"{name} does not match its recorded checksum"
    return None


def recover_leftovers(root: str | os.PathLike) -> list[str]:
    """Tidy what a killed writer left in ``root`` (call it holding the run's lock): an interrupted write
    (``.tmp-*``) is deleted; a previous copy set aside for a swap (``.trash-<name>-<pid>``) is put back when the swap
    never finished (``<name>`` missing) and deleted otherwise. Returns what was done, one line each."""
    root = Path(root)
    done: list[str] = []
    if not root.is_dir():
        return done
    for p in sorted(root.iterdir()):
        if p.name.startswith(".tmp-") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"deleted the interrupted write {p.name}")
        elif p.name.startswith(".trash-") and p.is_dir():
            name = p.name.removeprefix(".trash-").rsplit("-", 1)[0]
            if (root / name).exists():
                shutil.rmtree(p, ignore_errors=True)
                done.append(f"deleted {p.name} (its swap finished)")
            else:
                os.replace(p, root / name)
                done.append(f"restored {name} from {p.name} (its swap was interrupted)")
    return done


def list_checkpoints(root: str | os.PathLike, *, check: bool = True) -> list[Checkpoint]:
    """Checkpoints under ``root``, oldest first; with ``check``, damaged ones are skipped with a warning."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        m = _NAME.match(p.name)
        if not m or not p.is_dir():
            continue
        problem = check_checkpoint(p) if check else None
        if problem:
            if problem is not ROTATED:
                log.warning("skipping damaged checkpoint %s: %s", p, problem)
            continue
        out.append(Checkpoint(p, int(m.group(1))))
    return out


def latest_checkpoint_together(root: str | os.PathLike) -> Checkpoint | None:
    """:func:`latest_checkpoint` as a collective: rank 0's listing, every rank hashing its share of each candidate's
    files (a 190 GB checkpoint is read once, in parallel); every rank gets the same answer."""
    dist = _dist()
    if not dist:
        return latest_checkpoint(root)
    root = Path(root)
    rank, world = dist.get_rank(), dist.get_world_size()
    box = [[c.iteration for c in list_checkpoints(root, check=False)] if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    for iteration in reversed(box[0]):
        path = root / f"checkpoint-{iteration:06d}"
        try:
            mine = verify_checkpoint(path, (rank, world))
        except OSError as e:
            mine = f"unreadable ({e.strerror or e})"
        problems = [p for p in gather_objects(mine) if p]
        if not problems:
            return Checkpoint(path, iteration)
        if rank == 0:
            log.warning("skipping damaged checkpoint %s: %s", path, problems[0])
    return None


def latest_checkpoint(root: str | os.PathLike) -> Checkpoint | None:
    """The newest complete, verified checkpoint (falling back past damaged ones, with a warning), or None.

    Newest first: older checkpoints are not read once one verifies."""
    for ckpt in reversed(list_checkpoints(root, check=False)):
        problem = check_checkpoint(ckpt.path)
        if problem is None:
            return ckpt
        if problem is not ROTATED:
            log.warning("skipping damaged checkpoint %s: %s", ckpt.path, problem)
    return None
