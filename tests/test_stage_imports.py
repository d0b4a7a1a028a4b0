"""A stage's command imports the heavy stack where its work needs it, not when it starts: `jagg <stage> --help`, a
refused input and a stage that finds its work done (a trained run's `jagg train`, an evaluated run's `jagg evaluate`)
do not pay for torch, diffusers, transformers, peft, MLflow or Prefect before they know they need them. Each costs
1.3–3.5 s of CPU to import (docs/timings.md), and the suite starts hundreds of stage processes."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "diffusers", "transformers", "peft", "mlflow", "prefect", "accelerate", "pandas", "sqlalchemy")
# the stages a pipeline reruns (dvc repro, jagg run) and the modules they share; `jagg bench` and `jagg smoke` always
# work (they time and train), and flows/ is Prefect's by design
STAGES = ("flows.cli", "tasks.common", "tasks.launch", "tasks.dispatch", "tasks.prepare", "tasks.pretrain", "tasks.train",
          "tasks.evaluate", "tasks.report", "tasks.export", "tasks.plan", "tasks.speed", "tasks.services",
          "tasks.dvc_pipelines")


def test_importing_a_stage_entry_imports_none_of_the_heavy_stack():
    code = "\n".join(f"import {m}" for m in STAGES) + "\nimport json, sys; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = {m.split(".")[0] for m in json.loads(out.stdout.splitlines()[-1])}
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
