"""Stage `prepare`: the prompt sets — train.jsonl and the test set as benchmark/<style>.json and/or test.json.

The toy profile generates them from the world's grammar (its test split in both layouts, its validation split the
same way under validation/); real profiles copy their
training prompts (``data.train_prompts``) and the test set of ``eval.protocol`` -- HPDv2's benchmark/ or its test.json
(``eval.benchmark`` or the HF cache) -- into the same layout, so every later stage reads one format.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jagg_core.setup.config import Params, ParamsError
from jagg_core.setup.paths import Layout
from jagg_core.setup.storage import atomic_write_text, read_prompts, write_prompts_jsonl

from .common import add_common_args, cli, layout, load, parse_overrides, stage_logger
from jagg_core.world import make_prompt_splits, write_prompt_splits


def prepare(params: Params, lay: Layout) -> dict:
    """Write ``data/<profile>/prompts/{train.jsonl, benchmark/<style>.json | test.json}``; returns a summary."""
    log = stage_logger("prepare")
    if params.is_toy:
        w = params.world
        train, test, validation = make_prompt_splits(w.seed, w.n_train, w.n_test_per_style, w.n_validation_per_style)
        write_prompt_splits(lay.prompts, train, test, validation)
    else:
        # loads torch: imported when the stage runs, so --help and a refused input answer without it
        from jagg_core.evaluation import load_hps_benchmark
        from jagg_core.evaluation.protocols import load_hpdv2_test

        if not params.data.train_prompts:
            raise ParamsError(
                f"profile {params.profile}: data.train_prompts is not set; point it at a .txt or .jsonl file of "
                f"training prompts (e.g. Flow-GRPO's dataset/pickscore/train.txt)."
            )
        if not Path(params.data.train_prompts).is_file():
            raise ParamsError(
                f"profile {params.profile}: data.train_prompts = {params.data.train_prompts} does not exist; point it "
                f"at your .txt or .jsonl file of training prompts (e.g. Flow-GRPO's dataset/pickscore/train.txt)."
            )
        train = read_prompts(params.data.train_prompts)
        # The test set of eval.protocol (jagg_core/evaluation/protocols.py): the benchmark's styles or the test list
        test_list = params.eval.protocol == "hpdv2-test"
        test = (load_hpdv2_test if test_list else load_hps_benchmark)(params.eval.benchmark)
        write_prompts_jsonl(lay.train_prompts, train)
        if test_list:
            listed = [{"prompt": p} for p in test["test"]]
            atomic_write_text(lay.prompts / "test.json", json.dumps(listed, indent=1) + "\n")
        else:
            for style, prompts in test.items():
                atomic_write_text(lay.benchmark / f"{style}.json", json.dumps(prompts, indent=1) + "\n")
    summary = {"train": len(train), "test": {s: len(p) for s, p in test.items()}, "dir": str(lay.prompts)}
    if params.is_toy and validation:
        summary["validation"] = {s: len(p) for s, p in validation.items()}
    log.info("prompts: %d train, test %s%s -> %s", summary["train"], summary["test"],
             f", validation {summary['validation']}" if "validation" in summary else "", lay.prompts)
    return summary


def prepare_stage(params: Params) -> dict:
    return prepare(params, layout(params))




@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg prepare", description=__doc__.splitlines()[0])
    add_common_args(ap)
    args = ap.parse_args(argv)
    params = load(args.profile, args.params, parse_overrides(args.overrides))
    prepare(params, layout(params))
    return 0


if __name__ == "__main__":
    sys.exit(main())
