"""The one reader of JSON the project reads back (a kept bench round, a card, a manifest, a context file).

What the project writes is finite (``json.dumps(..., allow_nan=False)``, ``storage.finite_json``) and shallow, so
what it reads back is held to the same: Python's ``json`` takes ``NaN`` and ``Infinity`` (a kept bench round holding
``Infinity`` was resumed into the benchmark's result) and raises ``RecursionError`` on a file nested 200,000 deep.
Here either is one sentence in the caller's error type, as a file that is not JSON is, and the bytes come through the
project's one bounded reader (:func:`~jagg_core.setup.storage.read_regular`). ``tests/test_json_read.py`` finds every
other ``json.load`` / ``json.loads`` of the project.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .storage import MAX_READ_BYTES, read_regular

__all__ = ["MAX_DEPTH", "parse_json", "read_json"]

MAX_DEPTH = 64  # lists and mappings inside each other; the deepest file the project writes has a few


def _no_constant(name: str) -> Any:
    raise ValueError(f"holds {name}, which is no finite number")


def _depth(tree: Any) -> int:
    """How deep ``tree`` nests (1 for a scalar), walked without recursion and stopped past :data:`MAX_DEPTH`."""
    deepest, todo = 0, [(tree, 1)]
    while todo:
        node, depth = todo.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            break
        if isinstance(node, dict):
            todo.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            todo.extend((v, depth + 1) for v in node)
    return deepest


def parse_json(data: bytes | str, error: type[Exception], where: str, *, fix: str = "") -> Any:
    """``data`` (a file's bytes, an environment variable) as JSON, finite and at most :data:`MAX_DEPTH` deep, or
    one sentence as ``error`` naming ``where`` and what is wrong (never the text itself: it may be anyone's), with
    ``fix``."""
    tail = f"; {fix}." if fix else "."
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        tree = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise error(f"{where} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}){tail}") from None
    except UnicodeDecodeError as e:
        raise error(f"{where} is not UTF-8 text (byte {e.start}){tail}") from None
    except RecursionError:
        raise error(f"{where} nests deeper than JSON the project writes (more than {MAX_DEPTH} levels){tail}") from None
    except ValueError as e:  # Infinity or NaN; an integer of thousands of digits
        raise error(f"{where} {str(e)[:120] if 'finite' in str(e) else 'holds a number JSON cannot read'}"
                    f"{tail}") from None
    if _depth(tree) > MAX_DEPTH:
        raise error(f"{where} nests deeper than JSON the project writes (more than {MAX_DEPTH} levels){tail}")
    return tree


def read_json(path: str | os.PathLike, error: type[Exception], *, limit: int = MAX_READ_BYTES, fix: str = "") -> Any:
    """The JSON file at ``path``: read by the bounded reader (regular, at most ``limit`` bytes, no FIFO), parsed by
    :func:`parse_json`; any failure one sentence as ``error``."""
    return parse_json(read_regular(path, error, limit=limit, fix=fix), error, str(path), fix=fix)
