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


def test_the_default_export_folder_leading_out_names_it_not_a_none_out(tmp_path):
    """``exports`` a link out of the project and no ``--out`` given: the sentence said "--out None leads outside the
    project"; now it names the default folder, says no --out was given, and nothing is written outside."""
    from conftest import REPO, run_module

    root, outside = tmp_path / "project", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "params.yaml").write_bytes((REPO / "params.yaml").read_bytes())
    (root / "exports").symlink_to(outside)
    out = run_module("tasks.export", "--profile", "ci", "--run", "jagg-s0", root=root, timeout=120)
    line = _one_sentence_of(out.stderr)
    assert out.returncode == 1 and "None" not in line, out.stderr[-2000:]
    assert "the default export folder" in line and "no --out was given" in line, line
    assert list(outside.iterdir()) == []


def _one_sentence_of(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr[-2000:]
    return lines[0]
