"""Behaviour pinned across refactors: a short ci-profile run's final weights and curve.

``tests/data/trainer_reference.json`` holds, per method, what a 4-iteration ci run of the shared ``uninterrupted``
fixture ends with: sha256 digests of the final weights and of the curve, and a projection of each tensor's movement
from the base model onto a fixed random direction; beside them, the platform they were recorded on — one recording
per platform (``make test`` runs its workers single-threaded, a plain ``pytest`` with torch's default threads).

- On the recording platform (same CPU features, torch, thread count and math-library settings) the run must match
  **bit for bit**: a refactor changes no number.
- On any other platform float32 kernels differ in their last bits (e.g. AVX-512 or AMX code paths in MKL); the run's
  reward is smooth in the pixels (``toy_background``), so those differences stay at rounding level and the
  projections must agree to 1e-3 of their own size, far below what any change of the algorithm does to them.

A change that alters the numbers on purpose (new defaults, a new algorithm step) re-records the reference with
``JAGG_RECORD_REFERENCE=1 pytest tests/test_refactor_reference.py`` and says so in its commit message.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import platform
from pathlib import Path

import pytest
import torch

REFERENCE = Path(__file__).parent / "data" / "trainer_reference.json"
METHODS = ("baseline", "jagg", "ablate")
PROJECTION_RTOL = 1e-3


def _weights_digest(tensors) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


# Columns logged since the reference was recorded; they add information and change no other number.
ADDED_SINCE: set[str] = {"reward/toy_background/group_std", "reward/toy_background/zero_std_frac", "train/kl_ref"}


def _curve_digest(path: Path) -> str:
    """The curve without its wall-clock columns (time/…), which no two runs share, and without :data:`ADDED_SINCE`."""
    rows = list(csv.DictReader(io.StringIO(path.read_text()), delimiter="\t"))
    keep = sorted(k for k in rows[0] if not k.startswith("time/") and k not in ADDED_SINCE)
    return hashlib.sha256(json.dumps([[r[k] for k in keep] for r in rows]).encode()).hexdigest()


def _projections(tensors, base) -> dict[str, float]:
    """name -> <final − base, r> / sqrt(n) in float64, r a standard normal direction seeded by the tensor's name."""
    out = {}
    for name in sorted(tensors):
        moved = (tensors[name].double() - base[name].double()).reshape(-1)
        g = torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:15], 16))
        r = torch.randn(moved.numel(), generator=g, dtype=torch.float64)
        out[name] = float(moved @ r) / moved.numel() ** 0.5
    return out


def _platform() -> dict:
    """What decides the last bits of a float32 run on the CPU."""
    flags = ""
    if Path("/proc/cpuinfo").exists():
        flags = next((line.split(":", 1)[1] for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith(("flags", "Features"))), "")
    return {"machine": platform.machine(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "cpu_flags": hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16],
            **{k: os.environ.get(k) for k in ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                                              "OMP_NUM_THREADS")}}


def _recordings() -> list[dict]:
    """The recorded runs, one per platform (e.g. the suite's single-threaded workers and a plain two-thread run)."""
    if not REFERENCE.exists():
        return []
    data = json.loads(REFERENCE.read_text())
    return data["recordings"] if "recordings" in data else [data]


@pytest.mark.slow
def test_short_run_matches_the_recorded_reference(uninterrupted):
    from safetensors.torch import load_file

    got = {}
    for method in METHODS:
        tensors = uninterrupted(method)
        root = uninterrupted.roots[method]
        base = load_file(root / "models/ci/base/transformer/diffusion_pytorch_model.safetensors")
        got[method] = {"weights": _weights_digest(tensors),
                       "curve": _curve_digest(root / "runs" / "ci" / f"{method}-s0" / "curve.tsv"),
                       "projections": _projections(tensors, base)}
    here = _platform()
    if os.environ.get("JAGG_RECORD_REFERENCE") == "1":  # (re)records this platform's run beside the others'
        REFERENCE.parent.mkdir(exist_ok=True)
        kept = [rec for rec in _recordings() if rec["platform"] != here]
        REFERENCE.write_text(json.dumps({"recordings": kept + [{"platform": here, "runs": got}]}, indent=2) + "\n")
    recordings = _recordings()
    mine = [rec for rec in recordings if rec["platform"] == here]
    want = (mine or recordings)[0]
    same_platform = bool(mine)
    for method in METHODS:
        w, g = want["runs"][method]["projections"], got[method]["projections"]
        assert sorted(w) == sorted(g), f"{method}: the trained tensors are not the reference's"
        scale = max(abs(v) for v in w.values())
        assert scale > 0
        worst = max(abs(g[k] - w[k]) for k in w)
        assert worst <= PROJECTION_RTOL * scale, f"{method}: final weights moved {worst / scale:.2e} of their " \
                                                 f"movement away from the reference"
        if same_platform:
            assert got[method]["weights"] == want["runs"][method]["weights"], \
                f"{method}: final weights differ from the reference in their bits on the platform it was recorded on"
            assert got[method]["curve"] == want["runs"][method]["curve"], f"{method}: curve differs from the reference"
