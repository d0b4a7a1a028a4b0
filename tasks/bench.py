"""Stage `bench`: update-stage speed, memory and communication of exact vs JAGG vs ablate, side by side.

    jagg bench [--model toy|large|both] [--windows 2,4,8] [--fracs 0.6,1.0] [--repeats 7] [--batch N] [--steps T]
               [--threads N] [--no-memory] [--no-comm] [--out bench/] [--write-docs docs/benchmarks.md]
               [--profile NAME] [--no-mlflow] [--main-job reports/toy]

Built-in models (random weights): `toy`, the embedded default's geometry, and `large`, a Flux-shaped ~36 M-parameter
transformer. `--profile NAME` benchmarks that profile's real policy instead (its weights, its device: a GPU for
flux/sd3/qwenimage). Each model writes `<out>/<timestamp>-<model>.json` and an MLflow run in the `jagg-bench`
experiment; `--write-docs` renders all models of the run into one markdown page. The defaults take a few minutes
for `toy` and about an hour for `large` on 2 CPU cores (run it on a quiet machine: other work distorts the times).
Each timed round is kept in `<out>/rounds/<model>/` as it ends, with its ratio and the time left printed; a rerun
with the same settings on the same machine continues after the last kept round (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from jagg_core.bench import (BUILTIN_MODELS, BenchConfig, BenchError, discard_rounds, model_spec, profile_spec,
                             run_bench, save_result)
from jagg_core.setup.config import Params

from jagg_core.pipeline.bench_docs import read_main_job, write_markdown
from .common import DEFAULT_SWEEP, ROOT, add_common_args, add_sweep_arg, cli, load, parse_overrides, stage_logger
from jagg_core.pipeline.tracking import Tracker
from jagg_core.setup.paths import held, inside

__all__ = ["bench", "main", "parse_list"]

EXPERIMENT = "jagg-bench"


def parse_list(flag: str, text: str, kind: type, example: str) -> tuple:
    """``"2,4,8"`` -> ``(2, 4, 8)``; anything else is a one-sentence error naming the flag."""
    try:
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise BenchError(f"{flag} {text!r} must be a comma-separated list of {kind.__name__}s, e.g. {example}.") \
            from None


def _tracker(params: Params, root: Path):
    tracking = params.tracking.model_copy(update={"experiment": EXPERIMENT})
    return Tracker(params.model_copy(update={"tracking": tracking}), root)


def _metrics(result: dict) -> dict[str, float]:
    """The run's numbers as MLflow metrics, namespaced like the trainer's (``time/…``, ``jagg/…``)."""
    m: dict[str, float] = {f"time/{k}": p["median"] for k, p in result["primitives"].items() if isinstance(p, dict)}
    for c in result["cells"]:
        m[f"time/update/{c['key']}"] = c["time"]["median"]
        m[f"bench/speedup/{c['key']}"] = c["speedup"]
        m[f"bench/ideal_speedup/{c['key']}"] = c["ideal_speedup"]
        m[f"bench/measured_over_ideal/{c['key']}"] = c["measured_over_ideal"]
        if c["counts_per_group"]:
            m[f"bench/backward_calls_per_group/{c['key']}"] = c["counts_per_group"]["backward_calls"]
    for k, f in result["fidelity"].get("anchors", {}).items():
        for pos, cj in zip(f["positions"], f["cos_jagg"]):
            m[f"jagg/cos_jagg/K{k}/g{pos}"] = cj
    for row in result["memory"].get("variants", []):
        m[f"memory/update_peak_mb/{row['variant']}"] = row["update_peak_mb"]
    for row in result["comm"].get("allreduce", []):
        m[f"comm/all_reduces/W{row['window']}/{row['variant']}"] = row["all_reduces"]
    for row in result["comm"].get("fsdp2", []):
        m[f"comm/fsdp_all_gathers_per_group_per_module/W{row['window']}/{row['variant']}"] = (
            row["all_gathers_per_group_per_module"])
    return m


def _log_mlflow(tracker: Any, result: dict, path: Path, sweep: str = DEFAULT_SWEEP) -> str:
    """One run per model: params (the bench settings and the model), metrics, and the JSON as artifact."""
    run_id = tracker.child_run(sweep, f"bench-{result['model']['name']}", method=None, seed=None, key=path.stem,
                               extra_tags={"jagg.bench": "1"}, per_sweep=True)  # a sweep's own measurement
    tracker.log_params(run_id, {"bench": {**result["config"], "model": result["model"]["name"],
                                          "trainable_params": result["model"]["trainable_params"],
                                          "cpu": result["machine"]["cpu"], "device": result["machine"]["device"]}})
    tracker.logger(run_id).log_metrics(_metrics(result), step=0)
    tracker.log_artifact(run_id, path, "bench")
    tracker.finish(run_id)
    return run_id


def bench(params: Params, cfg: BenchConfig, *, models: Sequence[str] = ("toy",), profile: bool = False,
          root: Path = ROOT, out: str | Path = "bench", write_docs: str | Path | None = None, mlflow: bool = True,
          params_path: str | Path | None = None, progress: bool = True,
          sweep: str = DEFAULT_SWEEP, main_job: str | Path | None = None) -> list[Path]:
    """Benchmark each built-in model of ``models``, or with ``profile`` the policy of ``params`` itself (from its
    weights); returns the JSON files written under ``root / out``."""
    # loads torch: imported when the stage runs, so --help and a refused input answer without it
    from jagg_core.build import pick_device

    cfg.validate()
    log = stage_logger("bench")
    root = Path(root)
    # Every path argument follows the project's one rule (inside the project, a folder or a file as it names),
    # checked before the work: `--out ../b --write-docs ../b.md` wrote outside the project, and `--write-docs docs`
    # (a folder) was an IsADirectoryError after the whole benchmark had run.

    out_dir = inside(root, out, "--out", kind="dir")
    docs = inside(root, write_docs, "--write-docs", kind="file") if write_docs else None
    if main_job:  # a report folder inside the project, read before the work
        inside(root, main_job, "--main-job", kind="dir")
    job = {**read_main_job(root / main_job), "label": str(main_job)} if main_job else None  # fails before the work
    device = str(pick_device(params))
    specs = ([profile_spec(params, device=device, params_path=params_path or root / "params.yaml", root=root)]
             if profile else [model_spec(m, params, device=device) for m in models])
    for spec in specs:  # each model's rounds folder held inside the project (paths.held), before the work
        held(out_dir / "rounds" / spec.name)
    tracker = _tracker(params, root) if mlflow else None  # a store that cannot be opened fails before the work
    results, paths = [], []
    for spec in specs:
        rounds = out_dir / "rounds" / spec.name  # each timed round as it ends; a rerun continues from them
        result = run_bench(spec, cfg, progress=log.info if progress else None,
                           bar=progress and sys.stderr.isatty(), rounds_dir=rounds)
        path = save_result(result, out_dir)
        discard_rounds(rounds)  # the result holds them: a finished bench reruns afresh
        log.info("bench %s: %s", spec.name, path)
        if tracker is not None:
            _log_mlflow(tracker, result, path, sweep)
        results.append(result)
        paths.append(path)
    if docs is not None:
        log.info("bench: %s", write_markdown(results, docs, main_job=job))
    return paths


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg bench", description=__doc__.splitlines()[0],
                                 epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    add_sweep_arg(ap)
    ap.add_argument("--model", default=None,
                    help="built-in model: toy | large | both (default toy; not with --profile)")
    d = BenchConfig()  # the one place the defaults live
    windows, fracs = ",".join(map(str, d.windows)), ",".join(f"{x:g}" for x in d.fracs)
    ap.add_argument("--windows", default=windows, help=f"group sizes W, comma-separated (default {windows})")
    ap.add_argument("--fracs", default=fracs, help=f"jagg_frac values, comma-separated (default {fracs})")
    ap.add_argument("--variants", default="",
                    help="only these variants beside exact, comma-separated, e.g. jagg-joint,jagg-sequential "
                         "(default: every one)")
    ap.add_argument("--repeats", type=int, default=d.repeats, help=f"timed rounds after one warm-up (default {d.repeats})")
    ap.add_argument("--batch", type=int, default=d.batch, help=f"images per micro-batch (default {d.batch})")
    ap.add_argument("--steps", type=int, default=d.steps, help=f"trained steps T, a multiple of every W (default {d.steps})")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: resources.num_threads, else every usable core)")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-variant memory probes")
    ap.add_argument("--no-comm", action="store_true", help="skip the 2-process communication counts")
    ap.add_argument("--out", default="bench", help="folder of the JSON results, repository-relative (default bench)")
    ap.add_argument("--write-docs", default=None, metavar="PATH", help="also write the markdown tables here")
    ap.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    ap.add_argument("--main-job", default=None, metavar="REPORT_DIR",
                    help="with --write-docs: add the iteration breakdown of a finished run's report, e.g. reports/toy")
    args = ap.parse_args(argv)

    if args.profile and args.model:
        raise BenchError("--model picks a built-in model and --profile a profile's real policy; give one of them.")
    model = args.model or "toy"
    if model not in (*BUILTIN_MODELS, "both"):
        raise BenchError(f"--model {model!r} is not one of toy, large, both.")
    params = load(args.profile, args.params, parse_overrides(args.overrides))
    models = list(BUILTIN_MODELS) if model == "both" else [model]
    threads = args.threads if args.threads is not None else (
        params.resources.num_threads or len(os.sched_getaffinity(0)))
    cfg = BenchConfig(windows=parse_list("--windows", args.windows, int, windows),
                      fracs=parse_list("--fracs", args.fracs, float, fracs), repeats=args.repeats,
                      batch=args.batch, steps=args.steps, threads=threads, memory=not args.no_memory,
                      comm=not args.no_comm, variants=parse_list("--variants", args.variants, str, "jagg-joint"))
    bench(params, cfg, models=models, profile=bool(args.profile), out=args.out, write_docs=args.write_docs,
          mlflow=not args.no_mlflow, params_path=args.params, sweep=args.sweep, main_job=args.main_job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
