"""Atomic, verified checkpoints: written to a temporary folder and renamed; a manifest of SHA-256 sums comes last.

A checkpoint folder ``checkpoint-<iteration:06d>`` holds ``trainable.safetensors`` (the trained tensors),
``ema.safetensors`` (optional), ``optimizer.pt`` (loaded with ``weights_only=True``), ``state.json`` (iteration,
policy version, resolved params, metrics) and ``manifest.json`` (file sizes and SHA-256 sums). A folder without a
manifest, or whose files do not match it, is not a checkpoint: resume falls back to the previous complete one.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..errors import UserError
from ..faults import fault
from ..storage import atomic_write_text, replace_dir

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "latest_checkpoint",
    "list_checkpoints",
    "load_tensors",
    "save_checkpoint",
    "verify_checkpoint",
]

log = logging.getLogger(__name__)
_NAME = re.compile(r"^checkpoint-(\d{6})$")


class CheckpointError(UserError, RuntimeError):
    """No usable checkpoint, or one that cannot be written; the message is for the user."""


@dataclass
class Checkpoint:
    path: Path
    iteration: int

    def state(self) -> dict[str, Any]:
        return json.loads((self.path / "state.json").read_text())

    def tensors(self, name: str = "trainable") -> dict[str, torch.Tensor]:
        return load_tensors(self.path / f"{name}.safetensors")

    def optimizer_state(self) -> dict[str, Any]:
        path = self.path / "optimizer.pt"
        try:  # tensors and plain containers only: a pickle that would run code is refused, never executed
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001  (UnpicklingError, RuntimeError, ...: all mean "not loadable")
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{path} cannot be loaded as tensors only ({first}); it was not written by jagg "
                                  f"or was tampered with: move checkpoint {self.iteration} aside.") from None


def _sha256(path: Path) -> str:
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
        manifest = {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)} for name in files}
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
    for old in list_checkpoints(root, check=False)[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)
    return Checkpoint(final, iteration)


def verify_checkpoint(path: Path) -> str | None:
    """None if the checkpoint folder is complete and matches its manifest, else what is wrong."""
    mf = path / "manifest.json"
    if not mf.exists():
        return "no manifest (interrupted while writing)"
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError:
        return "unreadable manifest"
    for name, meta in manifest.items():
        f = path / name
        if not f.exists():
            return f"{name} is missing"
        if f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
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
        problem = verify_checkpoint(p) if check else None
        if problem:
            log.warning("skipping damaged checkpoint %s: %s", p, problem)
            continue
        out.append(Checkpoint(p, int(m.group(1))))
    return out


def latest_checkpoint(root: str | os.PathLike) -> Checkpoint | None:
    """The newest complete, verified checkpoint (falling back past damaged ones), or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None
