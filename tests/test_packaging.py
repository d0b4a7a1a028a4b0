"""Every third-party module the package imports is declared in pyproject.toml (not merely pulled in by another
dependency, as httpx once arrived through Prefect)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib

from conftest import REPO

PACKAGES = ("jagg_core", "tasks", "flows")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503: PyYAML, pyyaml and py_yaml are one distribution


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_normalise(re.match(r"[A-Za-z0-9._-]+", r.strip()).group(0)) for r in requirements}


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """An import inside ``try:`` whose handlers catch ImportError (an optional extra the code can do without)."""
    child, parent = node, parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.Try) and child in parent.body:
            for h in parent.handlers:
                names = [h.type] if not isinstance(h.type, ast.Tuple) else list(h.type.elts)
                if h.type is None or any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError",
                                                                               "Exception") for n in names):
                    return True
        child, parent = parent, parents.get(parent)
    return False


def third_party_imports(root=REPO) -> dict[str, dict[str, bool]]:
    """module -> {file: guarded} for every absolute import (module or function level) of a module that is neither
    the standard library nor one of the project's packages."""
    found: dict[str, dict[str, bool]] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in PACKAGES or top == "__future__":
                        continue
                    where = found.setdefault(top, {})
                    rel = str(path.relative_to(root))
                    where[rel] = where.get(rel, True) and _guarded(node, parents)
    return found


def undeclared(pyproject: dict, imports: dict[str, dict[str, bool]]) -> list[str]:
    """One sentence per imported module no declared distribution provides (extras count where every import of it is
    guarded)."""
    project = pyproject["project"]
    required = _requirement_names(project.get("dependencies", []))
    extras = _requirement_names([r for reqs in project.get("optional-dependencies", {}).values() for r in reqs])
    provides = importlib.metadata.packages_distributions()
    problems = []
    for module, files in sorted(imports.items()):
        dists = {_normalise(d) for d in provides.get(module, [])}
        guarded = all(files.values())
        declared = required | (extras if guarded else set())
        if not dists:
            problems.append(f"{module} (imported by {', '.join(sorted(files))}) is not installed, so no distribution "
                            "is known to provide it")
        elif not dists & declared:
            problems.append(f"{module} (imported by {', '.join(sorted(files))}) comes from {', '.join(sorted(dists))}, "
                            "which pyproject.toml's dependencies do not declare")
    return problems


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_third_party_import_is_declared():
    imports = third_party_imports()
    assert {"torch", "httpx", "yaml", "PIL", "open_clip"} <= set(imports)  # function-level ones too (httpx)
    assert undeclared(_pyproject(), imports) == []


def test_removing_a_declaration_is_caught():
    """The check fails when a declaration goes: httpx (flows/run.py), PyYAML (imported as yaml) and open_clip_torch
    (imported as open_clip) each named; a guarded import may come from an extra, an unguarded one may not."""
    imports = third_party_imports()
    for dist, module in (("httpx", "httpx"), ("pyyaml", "yaml"), ("open_clip_torch", "open_clip")):
        pyproject = _pyproject()
        deps = pyproject["project"]["dependencies"]
        pyproject["project"]["dependencies"] = [d for d in deps if _requirement_names([d]) != {_normalise(dist)}]
        assert len(pyproject["project"]["dependencies"]) == len(deps) - 1, dist
        (problem,) = undeclared(pyproject, imports)
        assert problem.startswith(f"{module} (imported by "), problem
    pyproject = _pyproject()
    pyproject["project"]["dependencies"].remove(next(d for d in pyproject["project"]["dependencies"]
                                                    if d.startswith("httpx")))
    pyproject["project"]["optional-dependencies"]["net"] = ["httpx"]
    assert len(undeclared(pyproject, imports)) == 1  # flows/run.py imports it unguarded: an extra is not enough
    assert undeclared(pyproject, {"httpx": {"flows/run.py": True}}) == []  # guarded: the extra counts


def test_an_import_in_a_try_that_catches_import_error_is_guarded(tmp_path):
    (tmp_path / "jagg_core").mkdir()
    (tmp_path / "jagg_core" / "m.py").write_text(
        "import numpy\n"
        "def f():\n    try:\n        import httpx\n    except ImportError:\n        httpx = None\n"
        "    from tqdm import tqdm\n")
    for other in PACKAGES[1:]:
        (tmp_path / other).mkdir()
    found = third_party_imports(tmp_path)
    assert found == {"numpy": {"jagg_core/m.py": False}, "httpx": {"jagg_core/m.py": True},
                     "tqdm": {"jagg_core/m.py": False}}
