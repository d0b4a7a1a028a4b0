"""The code stays small enough to read (STYLE.md: one concept per function and module): no function of the
library, the stage entries or the flows is over 80 lines (its docstring included). An ast walk, so the next long
function fails here, not in a reviewer's memory."""

from __future__ import annotations

import ast

from conftest import REPO

MAX_FUNCTION_LINES = 80


def test_no_function_is_over_80_lines():
    long = []
    for root in ("jagg_core", "tasks", "flows"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 80 lines; cut each into named parts: " + "; ".join(long)
