"""Behaviour pinned across refactors: a short ci-profile run's final weights and curve, bit for bit.

The digests in ``tests/data/trainer_reference.json`` were recorded before the trainer was restructured (issue 16).
A change that alters the numbers on purpose (new defaults, a new algorithm step) re-records them with
``JAGG_RECORD_REFERENCE=1 pytest tests/test_refactor_reference.py`` and says so in its commit message.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from pathlib import Path

import pytest
import torch

REFERENCE = Path(__file__).parent / "data" / "trainer_reference.json"
METHODS = ("baseline", "jagg", "ablate")


def _weights_digest(tensors) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


# Columns logged since the reference was recorded; they add information and change no other number.
ADDED_SINCE = {"sample/window_start"}


def _curve_digest(path: Path) -> str:
    """The curve without its wall-clock columns (time/…), which no two runs share, and without :data:`ADDED_SINCE`."""
    rows = list(csv.DictReader(io.StringIO(path.read_text()), delimiter="\t"))
    keep = sorted(k for k in rows[0] if not k.startswith("time/") and k not in ADDED_SINCE)
    return hashlib.sha256(json.dumps([[r[k] for k in keep] for r in rows]).encode()).hexdigest()


@pytest.mark.slow
def test_short_run_is_bit_identical_to_the_recorded_reference(uninterrupted):
    got = {}
    for method in METHODS:
        tensors = uninterrupted(method)
        root = uninterrupted.roots[method]
        got[method] = {"weights": _weights_digest(tensors),
                       "curve": _curve_digest(root / "runs" / "ci" / f"{method}-s0" / "curve.tsv")}
    if os.environ.get("JAGG_RECORD_REFERENCE") == "1":
        REFERENCE.parent.mkdir(exist_ok=True)
        REFERENCE.write_text(json.dumps(got, indent=2) + "\n")
    want = json.loads(REFERENCE.read_text())
    for method in METHODS:
        assert got[method]["weights"] == want[method]["weights"], f"{method}: final weights differ from the reference"
        assert got[method]["curve"] == want[method]["curve"], f"{method}: curve differs from the reference"
