"""The floors of docs/architecture.md as checked contracts: `lint-imports` keeps the layers and the algorithm's
forbidden list of pyproject.toml (imports inside functions included: its graph reads them all), and no two modules of
the project import each other, however indirectly; what lib/jagg-core ships imports torch and the standard library
alone (an allow-list: tests/allowed_imports.py). tests/test_algorithm_imports.py checks the same at run time."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
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


def test_the_library_contract_refuses_an_import_beyond_torch(tmp_path):
    """lib/jagg-core's contract (tests/allowed_imports.py, an allow-list) breaks on ``import numpy`` added to
    jagg_core/jagg.py and on an algorithm module importing a module of jagg_core that the distribution does not ship,
    each named with its line; kept on the modules as they are."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "allowed_imports"]
    (tmp_path / "jagg_core").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "lib" / "jagg-core").mkdir(parents=True)
    shutil.copy(REPO / contract["distribution"], tmp_path / contract["distribution"])
    shutil.copy(REPO / "tests" / "allowed_imports.py", tmp_path / "tests")
    for path in (REPO / "jagg_core").glob("*.py"):
        shutil.copy(path, tmp_path / "jagg_core")
    (tmp_path / "jagg_core" / "world.py").write_text("")  # a module of the library above the algorithm
    (tmp_path / "pyproject.toml").write_text(
        '[tool.importlinter]\nroot_packages = ["jagg_core"]\ninclude_external_packages = true\n'
        f"contract_types = {json.dumps(config['contract_types'])}\n\n[[tool.importlinter.contracts]]\n"
        f'name = "library"\ntype = "allowed_imports"\ndistribution = "{contract["distribution"]}"\n'
        f"allowed_modules = {json.dumps(contract['allowed_modules'])}\n")

    def lint() -> subprocess.CompletedProcess:
        return subprocess.run([_lint_imports(), "--no-cache"], cwd=tmp_path, capture_output=True, text=True)

    assert lint().returncode == 0, lint().stdout[-3000:]
    jagg = tmp_path / "jagg_core" / "jagg.py"
    source = jagg.read_text()
    jagg.write_text(source.replace("\nimport torch\n", "\nimport torch\nimport numpy\n", 1))
    out = lint()
    flat = " ".join(out.stdout.split())
    assert out.returncode == 1 and re.search(r"jagg_core\.jagg imports numpy \(l\.\d+\)", flat), out.stdout[-3000:]
    jagg.write_text(source)
    snr = tmp_path / "jagg_core" / "snr.py"
    snr.write_text(snr.read_text() + "\nfrom . import world\n")
    out = lint()
    flat = " ".join(out.stdout.split())
    assert out.returncode == 1 and "jagg_core.snr imports jagg_core.world" in flat, out.stdout[-3000:]
