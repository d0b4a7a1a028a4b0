"""The embedded default's procedural text-to-image world (numpy only; no weights, no downloads).

Coloured shapes of two sizes on a 3×3 grid over a plain background; prompts from a small grammar in four families
(``single``, ``pair``, ``count``, ``scene``, the styles of the test split); an exact renderer; noisy (caption, image)
pairs for pretraining. The toy rewards (:mod:`jagg_core.rewards.toy`) score images against the same definitions.

- :mod:`.scene`: the attributes with their exact values, :class:`PromptSpec` and :class:`Scene`.
- :mod:`.grammar`: prompt text ⇄ spec (:func:`caption`, :func:`parse_prompt`) and the :func:`vocabulary`.
- :mod:`.render`: :func:`render` and the shape masks (:func:`templates`).
- :mod:`.sample`: random prompts, scenes and pretraining pairs.
- :mod:`.splits`: train/test prompt splits in the HPSv2.1 benchmark layout.
"""

from .grammar import caption, parse_prompt, shown_prompt, vocabulary
from .render import cell_boxes, object_mask, render, templates
from .sample import (
    CORRUPTIONS,
    corrupt_spec,
    sample_prompt,
    sample_spec,
    sample_training_pair,
    scene_for_prompt,
)
from .scene import (
    BACKGROUNDS,
    CELLS,
    COLORS,
    FAMILIES,
    NUMBERS,
    PLURALS,
    RELATIONS,
    SHAPES,
    SIZES,
    Object,
    ObjectSpec,
    PromptSpec,
    Scene,
    cell_assignments,
)
from .splits import make_prompt_splits, read_benchmark, validate_style, write_prompt_splits

__all__ = [
    "BACKGROUNDS",
    "CELLS",
    "COLORS",
    "CORRUPTIONS",
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
    "caption",
    "cell_assignments",
    "cell_boxes",
    "corrupt_spec",
    "make_prompt_splits",
    "object_mask",
    "parse_prompt",
    "read_benchmark",
    "render",
    "sample_prompt",
    "sample_spec",
    "sample_training_pair",
    "scene_for_prompt",
    "shown_prompt",
    "templates",
    "validate_style",
    "vocabulary",
    "write_prompt_splits",
]
