"""Stage `evaluate@<run>`: ODE samples of a run's checkpoints (or of the base model) on the test set, scored.

With ``resources.num_processes`` > 1 the stage runs ``accelerate launch`` with that many processes (one per GPU): they
split the test set by blocks of ``eval.batch_size`` images, generate and score their blocks, and rank 0 gathers the
scores and writes the summaries (the metrics of one process, bit for bit); the stage then logs them to MLflow. A
killed evaluation resumes: the images already written are not generated again.
"""

from __future__ import annotations

import argparse
import os
import sys

from jagg_core.setup.config import Params, ParamsError
from jagg_core.setup.json_read import read_json
from jagg_core.setup.paths import Layout, parse_run_name
from jagg_core.trainer.fingerprint import run_fingerprint

from .common import (DEFAULT_SWEEP, add_common_args, add_sweep_arg, cli, free_port, layout, load, orchestration_tags,
                     parse_overrides, stage_logger)
from .launch import die_with_parent, launch, local_context, read_context, stop_on_signals, user_error, write_context
from jagg_core.pipeline.tracking import Tracker
from jagg_core.setup.registry import backbone_spec
from jagg_core.evaluation import EvalError
from jagg_core.evaluation.conventions import evaluation_conventions, split_named
from jagg_core.setup.storage import read_score_records


def evaluate(params: Params, lay: Layout, run: str, *, sweep: str = DEFAULT_SWEEP) -> dict:
    """Evaluate ``run`` (``<method>-s<seed>`` or ``base``); metrics and images go to MLflow and ``eval/``."""
    # loads torch: imported when the stage runs, so --help and a refused input answer without it
    from jagg_core.evaluation.evaluate import test_prompts
    from jagg_core.rewards import check_rewards

    log = stage_logger("evaluate")
    lay.eval_dir(run)  # held inside the project (paths.held): a link there leading out is refused before any work
    check_rewards(params.reward.weights, params.reward.options, params.eval.metrics)  # before any model loads
    test_prompts(params, lay)  # and the test set is readable, before an MLflow run is opened
    method, seed = (None, None) if run == "base" else parse_run_name(run)
    key = "base" if run == "base" else run_fingerprint(params, lay, method, seed)
    tracker = Tracker(params, lay.root)
    # The evaluation's conventions beside its scores: protocol, scorers (model, weights, scale), resolution, steps,
    # guidance, the per-prompt seed rule (jagg_core/evaluation/protocols.py)
    # (on the validation split under eval-validation.*: the run may hold the test split's evaluation too)
    # Who ran it under eval.* (a pool's evaluation unit is a flow run of its own): the training's own
    # prefect_flow_run_id and dvc_stage stay its training's; the base model's run is its evaluation's own.
    own = orchestration_tags()
    tags = {split_named(k, params.eval.split): v
            for k, v in {**{f"eval.{k}": v for k, v in own.items()}, **evaluation_conventions(params)}.items()}
    if run == "base":
        tags.update(own)
    run_id = tracker.child_run(sweep, run, method=method, seed=seed, key=key, extra_tags=tags)
    # Whatever ends the evaluation (an error, Ctrl-C, SIGTERM) ends a run it left RUNNING: FAILED or KILLED.
    with tracker.ending(run_id, only_running=True):
        return _evaluate_logged(params, lay, run, tracker, run_id, log)


def _evaluate_logged(params: Params, lay: Layout, run: str, tracker, run_id: str, log) -> dict:  # noqa: ANN001
    """The evaluation itself, once its MLflow run is open (``tracker.ending`` around it in :func:`evaluate`)."""
    # loads torch: imported when the stage runs, so --help and a refused input answer without it
    from jagg_core.evaluation.evaluate import evaluate_run
    from jagg_core.media import image_grid

    logger = EvalLogger(tracker, run_id, params.eval.split)
    if params.resources.num_processes > 1:
        result = _evaluate_in_processes(params, lay, run, log)
        for point in result["curve"]:
            logger.log_metrics({k: v for k, v in point.items() if k != "step"}, point["step"])
    else:
        result = evaluate_run(params, lay, run, logger=logger, report=log.info)
    # A few test images per evaluated step, under one key: MLflow's image grid compares methods step by step.
    n = params.eval.num_images_logged
    if n:
        # loads torch: imported when the stage runs, so --help and a refused input answer without it
        from jagg_core.evaluation.benchmark import image_path, load_image
        from jagg_core.evaluation.clip_layout import strip_path, strips_grid

        prompts = [(s, i, p) for s, ps in _first_prompts(lay, result).items() for i, p in enumerate(ps)][:n]
        for point in result["curve"]:
            if point["step"] not in logger.new_steps:  # logged with its scores by an earlier evaluation
                continue
            root = lay.eval_dir(run) / "steps" / f"{point['step']:06d}" / "images"
            if backbone_spec(params.model.backbone).video:  # clips: their saved frame strips, one per row
                if prompts:
                    logger.log_image(strips_grid([strip_path(root, s, i) for s, i, _ in prompts],
                                                 [p for _, _, p in prompts]), "eval", point["step"])
                continue
            images = [load_image(image_path(root, s, i)) for s, i, _ in prompts]
            if images:
                import torch

                logger.log_image(image_grid(torch.stack(images), [p for _, _, p in prompts], ncols=4), "eval",
                                 point["step"])
    tracker.log_artifact(run_id, lay.eval_dir(run) / "metrics.json", "eval")
    if run == "base" and params.is_toy:  # the toy's ceiling, beside its base model: the report's gap to close
        # loads torch: imported when the stage runs, so --help and a refused input answer without it
        from jagg_core.evaluation.evaluate import evaluate_ground_truth

        truth = {k: v["benchmark"] for k, v in evaluate_ground_truth(params, lay)["metrics"].items()}
        logger.log_metrics({f"eval/ground_truth/{k}": v for k, v in truth.items()}, 0)
        log.info("ground truth (the world's renders): %s", ", ".join(f"{k} {v:.4f}" for k, v in truth.items()))
    tracker.finish(run_id)  # the base model's run starts here; a method's run was its training run
    main = {k: v["benchmark"] for k, v in result["metrics"].items()}
    log.info("%s at step %d (%s): %s", run, result["step"], params.eval.protocol,
             ", ".join(f"{k} {v:.4f}" for k, v in main.items()))
    return result


class EvalLogger:
    """The evaluation's MLflow logger (a :class:`~jagg_core.setup.metric_logger.MetricLogger`): its names say the
    split (``eval/…`` on the test split, ``eval-validation/…`` on validation: ``conventions.split_named``), and each
    point is logged once: a metric the run already holds at that step with that value is not appended again (every
    re-evaluation appended the whole curve again). A step with nothing new logs no images either."""

    def __init__(self, tracker, run_id: str, split: str):  # noqa: ANN001  (a Tracker)
        self.logger, self.tracker, self.run_id, self.split = tracker.logger(run_id), tracker, run_id, split
        self.new_steps: set[int] = set()  # steps at which this evaluation logged something the run did not hold
        self._held: dict[str, set[tuple[int, float]]] = {}

    def _holds(self, key: str, step: int, value: float) -> bool:
        if key not in self._held:
            self._held[key] = self.tracker.metric_points(self.run_id, key)
        return (int(step), float(value)) in self._held[key]

    def log_metrics(self, metrics, step: int) -> None:  # noqa: ANN001  (Mapping[str, float])

        named = {split_named(k, self.split): v for k, v in metrics.items()}
        new = {k: v for k, v in named.items() if v == v and not self._holds(k, step, v)}  # NaN: never logged
        if new:
            self.logger.log_metrics(new, step)
            self.new_steps.add(int(step))
            for k, v in new.items():
                self._held[k].add((int(step), float(v)))

    def log_image(self, image, key: str, step: int) -> None:  # noqa: ANN001

        self.logger.log_image(image, split_named(key, self.split), step)


def _evaluate_in_processes(params: Params, lay: Layout, run: str, log) -> dict:  # noqa: ANN001
    """`accelerate launch` resources.num_processes evaluation workers of ``run``; returns rank 0's result."""
    context = local_context(f"evaluate-{run}")  # written 0600: params may hold credentials
    n = params.resources.num_processes
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n), "--num_machines", "1",
           "--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           "-m", "tasks.evaluate", "--run", run, "--worker-context", str(context)]
    log.info("evaluating %s in %d processes", run, n)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        write_context(context, params, lay, "", "")
        rc, tail = launch(cmd, lay, env, f"evaluate {run}", log)
    finally:
        context.unlink(missing_ok=True)
    if rc != 0:
        raise EvalError(f"evaluating {run} failed: " +
                        (user_error(tail) or f"exit status {rc}; last output: {tail[-1] if tail else ''}"))
    return read_json(lay.eval_dir(run) / "metrics.json", EvalError, fix=f"evaluate {run} again")


def _worker(params: Params, lay: Layout, run: str) -> None:
    """Inside `accelerate launch`: this process's share of the evaluation (rank 0 writes the summaries)."""
    from accelerate import PartialState

    # loads torch: imported when the stage runs, so --help and a refused input answer without it
    from jagg_core.build import pick_device
    from jagg_core.evaluation.evaluate import Part, evaluate_run

    state = PartialState(cpu=pick_device(params).type == "cpu")
    log = stage_logger("evaluate")
    part = Part(state.process_index, state.num_processes)
    evaluate_run(params, lay, run, part=part, device=state.device, report=log.info if part.main else None)


def _first_prompts(lay: Layout, result: dict, per_style: int = 2) -> dict[str, list[str]]:
    out = {}
    path = (lay.root / result["images"]).parent / "scores.jsonl"
    for row in read_score_records(path, EvalError, fix=f"run `jagg evaluate --run {result.get('run', 'RUN')}` again"):
        if row["index"] < per_style:
            out.setdefault(row["style"], []).append(row["prompt"])
    return out


def evaluate_stage(params: Params, run: str, sweep: str = DEFAULT_SWEEP) -> dict:
    return evaluate(params, layout(params), run, sweep=sweep)




@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg evaluate", description=__doc__.splitlines()[0])
    add_common_args(ap)
    add_sweep_arg(ap)
    ap.add_argument("--run", required=True, help="<method>-s<seed> (e.g. jagg-s0), or base for the base model")
    ap.add_argument("--worker-context", default=None, help=argparse.SUPPRESS)  # written by _evaluate_in_processes
    args = ap.parse_args(argv)
    if args.worker_context:
        import signal

        die_with_parent(signal.SIGTERM)  # a killed launcher (accelerate) takes its workers with it
        params, lay, _ = read_context(args.worker_context)
        _worker(params, lay, args.run)
        return 0
    params = load(args.profile, args.params, parse_overrides(args.overrides))

    stop_on_signals()  # SIGTERM as Ctrl-C: the MLflow run ends KILLED, worker groups stop (tasks/launch.py)
    if args.run != "base":
        try:
            params.method(parse_run_name(args.run)[0])
        except ValueError as e:
            raise ParamsError(str(e)) from None
    evaluate(params, layout(params), args.run, sweep=args.sweep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
