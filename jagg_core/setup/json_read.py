"""The one reader of JSON the project reads back (a kept bench round, a card, a manifest, a context file).

What the project writes is finite (``json.dumps(..., allow_nan=False)``, ``storage.finite_json``) and shallow, so
what it reads back is held to the same: Python's ``json`` takes ``NaN`` and ``Infinity`` (a kept bench round holding
``Infinity`` was resumed into the benchmark's result) and raises ``RecursionError`` on a file nested 200,000 deep.
Here either is one sentence in the caller's error type, as a file that is not JSON is, and the bytes come through the
project's one bounded reader (:func:`~jagg_core.setup.storage.read_regular`). ``tests/test_json_read.py`` finds every
other ``json.load`` / ``json.loads`` of the project.
"""

from __future__ import annotations

import os
from typing import Any

from .json_parse import MAX_DEPTH, parse_json
from .storage import MAX_READ_BYTES, read_regular

__all__ = ["MAX_DEPTH", "parse_json", "read_json"]


def read_json(path: str | os.PathLike, error: type[Exception], *, limit: int = MAX_READ_BYTES, fix: str = "") -> Any:
    """The JSON file at ``path``: read by the bounded reader (regular, at most ``limit`` bytes, no FIFO), parsed by
    :func:`parse_json`; any failure one sentence as ``error``."""
    return parse_json(read_regular(path, error, limit=limit, fix=fix), error, str(path), fix=fix)
