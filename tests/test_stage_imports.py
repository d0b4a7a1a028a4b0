"""A stage's command imports the heavy stack where its work needs it, not when it starts: `jagg <stage> --help`, a
refused input and a stage that finds its work done (a trained run's `jagg train`, an evaluated run's `jagg evaluate`)
do not pay for torch, diffusers, transformers, peft, MLflow or Prefect before they know they need them. Each costs
1.3–3.5 s of CPU to import (docs/timings.md), and the suite starts hundreds of stage processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "diffusers", "transformers", "peft", "mlflow", "prefect", "accelerate", "pandas", "sqlalchemy")
# the stages a pipeline reruns (dvc repro, jagg run) and the modules they share; `jagg bench` and `jagg smoke` always
# work (they time and train), and flows/ is Prefect's by design
STAGES = ("flows.cli", "tasks.common", "tasks.launch", "tasks.dispatch", "tasks.prepare", "tasks.pretrain", "tasks.train",
          "tasks.evaluate", "tasks.report", "tasks.export", "tasks.plan", "tasks.speed", "tasks.services",
          "tasks.dvc_pipelines")


def _heavy_after(code: str) -> list[str]:
    """What of the heavy stack a fresh interpreter holds after running ``code``."""
    out = subprocess.run([sys.executable, "-c", code + "\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, cwd=REPO)
    return sorted({m.split(".")[0] for m in json.loads(out.stdout.splitlines()[-1])} & set(HEAVY))


def test_importing_a_stage_entry_imports_none_of_the_heavy_stack():
    assert _heavy_after("\n".join(f"import {m}" for m in STAGES)) == []


def test_validating_params_registers_every_builtin_plugin_without_torch():
    """Every stage validates its params first, which imports every plugin's module (a backbone or reward registers
    itself where it is defined): those modules import torch where a policy or a reward runs, not at the top."""
    code = ("from jagg_core.setup.params_io import load_params\n"
            "from jagg_core.setup.registry import backbone_names, reward_names\n"
            "load_params('params.yaml', 'ci')\n"
            "assert {'toy-flux', 'flux', 'qwenimage', 'sd3', 'wan'} <= set(backbone_names()), backbone_names()\n"
            "assert {'toy_fidelity', 'toy_preference', 'hpsv2.1', 'pickscore', 'clipscore', 'served'} "
            "<= set(reward_names()), reward_names()")
    assert _heavy_after(code) == []


def test_a_trained_runs_last_checkpoint_verifies_without_torch(tmp_path):
    """`jagg train` of a trained run checks that its last checkpoint verifies (every file's checksum, every float
    tensor finite) before it says so: numpy reads a float32 checkpoint's tensors, torch is not imported."""
    from jagg_core.trainer.checkpoint import save_checkpoint

    save_checkpoint(tmp_path, 2, trainable={"w": torch.ones(4, 4), "steps": torch.arange(3)}, optimizer=None,
                    state={"iteration": 2})
    code = ("from jagg_core.trainer.checkpoint import latest_checkpoint\n"
            f"assert latest_checkpoint({str(tmp_path)!r}).iteration == 2")
    assert _heavy_after(code) == []
