"""The toy world's definitions: its vocabulary of attributes with exact values, and what prompts and scenes are.

Everything the renderer draws and the rewards check is defined here, once: the RGB value of every colour, the 3×3 grid
of cells, the relations between cells. A :class:`PromptSpec` is what a prompt says (attributes may be left out); a
:class:`Scene` is one fully determined picture satisfying it.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import asdict, dataclass

import numpy as np

__all__ = [
    "BACKGROUNDS",
    "CELLS",
    "COLORS",
    "FAMILIES",
    "NUMBERS",
    "PLURALS",
    "RELATIONS",
    "SHAPES",
    "SIZES",
    "Object",
    "ObjectSpec",
    "PromptSpec",
    "Scene",
    "cell_assignments",
]

# Object colours, saturated and at least 127 apart in RGB from each other and from every background.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "yellow": (255, 255, 0),
    "green": (0, 200, 0),
    "blue": (0, 0, 255),
    "purple": (150, 0, 220),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
PLURALS: dict[str, str] = {shape: shape + ("es" if shape.endswith("s") else "s") for shape in SHAPES}
SIZES: tuple[str, ...] = ("small", "large")
# The 3×3 grid, row-major: cell k is at row k // 3 and column k % 3.
CELLS: tuple[str, ...] = (
    "top left", "top", "top right",
    "left", "center", "right",
    "bottom left", "bottom", "bottom right",
)  # fmt: skip
# "a left of b": a's column is left of b's, rows anywhere (and likewise for the others).
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
NUMBERS: dict[str, int] = {"two": 2, "three": 3, "four": 4}
# One prompt family per style of the test split.
FAMILIES: tuple[str, ...] = ("single", "pair", "count", "scene")


def _check(value: str | None, allowed, what: str) -> None:
    if value is not None and value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; the world has {', '.join(map(repr, allowed))}.")


@dataclass(frozen=True)
class ObjectSpec:
    """One object as a prompt names it; ``None`` means the prompt leaves that attribute open."""

    shape: str
    color: str | None = None
    size: str | None = None
    cell: str | None = None

    def __post_init__(self) -> None:
        _check(self.shape, SHAPES, "shape")
        _check(self.color, COLORS, "colour")
        _check(self.size, SIZES, "size")
        _check(self.cell, CELLS, "cell")


@dataclass(frozen=True)
class PromptSpec:
    """What a prompt asks for. ``relation`` (pair family only) relates ``objects[0]`` to ``objects[1]``."""

    family: str
    objects: tuple[ObjectSpec, ...]
    relation: str | None = None
    background: str | None = None

    def __post_init__(self) -> None:
        _check(self.family, FAMILIES, "family")
        _check(self.relation, RELATIONS, "relation")
        _check(self.background, BACKGROUNDS, "background")
        if not 1 <= len(self.objects) <= len(CELLS):
            raise ValueError(f"a prompt names 1 to {len(CELLS)} objects, got {len(self.objects)}.")
        if (self.relation is not None) != (self.family == "pair"):
            raise ValueError("a relation is what makes a pair prompt, and only a pair prompt has one.")
        n = len(self.objects)
        if self.family == "single" and n != 1:
            raise ValueError(f"a single prompt names one object, got {n}.")
        if self.family == "pair" and (n != 2 or any(o.cell is not None for o in self.objects)):
            raise ValueError("a pair prompt names two objects and places them by its relation alone.")
        if self.family == "count" and (
            n not in NUMBERS.values() or len(set(self.objects)) != 1 or self.objects[0].cell is not None
        ):
            raise ValueError(f"a count prompt names 2 to 4 identical objects without cells, got {n}.")
        if self.family == "scene" and n < 2:
            raise ValueError(f"a scene prompt names at least two objects, got {n}.")
        cells = [o.cell for o in self.objects if o.cell is not None]
        if len(cells) != len(set(cells)):
            raise ValueError(f"two objects cannot share a cell, got cells {cells}.")


@dataclass(frozen=True)
class Object:
    """One drawn object: every attribute fixed."""

    shape: str
    color: str
    size: str
    cell: str

    def __post_init__(self) -> None:
        ObjectSpec(self.shape, self.color, self.size, self.cell)  # validates


@dataclass(frozen=True)
class Scene:
    """One picture of the world: a background and objects in distinct cells."""

    background: str
    objects: tuple[Object, ...]

    def __post_init__(self) -> None:
        _check(self.background, BACKGROUNDS, "background")
        cells = [o.cell for o in self.objects]
        if len(cells) != len(set(cells)):
            raise ValueError(f"two objects cannot share a cell, got cells {cells}.")

    def as_dict(self) -> dict:
        """Plain JSON-able form (for reward metadata and logs)."""
        return asdict(self)


def _related(relation: str, a: int, b: int) -> bool:
    """Whether cell ``a`` stands in ``relation`` to cell ``b``."""
    (ra, ca), (rb, cb) = divmod(a, 3), divmod(b, 3)
    return {"left of": ca < cb, "right of": ca > cb, "above": ra < rb, "below": ra > rb}[relation]


@functools.lru_cache(maxsize=None)
def _assignments(fixed: tuple[int | None, ...], relation: str | None) -> np.ndarray:
    rows = [
        cells
        for cells in itertools.permutations(range(len(CELLS)), len(fixed))
        if all(f is None or f == c for f, c in zip(fixed, cells))
        and (relation is None or _related(relation, cells[0], cells[1]))
    ]
    out = np.array(rows, dtype=np.int64).reshape(len(rows), len(fixed))  # (A, n)
    out.flags.writeable = False
    return out


def cell_assignments(spec: PromptSpec) -> np.ndarray:
    """Every way to put the prompt's objects in distinct cells that the prompt allows: (A, n) cell indices.

    Row ``j`` gives the cell index (into :data:`CELLS`) of each object; positions the prompt names are kept and its
    relation holds. The renderer samples one row, the reward maximises over all rows, so the two cannot disagree.
    """
    fixed = tuple(None if o.cell is None else CELLS.index(o.cell) for o in spec.objects)
    return _assignments(fixed, spec.relation)
