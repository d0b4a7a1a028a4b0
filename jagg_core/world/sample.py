"""Random draws from the world, all from a ``np.random.Generator``: prompts of a family, a scene satisfying a
prompt, and (caption, image) pretraining pairs whose captions are sometimes wrong, like web alt-text.

The imperfect captions are a deliberate knob (``caption_noise``): a base model pretrained on them follows prompts
only imperfectly, which leaves reinforcement learning something to improve.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import replace

import numpy as np

from .grammar import caption, parse_prompt
from .render import render
from .scene import (
    BACKGROUNDS,
    CELLS,
    COLORS,
    FAMILIES,
    NUMBERS,
    RELATIONS,
    SHAPES,
    SIZES,
    Object,
    ObjectSpec,
    PromptSpec,
    Scene,
    cell_assignments,
)

__all__ = ["CORRUPTIONS", "corrupt_spec", "sample_prompt", "sample_spec", "sample_training_pair", "scene_for_prompt"]

P_SIZE = 0.5  # chance that a prompt names an object's size (single, pair and count families)
P_CELL = 0.5  # chance that a single-object prompt names its position
P_BACKGROUND = 0.5  # chance that a prompt names the background (the scene family always does)
SCENE_OBJECTS = (2,)  # how many objects a scene prompt names


def _pick(rng: np.random.Generator, options):
    options = list(options)
    return options[rng.integers(len(options))]


def _maybe(rng: np.random.Generator, p: float, options):
    value = _pick(rng, options)  # drawn either way, so the stream does not depend on the coin
    return value if rng.random() < p else None


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown prompt family {family!r}; the world has {', '.join(FAMILIES)}.")


def sample_spec(rng: np.random.Generator, family: str) -> PromptSpec:
    """A random prompt of ``family`` (one of :data:`FAMILIES`), as a spec."""
    _check_family(family)
    if family == "single":
        o = ObjectSpec(_pick(rng, SHAPES), _pick(rng, COLORS), _maybe(rng, P_SIZE, SIZES), _maybe(rng, P_CELL, CELLS))
        return PromptSpec("single", (o,), background=_maybe(rng, P_BACKGROUND, BACKGROUNDS))
    if family == "pair":
        a = ObjectSpec(_pick(rng, SHAPES), _pick(rng, COLORS), _maybe(rng, P_SIZE, SIZES))
        b = a
        while (b.shape, b.color) == (a.shape, a.color):  # two objects that the words tell apart
            b = ObjectSpec(_pick(rng, SHAPES), _pick(rng, COLORS), _maybe(rng, P_SIZE, SIZES))
        return PromptSpec("pair", (a, b), _pick(rng, RELATIONS), _maybe(rng, P_BACKGROUND, BACKGROUNDS))
    if family == "count":
        o = ObjectSpec(_pick(rng, SHAPES), _pick(rng, COLORS), _maybe(rng, P_SIZE, SIZES))
        n = _pick(rng, NUMBERS.values())
        return PromptSpec("count", (o,) * n, background=_maybe(rng, P_BACKGROUND, BACKGROUNDS))
    n = _pick(rng, SCENE_OBJECTS)
    cells = rng.permutation(len(CELLS))[:n]
    objects = tuple(
        ObjectSpec(_pick(rng, SHAPES), _pick(rng, COLORS), _pick(rng, SIZES), CELLS[k]) for k in sorted(cells)
    )
    return PromptSpec("scene", objects, background=_pick(rng, BACKGROUNDS))


def sample_prompt(rng: np.random.Generator, family: str) -> str:
    """A random prompt of ``family`` (one of :data:`FAMILIES`)."""
    return caption(sample_spec(rng, family))


def scene_for_prompt(prompt: str | PromptSpec, rng: np.random.Generator) -> Scene:
    """A random scene satisfying ``prompt``: whatever the prompt leaves open is drawn uniformly."""
    spec = parse_prompt(prompt) if isinstance(prompt, str) else prompt
    background = spec.background or _pick(rng, BACKGROUNDS)
    rows = cell_assignments(spec)  # (A, n)
    cells = rows[rng.integers(len(rows))]
    objects = tuple(
        Object(o.shape, o.color or _pick(rng, COLORS), o.size or _pick(rng, SIZES), CELLS[k])
        for o, k in zip(spec.objects, cells)
    )
    return Scene(background, objects)


# Caption corruptions: each returns a wrong or incomplete version of the spec, or None where it does not apply.
def _objects_with(spec: PromptSpec, attr: str) -> list[int]:
    return [i for i, o in enumerate(spec.objects) if getattr(o, attr) is not None]


def _set(spec: PromptSpec, i: int, **changes) -> PromptSpec:
    """``spec`` with object ``i`` changed (every object of a count prompt, since they are one phrase)."""
    targets = range(len(spec.objects)) if spec.family == "count" else [i]
    objects = tuple(replace(o, **changes) if j in targets else o for j, o in enumerate(spec.objects))
    return replace(spec, objects=objects)


def _drop_attribute(spec: PromptSpec, rng: np.random.Generator) -> PromptSpec | None:
    choices = [(i, a) for a in ("size", "color", "cell") for i in _objects_with(spec, a)]
    if spec.background is not None:
        choices.append((None, "background"))
    if not choices:
        return None
    i, attr = _pick(rng, choices)
    return replace(spec, background=None) if i is None else _set(spec, i, **{attr: None})


def _swap(attr: str, values) -> Callable[[PromptSpec, np.random.Generator], PromptSpec | None]:
    def corrupt(spec: PromptSpec, rng: np.random.Generator) -> PromptSpec | None:
        present = _objects_with(spec, attr)
        if not present:
            return None
        i = _pick(rng, present)
        taken = {o.cell for o in spec.objects} if attr == "cell" else {getattr(spec.objects[i], attr)}
        return _set(spec, i, **{attr: _pick(rng, [v for v in values if v not in taken])})

    return corrupt


def _wrong_count(spec: PromptSpec, rng: np.random.Generator) -> PromptSpec | None:
    if spec.family != "count":
        return None
    n = _pick(rng, [n for n in NUMBERS.values() if n != len(spec.objects)])
    return replace(spec, objects=spec.objects[:1] * n)


def _omit_object(spec: PromptSpec, rng: np.random.Generator) -> PromptSpec | None:
    if spec.family not in ("pair", "scene"):
        return None
    i = rng.integers(len(spec.objects))
    kept = spec.objects[:i] + spec.objects[i + 1 :]
    family = "scene" if len(kept) > 1 else "single"
    return PromptSpec(family, kept, background=spec.background)


def _wrong_relation(spec: PromptSpec, rng: np.random.Generator) -> PromptSpec | None:
    if spec.relation is None:
        return None
    return replace(spec, relation=_pick(rng, [r for r in RELATIONS if r != spec.relation]))


def _wrong_background(spec: PromptSpec, rng: np.random.Generator) -> PromptSpec | None:
    if spec.background is None:
        return None
    return replace(spec, background=_pick(rng, [b for b in BACKGROUNDS if b != spec.background]))


CORRUPTIONS: dict[str, Callable[[PromptSpec, np.random.Generator], PromptSpec | None]] = {
    "drop_attribute": _drop_attribute,
    "wrong_color": _swap("color", COLORS),
    "wrong_shape": _swap("shape", SHAPES),
    "wrong_size": _swap("size", SIZES),
    "wrong_position": _swap("cell", CELLS),
    "wrong_count": _wrong_count,
    "omit_object": _omit_object,
    "wrong_relation": _wrong_relation,
    "wrong_background": _wrong_background,
}


def corrupt_spec(spec: PromptSpec, rng: np.random.Generator) -> PromptSpec:
    """``spec`` with one caption error, drawn uniformly among the :data:`CORRUPTIONS` that apply to it."""
    order = rng.permutation(len(CORRUPTIONS))
    names = list(CORRUPTIONS)
    for j in order:
        corrupted = CORRUPTIONS[names[j]](spec, rng)
        if corrupted is not None:
            return corrupted
    raise AssertionError("unreachable: wrong_shape applies to every prompt")


def sample_training_pair(
    rng: np.random.Generator, caption_noise: float, *, size: int = 32, exclude: Container[str] = frozenset()
) -> tuple[str, np.ndarray]:
    """One pretraining example: ``(caption, image)`` with the image uint8 (H, W, 3).

    The image is a random scene of a random prompt of a uniformly drawn family. With probability ``caption_noise``
    the caption carries one error (:func:`corrupt_spec`); otherwise it is the prompt itself. Prompts and captions in
    ``exclude`` (the test split) are never returned.
    """
    if not 0.0 <= caption_noise <= 1.0:
        raise ValueError(f"caption_noise is a probability in [0, 1], got {caption_noise!r}.")
    for _ in range(1000):
        spec = sample_spec(rng, _pick(rng, FAMILIES))
        noisy = rng.random() < caption_noise
        text = caption(corrupt_spec(spec, rng) if noisy else spec)
        if caption(spec) not in exclude and text not in exclude:
            return text, render(scene_for_prompt(spec, rng), size)
    raise ValueError("could not draw a training pair outside `exclude` in 1000 tries; it holds most of the world.")
