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
full tensors in one process (for ``jagg export``; :mod:`jagg_core.trainer.dcp_read`); writing and loading it is
:mod:`jagg_core.trainer.sharded`.

Old checkpoints are rotated out so that a concurrent reader survives it (:func:`rotate`, at the end of this module).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import UserError
from ..setup.faults import fault
from ..setup.json_read import read_json
from ..setup.storage import (atomic_write_bytes, atomic_write_text, move, open_regular, read_regular, replace_dir,
                             temp_dir)
from ..setup.storage import file_sha256 as storage_sha256

if TYPE_CHECKING:
    import torch

__all__ = [
    "ROTATED",
    "Checkpoint",
    "CheckpointError",
    "file_sha256",
    "latest_checkpoint",
    "latest_checkpoint_together",
    "list_checkpoints",
    "check_checkpoint",
    "dcp_tensor_metadata",
    "load_tensors",
    "read_full_tensors",
    "rotate",
    "rotated_out",
    "save_checkpoint",
    "verify_checkpoint",
]

log = logging.getLogger(__name__)
_NAME = re.compile(r"^checkpoint-(\d{6})$")
DCP_DIR = "dcp"  # the torch.distributed.checkpoint folder of a sharded checkpoint
DCP_KEYS = {"trainable": "model", "ema": "ema"}  # Checkpoint.tensors(name) → the DCP state-dict entry


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
            state = read_json(f, ValueError, limit=MAX_MANIFEST_BYTES)
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
        return (self.path / DCP_DIR).is_dir()

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds the tensors ``name`` (``trainable`` always; ``ema`` when training kept one)."""
        from .dcp_read import dcp_tensor_metadata

        if self.sharded:
            return any(k.startswith(DCP_KEYS[name] + ".") for k in dcp_tensor_metadata(self.path / DCP_DIR))
        return (self.path / f"{name}.safetensors").exists()

    def tensors(self, name: str = "trainable") -> dict[str, torch.Tensor]:
        """The full tensors ``name`` (``trainable`` or ``ema``) by parameter name, on the CPU, in one process."""
        from .dcp_read import read_full_tensors

        try:
            if self.sharded:
                return read_full_tensors(self.path / DCP_DIR, DCP_KEYS[name])
            return load_tensors(self.path / f"{name}.safetensors")
        except OSError:
            if self.path.exists():
                raise
            raise CheckpointError(rotated_out(self)) from None

    def optimizer_state(self) -> dict[str, Any]:
        import torch

        path = self.path / "optimizer.pt"
        fix = f"move checkpoint {self.iteration} aside"
        try:  # tensors and plain containers only: a pickle that would run code is refused, never executed
            with open_regular(path, CheckpointError, limit=1 << 42, fix=fix) as f:  # regular, never blocking
                return torch.load(f, map_location="cpu", weights_only=True)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001  (UnpicklingError, RuntimeError, ...: all mean "not loadable")
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{path} cannot be loaded as tensors only ({first}); it was not written by jagg "
                                  f"or was tampered with: move checkpoint {self.iteration} aside.") from None


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a regular file's bytes, read in 1 MiB chunks (what manifests record). Its sentence is an
    OSError, as the callers expect of a file that a rotation deleted under them."""
    return storage_sha256(path, OSError)


def load_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    # a checkpoint's weights may be as large as the model: bounded by what a file system holds, regular, never blocking
    from safetensors.torch import load as st_load

    return st_load(read_regular(path, OSError, limit=1 << 42))  # an OSError sentence: rotated out, or one to raise


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
    import torch
    from safetensors.torch import save as st_save

    root = Path(root)
    for name, t in trainable.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(f"refusing to save checkpoint {iteration}: parameter {name} is not finite.")
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"checkpoint-{iteration:06d}"
    tmp = temp_dir(root, f".tmp-{final.name}-")
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
            atomic_write_bytes(tmp / name, data)  # fsynced, written whole
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


_SHA = re.compile(r"[0-9a-f]{64}\Z")


def _listed_files(path: Path) -> set[str]:
    """Every entry of a checkpoint folder but its manifest, as manifest names (``dcp/…`` for a sharded one)."""
    out = set()
    for p in path.rglob("*"):
        if p.is_dir() and not p.is_symlink():
            continue
        name = p.relative_to(path).as_posix()
        if name != "manifest.json":
            out.add(name)
    return out


MAX_MANIFEST_BYTES = 16 << 20  # a manifest lists a checkpoint's few files: KiB


def verify_checkpoint(path: Path, part: tuple[int, int] = (0, 1)) -> str | None:
    """None if the checkpoint folder is complete and its manifest proves it, else what is wrong.

    The manifest must be a mapping that lists every file of the folder (no more, no fewer) with its size and SHA-256,
    ``state.json`` and the weights (``trainable.safetensors``, or a sharded checkpoint's ``dcp/.metadata``) among
    them; each listed entry must be a regular file (a symlink to /etc/passwd or /dev/zero is not), match its size
    and digest, and weights must be a readable safetensors file of finite tensors.

    ``part`` = (rank, world): hash only file ``k % world == rank`` of the manifest (the ranks of a run verify a
    checkpoint together, see :func:`latest_checkpoint_together`)."""
    mf = path / "manifest.json"
    if not mf.exists():
        return "no manifest (interrupted while writing)"
    if mf.is_symlink() or not mf.is_file():
        return "manifest.json is not a regular file"
    try:  # bounded before it is read (a 2 GB sparse manifest was read whole, then cut): the project's one reader
        manifest = read_json(mf, ValueError, limit=MAX_MANIFEST_BYTES)
    except ValueError as e:  # too large, not a regular file, not UTF-8, not JSON
        return f"unreadable manifest ({' '.join(str(e).split())[:200]})"
    if not isinstance(manifest, dict) or not manifest:
        return f"the manifest is a {type(manifest).__name__ if manifest else 'empty mapping'}, not a list of its files"
    for name, meta in manifest.items():
        if (not isinstance(meta, dict) or type(meta.get("bytes")) is not int or meta["bytes"] < 0
                or not isinstance(meta.get("sha256"), str) or not _SHA.fullmatch(meta["sha256"])):
            return f"the manifest's entry {str(name)[:80]!r} has no size and SHA-256"
        if name.startswith("/") or ".." in name.split("/"):
            return f"the manifest names {name[:80]!r}, outside the checkpoint"
    weights = f"{DCP_DIR}/.metadata" if (path / DCP_DIR).is_dir() else "trainable.safetensors"
    for needed in ("state.json", weights):
        if needed not in manifest:
            return f"the manifest does not list {needed}"
    unlisted = sorted(_listed_files(path) - set(manifest))
    if unlisted:
        return f"{unlisted[0]} is not in the manifest"
    rank, world = part
    for k, (name, meta) in enumerate(manifest.items()):
        if k % world != rank:
            continue
        f = path / name
        if not f.exists() and not f.is_symlink():
            return f"{name} is missing"
        info = f.lstat()
        if not stat.S_ISREG(info.st_mode):
            return f"{name} is not a regular file (a symlink, a device or a folder)"
        if info.st_size != meta["bytes"] or file_sha256(f) != meta["sha256"]:
            return f"{name} does not match its recorded checksum"
        if name.endswith(".safetensors"):
            problem = _finite_safetensors(f)
            if problem:
                return f"{name} {problem}"
    return None


# safetensors' float dtypes that numpy reads; the others (bfloat16, float8) are read through torch
_NUMPY_FLOATS = ("F16", "F32", "F64")


def _finite_safetensors(f: Path) -> str | None:
    """None if ``f`` is a readable safetensors file of finite tensors, else what is wrong.

    Read with numpy where it holds the dtype, so that a stage that finds its run trained verifies the last checkpoint
    without importing torch (1.7 s of CPU); a bfloat16 or float8 tensor through torch, as before."""
    import numpy as np
    from safetensors import safe_open

    try:
        with contextlib.ExitStack() as stack:
            st = stack.enter_context(safe_open(str(f), framework="np"))  # memory-mapped: one tensor at a time
            pt = None
            for key in st.keys():
                dtype = st.get_slice(key).get_dtype()
                if dtype in _NUMPY_FLOATS:
                    finite = bool(np.isfinite(st.get_tensor(key)).all())
                elif dtype.startswith(("F", "BF")):
                    import torch

                    pt = pt or stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
                    t = pt.get_tensor(key)
                    finite = not t.is_floating_point() or bool(torch.isfinite(t).all())
                else:  # integers and booleans are finite
                    continue
                if not finite:
                    return f"holds non-finite values in {key}"
    except Exception as e:  # noqa: BLE001  (SafetensorError: a header of 2^62 bytes, garbage)
        return f"is not a readable safetensors file ({type(e).__name__})"
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
                move(p, root / name)
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
    from .distributed import gather_objects, process_group

    dist = process_group()
    if not dist:
        return latest_checkpoint(root)
    root = Path(root)
    rank, world = dist.get_rank(), dist.get_world_size()
    box = [[c.iteration for c in list_checkpoints(root, check=False)] if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    for iteration in reversed(box[0]):
        path = root / f"checkpoint-{iteration:06d}"
        mine = check_checkpoint(path, (rank, world))
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


# Rotation that a concurrent reader survives (`jagg evaluate` while the run trains on).
#
# A training run keeps its newest ``train.keep_checkpoints`` checkpoints. The old ones are renamed away in one step
# before they are deleted (to ``.tmp-rotated-…``, which the next resume tidies like any interrupted write), so a reader
# sees a checkpoint whole or not at all: one that vanishes while it is verified was rotated out, not damaged, and one
# that vanishes while its tensors are read is one sentence, never a raw Errno.

ROTATED = "rotated out"  # check_checkpoint's answer for a checkpoint deleted meanwhile (by identity: `is ROTATED`)


def rotate(root: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints under ``root``, each renamed away first."""
    for old in list_checkpoints(root, check=False)[:-keep]:
        gone = old.path.with_name(f".tmp-rotated-{old.path.name}-{os.getpid()}")
        try:
            move(old.path, gone)
        except OSError:  # deleted by someone else already
            continue
        shutil.rmtree(gone, ignore_errors=True)


def check_checkpoint(path: Path, part: tuple[int, int] = (0, 1)) -> str | None:
    """:func:`~jagg_core.trainer.checkpoint.verify_checkpoint`, except that a checkpoint that is gone by the end
    (rotated out by its training run while this process read it) is :data:`ROTATED`, not a problem to warn about,
    and a file unreadable for another reason is a problem, not an exception; ``part`` as for ``verify_checkpoint``."""
    try:
        problem = verify_checkpoint(path, part)
    except OSError as e:
        problem = f"unreadable ({e.strerror or e})"
    if problem and not path.exists():
        return ROTATED
    return problem


def rotated_out(ckpt: Checkpoint) -> str:
    return (f"checkpoint {ckpt.iteration} ({ckpt.path}) was deleted while it was read: its training run rotated it "
            f"out (it keeps the newest train.keep_checkpoints); run this again to use the newest ones, or once the "
            f"run has finished.")
