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

import importlib as _importlib

from .grammar import *  # noqa: F401,F403  (each module's __all__ is the package's)
from .render import *  # noqa: F401,F403
from .sample import *  # noqa: F401,F403
from .scene import *  # noqa: F401,F403
from .splits import *  # noqa: F401,F403

# the modules by name (``render`` above is the function of that name, not its module)
__all__ = sorted(name for module in ("grammar", "render", "sample", "scene", "splits")
                 for name in _importlib.import_module(f"{__name__}.{module}").__all__)
