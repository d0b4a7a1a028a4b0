"""The floors of docs/architecture.md as checked contracts: `lint-imports` keeps the layers and the algorithm's
forbidden list of pyproject.toml (imports inside functions included: its graph reads them all), and no two modules of
the project import each other, however indirectly. tests/test_algorithm_imports.py checks the same at run time."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("jagg_core", "tasks", "flows")


def _lint_imports() -> str:
    beside = Path(sys.executable).with_name("lint-imports")
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    if not found:
        pytest.fail("lint-imports is not installed: `pip install -e '.[dev]'` (make setup) installs import-linter")
    return found


def test_the_import_contracts_are_kept():
    """A broken contract fails here with lint-imports' report: the contract, and the chain of imports that breaks it
    (``jagg_core.errors -> jagg_core.setup.redact (l.15)``)."""
    out = subprocess.run([_lint_imports(), "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module in the project's import graph (Tarjan)."""
    import grimp

    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in edges.get(m, ()):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in sorted(edges):
        if m not in index:
            visit(m)
    return found


def test_no_import_cycle_among_the_project_modules():
    assert _cycles() == []
