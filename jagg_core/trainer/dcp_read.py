"""A sharded checkpoint's ``dcp/`` folder (``torch.distributed.checkpoint``) read in one process, with no process
group: its tensor entries and its full tensors, assembled from every rank's shards (``Checkpoint.tensors``,
``jagg export``); :mod:`jagg_core.trainer.sharded` loads it across processes under the same quiet warning filter."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["dcp_tensor_metadata", "read_full_tensors", "single_process_quietly"]


def dcp_tensor_metadata(folder: Path) -> dict[str, Any]:
    """The tensor entries of a DCP folder's metadata, by state-dict key."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(folder).read_metadata().state_dict_metadata
    return {k: m for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}


def read_full_tensors(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor under ``prefix`` of a DCP folder, assembled from all ranks' shards (one process, no group)."""
    import torch.distributed.checkpoint as dcp

    meta = {k: m for k, m in dcp_tensor_metadata(folder).items() if k.startswith(prefix + ".")}
    full = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()}
    if full:
        with single_process_quietly():
            dcp.load(full, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return {k[len(prefix) + 1:]: v for k, v in full.items()}


@contextlib.contextmanager
def single_process_quietly():
    """DCP warns that it assumes one process when no process group exists: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
