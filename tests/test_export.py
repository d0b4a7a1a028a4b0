"""`jagg export` (jagg_core/pipeline/export.py) cleans up after itself: an error while writing (a full disk) is one
sentence and leaves nothing; what a killed export left is removed by the next one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fault_helpers import _one_sentence


def test_export_on_a_full_disk_is_one_sentence_and_leaves_nothing(tmp_path):
    from safetensors import SafetensorError

    from jagg_core.pipeline.export import ExportError, export_transformer

    class Full:
        def save_pretrained(self, folder, **kwargs):
            Path(folder).mkdir(parents=True)
            (Path(folder) / "part.safetensors").write_bytes(b"x")
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    with pytest.raises(ExportError) as e:
        export_transformer(Full(), tmp_path / "exports" / "out", backbone="flux", card={})
    assert "nothing was written" in _one_sentence(e.value)
    assert list((tmp_path / "exports").iterdir()) == []


def test_export_removes_what_a_killed_export_left(tmp_path):
    from jagg_core.pipeline.export import export_transformer

    dead = tmp_path / ".tmp-old-999999999-abc"  # a pid no process has
    alive = tmp_path / f".tmp-other-{os.getpid()}-abc"  # an export running now
    dead.mkdir()
    alive.mkdir()

    class Ok:
        def save_pretrained(self, folder, **kwargs):
            Path(folder).mkdir(parents=True)

    export_transformer(Ok(), tmp_path / "out", backbone="flux", card={})
    assert not dead.exists() and alive.exists() and (tmp_path / "out" / "export.json").exists()
