"""jagg-core, the library as its own distribution (lib/jagg-core; docs/library.md), installed as a trainer installs it:
a fresh venv holds torch (the pipeline's pin) and the library alone — nothing of the pipeline importable there —
imports jagg_core and passes the library's tests, on the oldest and the newest Python this machine has (3.10 and
3.13 here; a machine without the library's lowest Python runs what it has, with a warning). The two venvs are built
side by side from uv's cache (torch and its CUDA wheels hard-linked, not copied; a Python whose torch wheel is not
cached yet downloads it once), and the library goes in from its folder, built by its own backend, after torch, which
it must leave as it was.

By hand, on any torch and Python (scripts/library_torch_floor.sh proves the lowest torch declared this way):

    .venv/bin/python tests/test_library_dist.py --python oldest --torch 2.5.0
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import warnings
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "lib" / "jagg-core"
UV = Path(sys.executable).with_name("uv")

# The library's tests: the test files that import the algorithm and, outside their tests, nothing but torch, pytest
# and the standard library (and the helper below); a test among them that imports more inside itself (a check of the
# pipeline's configuration beside the algorithm's) is left out of the library's run (pipeline_tests). Kept both ways
# by test_the_library_tests_are_the_torch_only_tests: a listed file that imports more at module level fails, and so
# does an unlisted file that is torch-only throughout.
LIBRARY_TESTS = ("test_advantages_and_loss.py", "test_cost.py", "test_fidelity.py", "test_jagg.py", "test_sde.py",
                 "test_snr.py")
HELPERS = ("velocity_models.py",)
# What a venv of torch and the library must not be able to import: the pipeline, its stack, the library's floors.
ABSENT = ("tasks", "flows", "jagg_core.trainer", "jagg_core.setup", "jagg_core.build", "jagg_core.sampling",
          "diffusers", "transformers", "mlflow", "prefect", "yaml")
NOT_THE_ALGORITHM = {"build", "sampling", "media"}  # jagg_core/*.py of the library above it (docs/architecture.md)


def _library_config() -> dict:
    return tomllib.loads((LIBRARY / "pyproject.toml").read_text(encoding="utf-8"))


def shipped() -> list[str]:
    """jagg_core's modules the distribution ships (lib/jagg-core/pyproject.toml; hatch_build.py packs them)."""
    return list(_library_config()["tool"]["hatch"]["build"]["hooks"]["custom"]["modules"])


def pipeline_torch() -> str:
    """The pipeline's torch pin (pyproject.toml's ``torch==X``): the torch the library's venvs get."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    (pin,) = [d for d in deps if re.match(r"torch\s*==", d)]
    return pin.split("==")[1].strip()


def oldest_python() -> tuple[int, int]:
    spec = _library_config()["project"]["requires-python"]
    m = re.fullmatch(r">=\s*3\.(\d+)", spec)
    assert m, f"lib/jagg-core's requires-python is {spec!r}; this test reads its lowest Python from '>=3.N'"
    return 3, int(m.group(1))


def _version_of(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2], sys.implementation.name)"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = out.stdout.split()
    if out.returncode != 0 or len(parts) != 3 or parts[2] != "cpython":
        return None  # e.g. a pyenv shim of a version that is not the active one
    return int(parts[0]), int(parts[1])


def find_pythons() -> dict[tuple[int, int], str]:
    """Every CPython 3.N (N from the library's lowest) on this machine: on PATH, pyenv's versions, uv's own."""
    lo = oldest_python()[1]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found: dict[tuple[int, int], str] = {}
    for minor in range(lo, 20):
        candidates = [shutil.which(f"python3.{minor}"), *sorted(glob.glob(f"{pyenv}/3.{minor}.*/bin/python3.{minor}"))]
        if sys.version_info[:2] == (3, minor):
            candidates.insert(0, sys.executable)
        for python in filter(None, candidates):
            if _version_of(python) == (3, minor):
                found[(3, minor)] = python
                break
    return found


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CONDA_PREFIX", "PYTHONDONTWRITEBYTECODE")}
    env["UV_PYTHON_DOWNLOADS"] = "never"
    return env


def _run(cmd: list[str], *, cwd: Path | None = None, timeout: float = 900) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=_clean_env(), timeout=timeout)
    return out, time.monotonic() - t0


# Run inside the fresh venv, from a copy of the library's tests: which jagg_core and torch it imports, that nothing of
# the pipeline is there (one JSON line), then the tests, in the same interpreter (torch imported once).
_PROBE_AND_TESTS = """
import importlib, importlib.metadata, importlib.util, json, sys
import jagg_core, torch
from jagg_core import group_backward, plan_groups, sde_step_with_logprob, ppo_step_loss, group_advantages
def absent(name):
    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:
        return True
def dist(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
print("PROBE " + json.dumps({"jagg_core": jagg_core.__file__, "version": jagg_core.__version__,
      "torch": dist("torch"), "jagg-core": dist("jagg-core"), "jagg": dist("jagg"), "prefix": sys.prefix,
      "python": list(sys.version_info[:2]), "present": [n for n in ABSENT if not absent(n)]}), flush=True)
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning", "--rootdir", ".", *TESTS,
                      *[f"--deselect={t}" for t in DESELECT]]))
"""


def _install(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """A uv command; where it failed (the index cannot be reached), the same from uv's cache alone."""
    out, seconds = _run(cmd)
    if out.returncode != 0 and cmd[0] == str(UV):
        offline, more = _run([*cmd, "--offline"])
        if offline.returncode == 0:
            return offline, seconds + more
    return out, seconds


def library_deselect() -> list[str]:
    """The library's test files' tests that need the pipeline (``pipeline_tests``), as pytest ids to deselect."""
    return [f"{name}::{t}" for name in LIBRARY_TESTS for t in pipeline_tests(name)]


def check_in_fresh_venv(python: str, torch_spec: str, folder: Path, library: str = str(LIBRARY),
                        pip: bool = False, deselect: list[str] | None = None) -> dict:
    """Builds ``folder`` as a venv of ``python`` holding ``torch_spec`` and pytest, installs the library after them
    (its folder, or any requirement ``library``: a git URL; with pip instead of uv where ``pip``), and runs
    ``_PROBE_AND_TESTS`` there. Returns each step's seconds, outputs and findings; raises nothing on a failed step."""
    report: dict = {"python": python, "torch_spec": torch_spec, "library": library, "seconds": {}, "failed": None}
    in_venv = str(folder / "bin" / "python")
    install_library = ([in_venv, "-m", "pip", "install", "--quiet", library] if pip else
                       [str(UV), "pip", "install", "--quiet", "--python", in_venv, library])
    for name, cmd in (
        ("venv", [str(UV), "venv", "--quiet", *(["--seed"] if pip else []), "--python", python, str(folder)]),
        ("torch", [str(UV), "pip", "install", "--quiet", "--python", in_venv, torch_spec, "pytest"]),
        ("library", install_library),
    ):
        out, seconds = _install(cmd)
        report["seconds"][name] = round(seconds, 1)
        if out.returncode != 0:
            report["failed"] = f"{name}: {' '.join(cmd)} exited {out.returncode}\n{out.stderr[-3000:]}"
            return report
    tests = folder / "library-tests"
    tests.mkdir()
    for name in LIBRARY_TESTS + HELPERS:
        shutil.copy(REPO / "tests" / name, tests / name)
    deselect = library_deselect() if deselect is None else deselect
    report["deselected"] = deselect
    code = f"ABSENT = {list(ABSENT)!r}\nTESTS = {list(LIBRARY_TESTS)!r}\nDESELECT = {deselect!r}\n" + _PROBE_AND_TESTS
    out, seconds = _run([in_venv, "-c", code], cwd=tests)
    report["seconds"]["import and tests"] = round(seconds, 1)
    probe = [line for line in out.stdout.splitlines() if line.startswith("PROBE ")]
    if not probe:
        report["failed"] = f"jagg_core or torch did not import (exit {out.returncode}):\n{out.stderr[-3000:]}"
        return report
    report["probe"] = json.loads(probe[0][len("PROBE "):])
    report["pytest_rc"] = out.returncode
    report["pytest_tail"] = (out.stdout + out.stderr)[-4000:]
    summary = [line for line in out.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    report["pytest_summary"] = summary[-1].strip("= ") if summary else ""
    return report


def _release(version: str | None) -> tuple[int, ...]:
    """``2.0``, ``2.0.0`` and ``2.0.0+cu118`` alike: the release's numbers, trailing zeros dropped."""
    numbers = [int(n) for n in re.match(r"[\d.]*", (version or "").split("+")[0]).group(0).strip(".").split(".") if n]
    while numbers and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def problems(report: dict, torch_version: str) -> list[str]:
    """What is wrong with one venv's report: a failed step, a pipeline module importable, jagg_core not the
    installed library's, torch moved by the library's install, a failed library test."""
    if report["failed"]:
        return [report["failed"]]
    probe, found = report["probe"], []
    site = Path(probe["prefix"]).resolve()
    if not Path(probe["jagg_core"]).resolve().is_relative_to(site):
        found.append(f"jagg_core came from {probe['jagg_core']}, not the venv {site}")
    if probe["present"]:
        found.append(f"importable beside the library, which should not be: {probe['present']}")
    if probe["jagg"] is not None:
        found.append(f"the pipeline's distribution jagg {probe['jagg']} is installed there")
    if probe["jagg-core"] is None or probe["version"] != probe["jagg-core"]:
        found.append(f"jagg-core {probe['jagg-core']} installed, jagg_core.__version__ {probe['version']}")
    if _release(probe["torch"]) != _release(torch_version):
        found.append(f"torch is {probe['torch']} after the library's install; the trainer's pin was {torch_version}")
    if report["pytest_rc"] != 0 or "passed" not in report["pytest_summary"]:
        found.append(f"the library's tests failed (rc {report['pytest_rc']}):\n{report['pytest_tail']}")
    return found


def check_pythons(pythons: dict[tuple[int, int], str], torch_version: str, parent: Path, **how) -> dict:
    """``check_in_fresh_venv`` for each of ``pythons`` at once (their installs are mostly waiting on the disk). The
    tests to deselect are read here, before the threads: CPython 3.11's ``ast.parse`` is not safe in two threads at
    once ("SystemError: AST constructor recursion depth mismatch", python/cpython#106905)."""
    deselect = library_deselect()
    with concurrent.futures.ThreadPoolExecutor(len(pythons)) as pool:
        futures = {v: pool.submit(check_in_fresh_venv, p, f"torch=={torch_version}", parent / f"py3{v[1]}",
                                  deselect=deselect, **how) for v, p in pythons.items()}
        return {v: f.result() for v, f in futures.items()}


# ---- the tests (run by `make test`) ----------------------------------------------------------------------------

def _imports(node: ast.AST) -> set[str]:
    """Every absolute import under ``node``."""
    found = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Import):
            found |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            found.add(n.module)
    return found


def _beyond_torch(modules: set[str]) -> set[str]:
    """The modules of ``modules`` that a venv of torch, pytest and the library cannot import."""
    algorithm = {"jagg_core"} | {f"jagg_core.{m}" for m in shipped()}
    helpers = {Path(h).stem for h in HELPERS}
    return {m for m in modules if m not in algorithm and m not in helpers
            and m.split(".")[0] not in set(sys.stdlib_module_names) | {"torch", "pytest", "__future__"}}


def split_imports(path: Path) -> tuple[set[str], dict[str, set[str]]]:
    """A test file's imports: those outside its functions, and for each top-level function those inside it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    functions = {n.name: _imports(n) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    outside = {m for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
               for m in _imports(n)}
    return outside, functions


def pipeline_tests(name: str) -> list[str]:
    """The tests of a library test file that import beyond torch inside themselves (a check of the configuration
    beside the algorithm's): not the library's, so deselected in its venv."""
    _, functions = split_imports(REPO / "tests" / name)
    return sorted(f for f, modules in functions.items() if f.startswith("test") and _beyond_torch(modules))


def test_the_library_tests_are_the_torch_only_tests():
    """Each listed file (and helper) imports torch, pytest, the standard library and the algorithm alone outside its
    tests, and every test file that imports the algorithm and nothing beyond torch anywhere is listed."""
    algorithm = {"jagg_core"} | {f"jagg_core.{m}" for m in shipped()}
    for name in LIBRARY_TESTS + HELPERS:
        beyond = _beyond_torch(split_imports(REPO / "tests" / name)[0])
        assert not beyond, (f"tests/{name} holds library tests (run in a venv of torch and jagg-core alone) but "
                            f"imports {sorted(beyond)} at module level: import them inside the test that needs them")
    qualifying = {path.name for path in (REPO / "tests").glob("test_*.py")
                  if split_imports(path)[0] & algorithm and not _beyond_torch(_imports(ast.parse(path.read_text())))}
    assert qualifying <= set(LIBRARY_TESTS), (
        f"{sorted(qualifying - set(LIBRARY_TESTS))} test the algorithm on torch alone: add them to LIBRARY_TESTS")


def test_a_test_that_needs_the_pipeline_is_left_out_of_the_library_run(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text("import torch\nfrom jagg_core import plan_groups\n\ndef test_a():\n    import math\n\n"
                    "def test_b():\n    from jagg_core.setup.config import Params\n    import yaml\n")
    outside, functions = split_imports(path)
    assert outside == {"torch", "jagg_core"} and not _beyond_torch(outside)
    assert {f for f, m in functions.items() if _beyond_torch(m)} == {"test_b"}


def test_the_distribution_ships_the_algorithm_modules():
    """The hook's list is the algorithm of docs/architecture.md: every root module of jagg_core but the library's
    three, the same list as the forbidden contract's and tests/test_algorithm_imports.py's."""
    from test_algorithm_imports import ALGORITHM

    names = shipped()
    roots = {p.stem for p in (REPO / "jagg_core").glob("*.py")}
    assert set(names) == roots - NOT_THE_ALGORITHM and "__init__" in names
    algorithm = {f"jagg_core.{n}" for n in names if n != "__init__"}
    assert set(ALGORITHM) == algorithm
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    (forbidden,) = [c for c in contracts["contracts"] if c["type"] == "forbidden"]
    assert set(forbidden["source_modules"]) == algorithm


def test_the_wheel_holds_the_algorithm_and_requires_torch_alone(tmp_path):
    out, _ = _install([str(UV), "build", "--wheel", "--quiet", "--out-dir", str(tmp_path), str(LIBRARY)])
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = tmp_path.glob("jagg_core-*.whl")
    with zipfile.ZipFile(wheel) as z:
        files = set(z.namelist())
        meta = z.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
        for name in shipped():  # the files are the repository's, byte for byte: one source, no copy
            assert z.read(f"jagg_core/{name}.py") == (REPO / "jagg_core" / f"{name}.py").read_bytes(), name
    assert {f for f in files if ".dist-info/" not in f} == {f"jagg_core/{n}.py" for n in shipped()}
    (requires,) = re.findall(r"^Requires-Dist: (.*)$", meta, re.M)  # torch alone, with a floor and no ceiling
    assert re.fullmatch(r"torch>=\d+\.\d+(\.\d+)?", requires), requires
    assert re.search(r"^Requires-Python: >=3\.\d+$", meta, re.M)
    import jagg_core

    assert re.search(r"^Version: (.*)$", meta, re.M).group(1) == jagg_core.__version__


@pytest.fixture(scope="module")
def fresh_venvs(tmp_path_factory):
    pythons = find_pythons()
    chosen = {v: pythons[v] for v in {min(pythons), max(pythons)}}
    parent = tmp_path_factory.mktemp("library-venvs")
    yield chosen, check_pythons(chosen, pipeline_torch(), parent)
    shutil.rmtree(parent, ignore_errors=True)  # ~18,000 files a venv: links into uv's cache, ~15 MB of bytecode


@pytest.mark.slow  # two venvs built and tested: 30–50 s on 2 cores (make test-fast leaves it out)
def test_a_venv_of_torch_and_the_library_alone_passes_the_library_tests(fresh_venvs):
    chosen, reports = fresh_venvs
    if min(chosen) != oldest_python():
        warnings.warn(f"no Python {'.'.join(map(str, oldest_python()))} (lib/jagg-core's lowest) on this machine: "
                      f"the library was tested on {sorted(chosen)} only")
    failures = [f"Python {v[0]}.{v[1]} ({r['python']}): {p}" for v, r in sorted(reports.items())
                for p in problems(r, pipeline_torch())]
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)
    for v, r in reports.items():  # shown under -rA / -s: what each venv took
        print(f"python {v[0]}.{v[1]} ({r['python']}): {r['seconds']} s; {r['pytest_summary']}")


# ---- by hand ---------------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", action="append", help="an interpreter, or oldest / newest (of those found); "
                        "repeat for several; default: the oldest and the newest found")
    parser.add_argument("--torch", default=pipeline_torch(), help="the torch version (default: the pipeline's pin)")
    parser.add_argument("--library", default=str(LIBRARY), help="what to install the library from: its folder "
                        "(default) or a requirement such as "
                        "'jagg-core @ git+file:///repo@COMMIT#subdirectory=lib/jagg-core'")
    parser.add_argument("--pip", action="store_true", help="install the library with the venv's own pip, not uv")
    parser.add_argument("--keep", help="build the venvs under this folder and keep them")
    args = parser.parse_args()
    found = find_pythons()
    pythons = {}
    for p in args.python or ["oldest", "newest"]:
        p = {"oldest": found[min(found)], "newest": found[max(found)]}.get(p, p)
        v = _version_of(p)
        if v is None:
            parser.error(f"{p} is not a CPython that runs")
        pythons[v] = p
    parent = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="jagg-core-"))
    parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        reports = check_pythons(pythons, args.torch, parent, library=args.library, pip=args.pip)
    finally:
        if not args.keep:
            shutil.rmtree(parent, ignore_errors=True)
    failed = False
    for v, r in sorted(reports.items()):
        found = problems(r, args.torch)
        failed |= bool(found)
        print(f"python {v[0]}.{v[1]} ({r['python']}), torch {args.torch}, {args.library}: {r['seconds']} s; "
              f"{r.get('pytest_summary', '')}{' — OK' if not found else ''}")
        for p in found:
            print("  " + p.replace("\n", "\n  "))
    print(f"{time.monotonic() - t0:.0f} s in all")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
