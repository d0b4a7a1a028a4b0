"""Every DVC pipeline lists, for every stage, exactly the code its command imports (statically, lazy imports included).

A stage whose deps miss a module it runs is never rerun when that module changes (the sampler, say); a dep it does
not import reruns it for nothing. Sub-packages may be listed as folders. The deps are written once, in
pipelines/template.yaml; each profile's pipeline (the active profile's is the root's dvc.yaml, every other one's
pipelines/<profile>/dvc.yaml) is written from it (tasks/dvc_pipelines.py), and both are checked here.

    python tests/test_dvc_deps.py     # print each stage's import closure as pipelines/template.yaml deps
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
LOCAL = ("jagg_core", "tasks", "flows")


def _module_file(module: str) -> Path | None:
    p = REPO.joinpath(*module.split("."))
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    return p.with_suffix(".py") if p.with_suffix(".py").is_file() else None


def _imports(path: Path, module: str) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return {m for m in found if m.split(".")[0] in LOCAL}


def _plugin_modules() -> list[str]:
    """The modules of jagg's built-in plugins: the `jagg.plugins` entry points of pyproject.toml."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project.get("entry-points", {}).get("jagg.plugins", {}).values())


@functools.lru_cache(maxsize=None)
def import_closure(module: str) -> frozenset[str]:
    """Repository files that ``python -m module`` may execute: every local import, at any depth, with the
    ``__init__.py`` of every package on the way. The registry imports every built-in plugin by its entry point (a
    validation of params reads their specs), so it counts as importing them."""
    files: set[Path] = set()
    todo, seen = [module], set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            f = _module_file(name)
            if f is not None and f not in files:
                files.add(f)
                todo.extend(_imports(f, name))
                if name == "jagg_core.setup.registry":
                    todo.extend(_plugin_modules())
    return frozenset(str(f.relative_to(REPO)) for f in files)


def _pipelines() -> list[Path]:
    """The template and every profile's pipeline (the active profile's is the root's dvc.yaml)."""
    return [REPO / "pipelines/template.yaml", REPO / "dvc.yaml", *sorted((REPO / "pipelines").glob("*/dvc.yaml"))]


def _profile(path: Path) -> str:
    """The profile a written pipeline is of (the root's: the one its commands are given)."""
    if path.parent != REPO:
        return path.parent.name
    return re.search(r"--profile (\S+)", path.read_text()).group(1)


@functools.lru_cache(maxsize=None)
def _stages(files: tuple[Path, ...] | None = None) -> dict[str, tuple[str, list[str]]]:
    """``<pipeline>:<stage>`` -> (the module its command runs, its code deps)."""
    out = {}
    for path in files or _pipelines():
        where = _profile(path) if path.name == "dvc.yaml" else path.stem
        for name, st in yaml.safe_load(path.read_text())["stages"].items():
            module = re.search(r"python -m ([\w.]+)", st["cmd"]).group(1)
            code = [d for d in st["deps"] if d.split("/")[0] in LOCAL]
            out[f"{where}:{name}"] = (module, code)
    return out


def test_every_profile_has_a_pipeline_checked_here():
    assert {_profile(p) for p in _pipelines()[1:]} >= {"toy", "toy-full", "toy-mix", "ci", "flux-fast"}


def _covered(path: str, dep: str) -> bool:
    return path == dep or path.startswith(dep.rstrip("/") + "/")


@pytest.mark.parametrize("stage", sorted(_stages()))
def test_stage_deps_are_the_code_its_command_imports(stage):
    module, deps = _stages()[stage]
    closure = import_closure(module)
    missing = sorted(f for f in closure if not any(_covered(f, d) for d in deps))
    unused = sorted(d for d in deps if not any(_covered(f, d) for f in closure))
    assert not missing, f"{stage}: the pipeline misses code its command imports: {missing}"
    assert not unused, f"{stage}: the pipeline lists code its command never imports: {unused}"


def test_the_closure_follows_lazy_and_relative_imports():
    closure = import_closure("tasks.train")
    assert "jagg_core/sampling.py" in closure  # the rollout's sampler, through trainer/rollout.py
    assert "jagg_core/trainer/loop.py" in closure  # imported inside worker()
    assert "jagg_core/world/grammar.py" in closure  # the toy reward's parser, through rewards/toy.py
    assert not any(f.startswith("flows/") for f in closure)


if __name__ == "__main__":
    for name, (module, _) in _stages((REPO / "pipelines/template.yaml",)).items():
        files = sorted(import_closure(module))
        packages = sorted({"/".join(f.split("/")[:2]) for f in files if f.count("/") >= 2})
        flat = [f for f in files if f.count("/") < 2 and not f.endswith("__init__.py")]
        print(f"{name}:\n  - " + "\n  - ".join(flat + packages + ["jagg_core/__init__.py"]))
