"""Stage `pretrain`: the toy profile's base model (real profiles use their weights).

The project ships the embedded default's base model (``assets/toy-base/``: weights, card, recipe, SHA-256 sums), so
every machine starts its RL from the same bits: a profile whose ``pretrain`` and ``world`` params are the shipped
card's recipe gets a verified copy of it. Any other recipe (the ci profile's short one) is pretrained here by flow
matching on the world; ``--force`` pretrains the shipped recipe from scratch (``jagg pretrain --force``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from jagg_core.setup.config import Params
from jagg_core.setup.json_read import read_json
from jagg_core.setup.paths import Layout
from jagg_core.errors import UserError
from jagg_core.setup.storage import (atomic_write_text, copy_tree, file_sha256, read_regular, read_text, replace_dir,
                                     temp_dir)

from .common import add_common_args, cli, layout, load, parse_overrides, stage_logger


def _read_card(card_path: Path) -> dict | None:
    """A base model's ``card.json``, read bounded and regular (a FIFO there hung `jagg pretrain`); None where it
    cannot be read or is not a mapping: no card, so the base model is made again (and its card rewritten whole)."""
    try:
        card = read_json(card_path, ValueError, limit=1 << 20)
    except ValueError:  # missing, not a regular file, too large, not UTF-8, not JSON
        return None
    return card if isinstance(card, dict) else None


def _same_recipe(card_path, params: Params) -> bool:
    """Whether the saved base model was pretrained with exactly these ``pretrain`` and ``world`` params."""
    card = _read_card(Path(card_path))
    want = json.loads(json.dumps({"pretrain": params.pretrain.model_dump(), "world": _pretrain_world(params)}))
    return isinstance(card, dict) and isinstance(card.get("world"), dict) and card.get("pretrain") == want["pretrain"] \
        and all(card["world"].get(k) == v for k, v in want["world"].items())


# The world params pretraining reads: the image size, and the seed and size of the split it holds out (the number of
# training prompts and of test prompts leave the base untouched, so changing them keeps a saved base).
PRETRAIN_WORLD_KEYS = ("image_size", "seed", "n_validation_per_style")


def _pretrain_world(params: Params) -> dict:
    return {k: getattr(params.world, k) for k in PRETRAIN_WORLD_KEYS}


SHIPPED_BASE = Path(__file__).resolve().parents[1] / "assets" / "toy-base"
RESTORE = "restore the shipped base with `git checkout -- assets/toy-base`"
SUMS = "SHA256SUMS"


def file_sums(folder: Path) -> dict[str, str]:
    """relative path -> SHA-256 of every file of ``folder`` but the sums file itself."""
    out = {}
    for p in sorted(q for q in folder.rglob("*") if q.is_file() and q.name != SUMS):
        out[str(p.relative_to(folder))] = file_sha256(p, UserError, fix=RESTORE)
    return out


def write_sums(folder: Path) -> None:
    """Write ``SHA256SUMS`` (``sha256sum`` format) for ``folder``: what ships is checked before every use."""
    atomic_write_text(folder / SUMS, "".join(f"{h}  {name}\n" for name, h in file_sums(folder).items()))


def verify_sums(folder: Path) -> None:
    """One sentence if a file of ``folder`` is missing, extra or not the bits its ``SHA256SUMS`` names."""
    try:
        text = read_text(folder / SUMS, UserError, limit=1 << 20)
        want = dict(reversed(line.split("  ", 1)) for line in text.splitlines() if line)
    except (UserError, ValueError) as e:
        raise UserError(f"the shipped base model {folder} has no readable {SUMS} ({e}); restore it with "
                        f"`git checkout -- {folder.name}`.") from None
    have = file_sums(folder)
    bad = sorted(set(want) ^ set(have) | {k for k in want.keys() & have.keys() if want[k] != have[k]})
    if bad:
        raise UserError(f"the shipped base model {folder} is damaged ({bad[0]} is missing, extra or changed); "
                        f"restore it with `git checkout -- assets/toy-base`.")


def _sums(folder: Path) -> bytes | None:
    """``folder``'s sums file as bytes, None where it cannot be read (a damaged copy: replaced)."""
    try:
        return read_regular(folder / SUMS, UserError, limit=1 << 20)
    except UserError:
        return None


def install_shipped_base(dest: Path, source: Path = SHIPPED_BASE) -> None:
    """Copy the verified shipped base model to ``dest`` (atomically), unless ``dest`` already holds its bits."""
    verify_sums(source)
    if (dest / SUMS).is_file() and _sums(dest) == _sums(source):
        try:
            verify_sums(dest)
            return
        except UserError:
            pass  # a damaged copy: replaced below
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(dest.parent, f".tmp-{dest.name}-")
    try:
        copy_tree(source, tmp, UserError)
        verify_sums(tmp)
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
    if not force and _same_recipe(SHIPPED_BASE / "card.json", params):
        install_shipped_base(lay.base_model)
        log.info("base model: the shipped one (assets/toy-base, SHA-256 verified) -> %s", lay.base_model)
        return _read_card(card_path)
    if not force and (lay.base_model / "transformer").is_dir() and _same_recipe(card_path, params):
        log.info("base model %s is up to date (same pretrain and world params); kept", lay.base_model)
        return _read_card(card_path)
    # loads torch: imported when the stage runs, so --help and a refused input answer without it
    from jagg_core.evaluation import load_hps_benchmark
    from jagg_core.pipeline.pretrain import pretrain_toy

    # Pretraining never sees the validation split: the world's first held-out split, which the shipped base was made
    # without (docs/toy_world.md, "Splits"); a world without one holds its test split out instead.
    held_out = lay.validation_prompts if params.world.n_validation_per_style else lay.prompts
    styles = sorted(p.stem for p in (held_out / "benchmark").glob("*.json"))
    if not styles:
        raise FileNotFoundError(f"no held-out prompts under {held_out / 'benchmark'}; run the prepare stage first "
                                f"(`jagg prepare`).")
    excluded = load_hps_benchmark(held_out, styles=styles)
    card = pretrain_toy(params, lay.base_model, exclude={p for ps in excluded.values() for p in ps}, progress=progress,
                        report=log.info)
    log.info("pretrained toy-flux: %d steps in %.0f s, loss %.4f -> %s", card["steps"], card["wall_seconds"],
             card["final_loss"], lay.base_model)
    return card


def pretrain_stage(params: Params) -> dict:
    return pretrain(params, layout(params), progress=False)




@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg pretrain", description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--force", action="store_true",
                    help="pretrain from scratch even if the saved or the shipped base model has these params")
    args = ap.parse_args(argv)
    params = load(args.profile, args.params, parse_overrides(args.overrides))
    pretrain(params, layout(params), force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
