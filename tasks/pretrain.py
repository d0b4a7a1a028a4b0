"""Stage `pretrain`: the toy profile's base model by flow matching on the world (real profiles use their weights)."""

from __future__ import annotations

import argparse
import json
import sys

from prefect import task

from jagg_core.pipeline.config import Params
from jagg_core.pipeline.paths import Layout
from jagg_core.pipeline.storage import atomic_write_text

from .common import add_common_args, cli, layout, load, parse_overrides, stage_logger


def _same_recipe(card_path, params: Params) -> bool:
    """Whether the saved base model was pretrained with exactly these ``pretrain`` and ``world`` params."""
    try:
        card = json.loads(card_path.read_text())
    except (OSError, ValueError):
        return False
    want = json.loads(json.dumps({"pretrain": params.pretrain.model_dump(), "world": params.world.model_dump()}))
    return isinstance(card, dict) and all(card.get(k) == v for k, v in want.items())


def pretrain(params: Params, lay: Layout, *, progress: bool = True, force: bool = False) -> dict:
    """Write ``models/<profile>/base/`` (toy) or a card naming the real weights; returns the model card.

    A toy base model already saved with the same ``pretrain`` and ``world`` params is kept (``force`` retrains it):
    rerunning the flow does not pay for pretraining again, and never changes the base of finished runs.
    """
    log = stage_logger("pretrain")
    if not params.is_toy:
        card = {"backbone": params.model.backbone, "path": params.model.path, "pretrained": "external weights"}
        atomic_write_text(lay.base_model / "card.json", json.dumps(card, indent=2) + "\n")
        log.info("%s uses its own weights (%s); nothing to pretrain", params.model.backbone, params.model.path)
        return card
    card_path = lay.base_model / "card.json"
    if not force and (lay.base_model / "transformer").is_dir() and _same_recipe(card_path, params):
        log.info("base model %s is up to date (same pretrain and world params); kept", lay.base_model)
        return json.loads(card_path.read_text())
    from jagg_core.evaluation import load_hps_benchmark
    from jagg_core.pipeline.pretrain import pretrain_toy

    styles = sorted(p.stem for p in lay.benchmark.glob("*.json"))
    if not styles:
        raise FileNotFoundError(f"no test prompts under {lay.benchmark}; run the prepare stage first (`jagg prepare`).")
    test = load_hps_benchmark(lay.prompts, styles=styles)
    card = pretrain_toy(params, lay.base_model, exclude={p for ps in test.values() for p in ps}, progress=progress,
                        report=log.info)
    log.info("pretrained toy-flux: %d steps in %.0f s, loss %.4f -> %s", card["steps"], card["wall_seconds"],
             card["final_loss"], lay.base_model)
    return card


@task(name="pretrain", retries=1)
def pretrain_task(params: Params) -> dict:
    return pretrain(params, layout(params), progress=False)


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg pretrain", description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--force", action="store_true", help="pretrain again even if the saved base model is up to date")
    args = ap.parse_args(argv)
    params = load(args.profile, args.params, parse_overrides(args.overrides))
    pretrain(params, layout(params), force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
