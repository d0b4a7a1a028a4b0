"""Stage `train@<method>-s<seed>`: one GRPO training run, launched through `accelerate launch`.

The stage function starts ``accelerate launch [...] -m tasks.train --worker`` with the profile's process count, the
method's own ``CUDA_VISIBLE_DEVICES`` and rendezvous port (so methods can share a machine on GPU partitions), and
streams the workers' output into the Prefect log. The worker (rank 0) logs every metric to the run's MLflow child run.
A killed run resumes from its last complete checkpoint when started again (the Prefect task retries do that).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

from prefect import task

from jagg_core.config import Params
from jagg_core.paths import Layout, run_name
from jagg_core.trainer import TrainingError

from .common import add_common_args, cli, layout, load, orchestration_tags, parse_overrides, stage_logger, sweep_id
from jagg_core.trainer.fingerprint import run_fingerprint


def accelerate_command(params: Params, method: str, worker_args: list[str]) -> list[str]:
    """``accelerate launch`` with the profile's processes, machines and a port of the method's own."""
    res = params.resources
    index = list(params.methods).index(method)
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if res.accelerate_config:
        cmd += ["--config_file", res.accelerate_config]
    cmd += ["--num_processes", str(res.num_processes * res.num_machines), "--num_machines", str(res.num_machines),
            "--machine_rank", str(res.machine_rank), "--main_process_port", str(res.main_process_port + index),
            "--mixed_precision", res.mixed_precision, "--dynamo_backend", "no"]
    if res.num_processes * res.num_machines > 1 and not res.accelerate_config:
        cmd += ["--multi_gpu"]  # also the multi-process switch on CPU (gloo), with Accelerator(cpu=True)
    if res.main_process_ip:
        cmd += ["--main_process_ip", res.main_process_ip]
    return cmd + ["-m", "tasks.train", "--worker", *worker_args]


def train_run(params: Params, lay: Layout, method: str, seed: int, *, params_path: Path | None = None) -> dict:
    """Run one training run to completion (resuming if checkpoints exist); returns its final metrics."""
    from jagg_core.tracking import Tracker

    log = stage_logger("train")
    run = run_name(method, seed)
    key = run_fingerprint(params, lay, method, seed)
    tracker = Tracker(params, lay.root)  # fails here, before any training, if the store is unreachable
    mlflow_run = tracker.child_run(sweep_id(), run, method=method, seed=seed, key=key,
                                   extra_tags=orchestration_tags())
    env = dict(os.environ)
    env.update({"JAGG_ROOT": str(lay.root), "JAGG_MLFLOW_RUN": mlflow_run, "JAGG_RUN_KEY": key,
                "PYTHONUNBUFFERED": "1"})
    if method in params.resources.cuda_visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = params.resources.cuda_visible_devices[method]
    worker = ["--profile", params.profile, "--method", method, "--seed", str(seed),
              "--params", str(params_path or lay.root / "params.yaml"), "--set-json", params.model_dump_json()]
    cmd = accelerate_command(params, method, worker)
    log.info("launching %s: %s", run, " ".join(cmd[:14]) + " ...")
    tail: deque[str] = deque(maxlen=30)
    with subprocess.Popen(cmd, cwd=lay.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as proc:
        for line in proc.stdout:  # type: ignore[union-attr]
            line = line.rstrip()
            tail.append(line)
            if line and "\r" not in line:
                log.info("[%s] %s", run, line)
        rc = proc.wait()
    if rc != 0:
        errors = [ln for ln in tail if ln.startswith("jagg: error:")]
        reason = errors[-1].removeprefix("jagg: error: ") if errors else f"exit status {rc}; last output: {tail[-1] if tail else ''}"
        tracker.finish(mlflow_run, "FAILED")
        raise TrainingError(f"training run {run} failed: {reason}")
    tracker.finish(mlflow_run)
    return {"run": run, "mlflow_run_id": mlflow_run, "curve": str(lay.curve(run))}


def worker(params: Params, lay: Layout, method: str, seed: int) -> None:
    """Inside `accelerate launch`: train, logging to the MLflow run named by the launcher (rank 0 logs)."""
    from jagg_core.trainer import train

    logger = None
    # The trainer's progress lines go to stdout, which the launcher relays to its log (and Prefect's).
    trainer_log = logging.getLogger("jagg_core")
    if not trainer_log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        trainer_log.addHandler(handler)
    trainer_log.setLevel(logging.INFO)
    trainer_log.propagate = False
    if os.environ.get("JAGG_MLFLOW_RUN") and int(os.environ.get("RANK", "0")) == 0:
        from jagg_core.tracking import Tracker

        logger = Tracker(params, lay.root).logger(os.environ["JAGG_MLFLOW_RUN"])
    train(params, method, seed, root=lay.root, logger=logger, run_key=os.environ.get("JAGG_RUN_KEY"),
          progress=sys.stderr.isatty())


@task(name="train", retries=2, retry_delay_seconds=5)
def train_task(params: Params, method: str, seed: int) -> dict:
    """A training run; a retry resumes from the last complete checkpoint."""
    return train_run(params, layout(params), method, seed)


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg train", description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--method", required=True, help="a method defined under `methods` in params.yaml")
    ap.add_argument("--seed", type=int, default=None, help="training seed (default: the first of run.seeds)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--set-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.set_json:  # the launcher's already-validated params, so every rank trains exactly the same config
        params = Params.model_validate_json(args.set_json)
    else:
        params = load(args.profile, args.params, parse_overrides(args.overrides))
    seed = params.run.seeds[0] if args.seed is None else args.seed
    params.method(args.method)  # an unknown method fails here, before anything starts
    lay = layout(params)
    if args.worker:
        worker(params, lay, args.method, seed)
    else:
        train_run(params, lay, args.method, seed, params_path=Path(args.params) if args.params else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
