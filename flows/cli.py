"""The `jagg` command: every pipeline stage, the whole reproduction, the services.

    jagg run [--profile toy]           the reproduction flow end to end (Prefect, in-process)
    jagg prepare | pretrain | train | evaluate | report   one stage (as dvc.yaml runs them)
    jagg bench                         update-stage benchmark (exact vs JAGG vs ablate)
    jagg speed [--profile toy]         every method's update stage timed side by side (the report's speed table)
    jagg smoke [--device cpu]          GPU smoke test: a tiny random Flux, every method 4 iterations in bf16
    jagg plan --profile flux           what a real profile's run costs (memory, FLOPs, GPU hours), before renting GPUs
    jagg export --run jagg-s0          a checkpoint as a diffusers transformer folder or a LoRA file
    jagg services up | down | status   Prefect server + worker + deployments, MLflow UI (loopback)
    jagg ui                            the MLflow UI on the project's store
"""

from __future__ import annotations

# The command lives with the flows, the top layer: `jagg run` starts a flow without a task importing a flow.

import sys

STAGES = {
    "prepare": "tasks.prepare",
    "pretrain": "tasks.pretrain",
    "train": "tasks.train",
    "evaluate": "tasks.evaluate",
    "report": "tasks.report",
    "run": "flows.run",
    "bench": "tasks.bench",
    "speed": "tasks.speed",
    "smoke": "tasks.smoke",
    "plan": "tasks.plan",
    "export": "tasks.export",
    "services": "tasks.services",
    "ui": "tasks.services",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in STAGES:
        print(f"jagg: error: unknown command {cmd!r}; commands: {', '.join(STAGES)}.", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(STAGES[cmd])
    return module.main(["ui", *rest] if cmd == "ui" else rest)


if __name__ == "__main__":
    sys.exit(main())
