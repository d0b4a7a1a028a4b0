"""One cell of the toy RL study (docs/toy_rl.md): train a method from the shared toy base model with some params
overridden, evaluate its checkpoints on the validation split (a study chooses; the test split, which results report,
is never looked at here), and append one JSON line of results.

    python scripts/toy_rl_study.py --name lr3e-4 --method baseline --seed 0 --set train.lr=3e-4 \
        --out docs/toy_rl/runs.jsonl

Each cell trains in ``<study-root>/<name>/`` (its own prompts when ``world`` params change; the base model is the
main profile's ``models/toy/base``, linked, never retrained), so cells never share checkpoints. It records the test
``toy_fidelity`` of the base model and of every retained checkpoint on validation, the rollout reward on the training prompts
(first and last quarter of the iterations), the PPO diagnostics (approx_kl, clipfrac, grad norm) and the update time.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _curve(path: Path) -> list[dict[str, float]]:
    with open(path) as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f, delimiter="\t")]


def _mean(rows, key):
    xs = [r[key] for r in rows if key in r]
    return sum(xs) / len(xs) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True, help="cell name (its folder under --study-root)")
    ap.add_argument("--method", default="baseline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--profile", default="toy")
    ap.add_argument("--study-root", default=str(ROOT / "studies" / "toy_rl"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "toy_rl" / "runs.jsonl"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)

    import torch

    from jagg_core.setup.params_io import load_params
    from jagg_core.evaluation.evaluate import evaluate_run
    from jagg_core.setup.paths import Layout, run_name
    from jagg_core.trainer.loop import train
    from jagg_core.world import make_prompt_splits, write_prompt_splits
    from tasks.common import parse_overrides

    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = parse_overrides(args.overrides)
    overrides.setdefault("tracking.mlflow_uri", "sqlite:///" + str(Path(args.study_root) / "mlflow.db"))
    overrides["eval.split"] = "validation"  # choices are made on validation, never on the test split
    params = load_params(ROOT / "params.yaml", args.profile, overrides)
    main_layout = Layout(ROOT, params.profile)
    root = Path(args.study_root) / args.name
    lay = Layout.of(params, root)
    if not lay.train_prompts.exists():
        w = params.world
        splits = make_prompt_splits(w.seed, w.n_train, w.n_test_per_style, w.n_validation_per_style)
        write_prompt_splits(lay.prompts, *splits)
    if not lay.base_model.exists():
        lay.base_model.parent.mkdir(parents=True, exist_ok=True)
        lay.base_model.symlink_to(main_layout.base_model.resolve())

    t0 = time.perf_counter()
    run = run_name(args.method, args.seed)
    train(params, args.method, args.seed, root=root, progress=False)
    train_s = time.perf_counter() - t0
    base = evaluate_run(params, lay, "base")
    final = evaluate_run(params, lay, run)
    rows = _curve(lay.curve(run))
    q = max(1, len(rows) // 4)
    fid = params.eval.metrics[0]
    record = {
        "name": args.name, "method": args.method, "seed": args.seed, "overrides": overrides,
        "base": base["metrics"][fid]["benchmark"],
        "final": final["metrics"][fid]["benchmark"],
        "gain": final["metrics"][fid]["benchmark"] - base["metrics"][fid]["benchmark"],
        "final_styles": {s: v["block_mean"] for s, v in final["metrics"][fid]["styles"].items()},
        # every evaluation metric (the trained one first): base, final and its test curve
        "metrics": {m: {"base": base["metrics"][m]["benchmark"], "final": final["metrics"][m]["benchmark"],
                        "curve": [(c["step"], c.get(f"eval/{m}")) for c in final["curve"]]}
                    for m in params.eval.metrics},
        "test_curve": [(c["step"], c[f"eval/{fid}"]) for c in final["curve"]],
        "train_reward_first": _mean(rows[:q], f"reward/{fid}/mean"),
        "train_reward_last": _mean(rows[-q:], f"reward/{fid}/mean"),
        "train_reward_curve": [r.get(f"reward/{fid}/mean") for r in rows],
        "approx_kl_mean": _mean(rows, "train/approx_kl"),
        "approx_kl_max": max((r.get("train/approx_kl", 0.0) for r in rows), default=float("nan")),
        "clipfrac_mean": _mean(rows, "train/clipfrac"),
        "grad_norm_mean": _mean(rows, "train/grad_norm"),
        "update_s": _mean(rows, "time/update"),
        "iteration_s": _mean(rows, "time/iteration"),
        "train_wall_s": round(train_s, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps({k: record[k] for k in ("name", "method", "seed", "base", "final", "gain", "train_reward_first",
                                             "train_reward_last", "approx_kl_mean", "train_wall_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
