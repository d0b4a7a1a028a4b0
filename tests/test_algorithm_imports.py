"""The algorithm needs torch alone (README; docs/architecture.md): importing its modules in a fresh interpreter
imports none of the application's stack, and ``import jagg_core`` imports no module of its own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ALGORITHM = ("jagg_core.jagg", "jagg_core.modes", "jagg_core.sde", "jagg_core.loss", "jagg_core.advantages",
             "jagg_core.schedules", "jagg_core.fidelity", "jagg_core.cost", "jagg_core.snr", "jagg_core.errors")
FORBIDDEN = ("mlflow", "prefect", "pydantic", "yaml", "matplotlib", "dvc", "diffusers", "transformers", "open_clip")


def _imported_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def _top(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_the_algorithm_modules_import_torch_and_nothing_of_the_application():
    mods = _imported_after("\n".join(f"import {m}" for m in ALGORITHM))
    assert not _top(mods) & set(FORBIDDEN), sorted(_top(mods) & set(FORBIDDEN))
    ours = {m for m in mods if m.startswith("jagg_core.")}
    assert ours == set(ALGORITHM), sorted(ours - set(ALGORITHM))


def test_the_public_names_import_only_their_own_module():
    mods = _imported_after("from jagg_core import group_backward, plan_groups, sde_step_with_logprob, "
                           "group_advantages, gradient_fidelity")
    assert not _top(mods) & set(FORBIDDEN)
    assert {m for m in mods if m.startswith("jagg_core.")} == {
        "jagg_core.jagg", "jagg_core.modes", "jagg_core.sde", "jagg_core.advantages", "jagg_core.fidelity"}


@pytest.mark.parametrize("module", ALGORITHM)
def test_one_algorithm_module_imports_only_the_algorithm(module):
    ours = {m for m in _imported_after(f"import {module}") if m.startswith("jagg_core.")}
    assert ours <= set(ALGORITHM), sorted(ours - set(ALGORITHM))


def test_importing_the_package_imports_nothing_else():
    mods = _imported_after("import jagg_core")
    assert {m for m in mods if m.startswith("jagg_core.")} == set() and "torch" not in mods
