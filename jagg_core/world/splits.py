"""Train, validation and test prompt splits, on disk in the layout of the HPSv2.1 benchmark.

``out_dir/train.jsonl`` holds one ``{"prompt": ...}`` per line; ``out_dir/benchmark/<style>.json`` holds a JSON list
of prompt strings per style (here one style per prompt family), as HPSv2.1's ``benchmark/{anime,...,photo}.json``;
``out_dir/validation/`` holds the validation split in the same layout. Choices (studies, pilots, recipes) are made on
validation; results are reported on test, which no choice looks at (docs/toy_world.md, "Splits").
Writes are atomic and everything is validated before the first byte is written, so a bad input leaves nothing behind.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from ..setup.json_read import read_json
from ..setup.storage import atomic_write_text, write_prompts_jsonl
from .sample import sample_prompt
from .scene import FAMILIES

__all__ = ["PromptSplits", "make_prompt_splits", "read_benchmark", "validate_style", "write_prompt_splits"]

_STYLE = re.compile(r"[a-z0-9-]+")


def validate_style(style: str) -> str:
    """``style`` if it is a safe file stem (lower-case letters, digits and '-'), else a ``ValueError``."""
    if not isinstance(style, str) or not _STYLE.fullmatch(style):
        raise ValueError(f"style names use only lower-case letters, digits and '-', got {style!r}.")
    return style


def _validate_prompts(prompts: object, where: str) -> list[str]:
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"{where} must be a list of prompt strings, got {type(prompts).__name__}.")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise ValueError(f"{where} must hold only prompt strings, but item {i} is {type(p).__name__}.")
    if not prompts:
        raise ValueError(f"{where} is empty; it needs at least one prompt.")
    return list(prompts)


class PromptSplits(NamedTuple):
    """The world's prompt splits: ``train`` (RL), ``test`` and ``validation`` by style (one style per family)."""

    train: list[str]
    test: dict[str, list[str]]
    validation: dict[str, list[str]]


def make_prompt_splits(seed: int, n_train: int, n_test_per_style: int, n_validation_per_style: int = 0) -> PromptSplits:
    """Distinct random prompts: ``n_validation_per_style`` per family, then ``n_train`` others, then
    ``n_test_per_style`` per family that are neither.

    The three splits share no prompt, and the same seed gives the same splits. The order of the draws is the order in
    which the splits came to be: the validation split is the world's first held-out split (the one the shipped base was
    pretrained without, and the one the recipe was chosen on), the test split was drawn after it, from other prompts.
    """
    if n_train < 1 or n_test_per_style < 1 or n_validation_per_style < 0:
        raise ValueError(f"n_train and n_test_per_style must be positive and n_validation_per_style not negative, got "
                         f"{n_train}, {n_test_per_style} and {n_validation_per_style}.")
    rng = np.random.default_rng(seed)

    def draw(n: int, families: Sequence[str], taken: set[str]) -> list[str]:
        out: dict[str, None] = {}  # insertion-ordered set
        for _ in range(50 * n + 1000):
            if len(out) == n:
                return list(out)
            prompt = sample_prompt(rng, families[rng.integers(len(families))])
            if prompt not in taken:
                out[prompt] = None
        raise ValueError(f"could not draw {n} distinct {'/'.join(families)} prompts; ask for fewer.")

    validation: dict[str, list[str]] = {}
    if n_validation_per_style:
        for family in FAMILIES:
            validation[family] = draw(n_validation_per_style, [family], set())
    taken = {p for prompts in validation.values() for p in prompts}
    train = draw(n_train, FAMILIES, taken)
    taken |= set(train)
    test: dict[str, list[str]] = {}
    for family in FAMILIES:
        test[family] = draw(n_test_per_style, [family], taken)
    return PromptSplits(train, test, validation)


def _validate_styles(split: object, name: str) -> dict[str, list[str]]:
    if not isinstance(split, Mapping) or not split:
        raise ValueError(f"the {name} split must be a non-empty mapping from style name to prompts.")
    return {validate_style(s): _validate_prompts(p, f"{name} style {s!r}") for s, p in split.items()}


def _write_held_out(folder: Path, split: Mapping[str, list[str]]) -> None:
    (folder / "benchmark").mkdir(parents=True, exist_ok=True)
    for style, prompts in split.items():
        atomic_write_text(folder / "benchmark" / f"{style}.json", json.dumps(prompts, indent=1) + "\n")
    # The same prompts as one test list in HPDv2's test.json layout, style after style (eval.protocol: hpdv2-test).
    listed = [{"prompt": p, "style": style} for style in sorted(split) for p in split[style]]
    atomic_write_text(folder / "test.json", json.dumps(listed, indent=1) + "\n")


def write_prompt_splits(out_dir: str | Path, train: Sequence[str], test: Mapping[str, Sequence[str]],
                        validation: Mapping[str, Sequence[str]] | None = None) -> None:
    """Write ``out_dir/train.jsonl``, ``out_dir/benchmark/<style>.json`` and ``out_dir/test.json`` (the test split as
    one list of ``{"prompt", "style"}``, HPDv2's test-list layout), and the validation split the same way under
    ``out_dir/validation/``; validated first (no prompt in two splits), each file atomic."""
    train = _validate_prompts(train, "the train split")
    held = {"test": _validate_styles(test, "test")}
    if validation:
        held["validation"] = _validate_styles(validation, "validation")
    splits = {"train": set(train), **{k: set().union(*v.values()) for k, v in held.items()}}
    names = list(splits)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            leaked = splits[a] & splits[b]
            if leaked:
                raise ValueError(f"{len(leaked)} {b} prompts are also in {a}, e.g. {sorted(leaked)[0]!r}.")

    out_dir = Path(out_dir)
    write_prompts_jsonl(out_dir / "train.jsonl", train)
    _write_held_out(out_dir, held["test"])
    if "validation" in held:
        _write_held_out(out_dir / "validation", held["validation"])


def read_benchmark(folder: str | Path, styles: Sequence[str] | None = None) -> dict[str, list[str]]:
    """The prompts of each style in a benchmark folder (``<style>.json`` files), all of them or only ``styles``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"benchmark folder {str(folder)!r} does not exist.")
    if styles is None:
        styles = sorted(p.stem for p in folder.glob("*.json"))
        if not styles:
            raise ValueError(f"benchmark folder {str(folder)!r} has no <style>.json files.")
    out: dict[str, list[str]] = {}
    for style in styles:
        path = folder / f"{validate_style(style)}.json"
        if not path.is_file():
            raise ValueError(f"benchmark style {style!r} has no file {str(path)!r}.")
        prompts = read_json(path, ValueError, fix="fix or regenerate the benchmark folder")
        out[style] = _validate_prompts(prompts, f"benchmark file {str(path)!r}")
    return out
