"""The parser of the JSON the project reads back: finite, at most :data:`MAX_DEPTH` deep, one sentence otherwise.

:mod:`jagg_core.setup.json_read` reads files with it (through storage's bounded reader); this module imports nothing of
the project's, so :mod:`jagg_core.setup.storage` parses with it too without an import cycle.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_DEPTH", "parse_json"]

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
