"""Test-wide settings: offline hub, deterministic threads."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")


import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# The suite's longest files, longest first (seconds of one worker in a full run on the Intel Xeon 2-core machine,
# 2026-12-06, a fresh clone of 3ed4cc3): pytest-xdist hands whole files (--dist loadfile) to whichever worker is free,
# in collection order (--no-loadscope-reorder, Makefile); a long file handed out last would run alone at the end while
# the other workers idle. Files not named here (each under 20 s) follow, in their usual order.
LONGEST_FIRST = {
    "test_pool_dispatch.py": 331, "test_dvc_repro.py": 236, "test_interrupts.py": 199,
    "test_sharded_checkpoints.py": 193, "test_pipeline.py": 141, "test_resume.py": 136, "test_dvc_pipelines.py": 125,
    "test_trainer.py": 123, "test_redaction.py": 110, "test_frontier.py": 110, "test_plugins.py": 100,
    "test_tracking_store.py": 70, "test_served_rewards.py": 66, "test_evaluation_cache.py": 64, "test_rl_signal.py": 58,
    "test_hps_reference.py": 55, "test_storage.py": 51, "test_bench.py": 48, "test_ownership.py": 38,
    "test_library_dist.py": 45,  # not yet in a full run: 30–53 s alone on this machine, 2026-12-07
    "test_checkpoints.py": 31, "test_config.py": 30, "test_paths.py": 30, "test_fsdp.py": 24,
    "test_algorithm_imports.py": 23, "test_worker_errors.py": 22, "test_gpu_smoke.py": 21, "test_bench_resume.py": 20,
}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -LONGEST_FIRST.get(item.path.name, 0))  # a stable sort: each file's order kept


def _built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder ``name``, made by ``build(folder)`` once per test session and shared by every pytest-xdist worker
    (pytest-xdist's documented pattern: the workers' temporary folders share a parent; a file lock makes one build
    it while the others wait). Tests copy it before they write."""
    from filelock import FileLock

    parent = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        parent = parent.parent
    folder, done = parent / name, parent / f"{name}.done"
    with FileLock(str(parent / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed in another worker
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


def _prepared_project(tmp_path_factory, profile: str) -> Path:
    """A project root with ``profile``'s prompts and base model, made by the pipeline's own stages.

    In fresh processes, as the pipeline runs them: the base model's bits must not depend on what earlier tests did
    to this process (e.g. torch's thread count), or the pinned digests of test_refactor_reference would.
    """
    def build(root: Path) -> None:
        shutil.copy(REPO / "params.yaml", root / "params.yaml")
        for stage in ("tasks.prepare", "tasks.pretrain"):
            out = run_module(stage, "--profile", profile, root=root)
            assert out.returncode == 0, out.stderr[-2000:]

    return _built_once(tmp_path_factory, f"{profile}_base", build)


@pytest.fixture(scope="session")
def ci_base(tmp_path_factory) -> Path:
    """The ci profile's prompts and its pretrained base model (40 steps; built once per session)."""
    return _prepared_project(tmp_path_factory, "ci")


@pytest.fixture(scope="session")
def toy_base(tmp_path_factory) -> Path:
    """The toy profile's prompts and the shipped base model (a verified copy of assets/toy-base, no training)."""
    return _prepared_project(tmp_path_factory, "toy")


@pytest.fixture
def ci_project(ci_base, tmp_path) -> Path:
    """A fresh copy of :func:`ci_base` that a test may train in."""
    root = tmp_path / "project"
    shutil.copytree(ci_base, root)
    return root


def run_module(module: str, *args: str, root: Path, env: dict | None = None, timeout: float = 600):
    """``python -m <module> args`` in ``root`` with the repo importable; returns the CompletedProcess."""
    import os

    e = dict(os.environ)
    e.update({"JAGG_ROOT": str(root), "PYTHONPATH": str(REPO)})
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", module, *args], cwd=root, env=e, capture_output=True, text=True,
                          timeout=timeout)


# A reward smooth in the pixels: runs on two platforms differ at rounding level only (JPEG sizes jump by whole bytes
# and carry a last-bit difference into another update), which test_refactor_reference relies on.
WORKER_ARGS = ["--worker", "--profile", "ci", "--seed", "0", "--set", "reward.weights={toy_background: 1.0}",
               "--set", "train.iterations=4", "--set", "train.checkpoint_every=1"]


@pytest.fixture(scope="session")
def uninterrupted(ci_base, tmp_path_factory):
    """method -> the trainable tensors after 4 uninterrupted iterations of the ci profile (computed once)."""
    from jagg_core.trainer.checkpoint import load_tensors

    cache: dict[str, dict] = {}
    roots: dict[str, Path] = {}

    def train(method: str, root: Path) -> None:
        shutil.copytree(ci_base, root, dirs_exist_ok=True)
        out = run_module("tasks.train", *WORKER_ARGS, "--method", method, root=root)
        assert out.returncode == 0, out.stderr[-2000:]

    def get(method: str) -> dict:
        if method not in cache:
            root = _built_once(tmp_path_factory, f"ref-{method}", lambda folder: train(method, folder))
            cache[method] = load_tensors(root / f"checkpoints/ci/{method}-s0/checkpoint-000004/trainable.safetensors")
            roots[method] = root
        return cache[method]

    get.roots = roots  # method -> the project root it trained in (its curve, checkpoints)
    return get


@pytest.fixture(autouse=True)
def _each_test_starts_with_no_remembered_secret():
    """`jagg_core.setup.redact` keeps every secret it has seen for the life of the process (a log record quoting one
    later is redacted too). Under pytest one worker process runs many tests: a token one test used ("another") was
    redacted out of a later test's error sentence. Forget them after each test, as a fresh process would."""
    yield
    redact = sys.modules.get("jagg_core.setup.redact")
    if redact is not None:
        redact._known.clear()


@pytest.fixture(scope="session", autouse=True)
def _log_handlers_outlive_pytest():
    """Prefect's console handlers hold the stream that was sys.stderr when Prefect was imported — pytest's capture,
    closed when the session ends; Prefect's temporary server logs "Stopping temporary server" at interpreter exit,
    after that. Point Prefect's stream handlers at the real stderr when the session ends, so that line is printed
    rather than reported as a logging error."""
    import logging

    yield
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if type(handler).__module__.startswith("prefect") and isinstance(handler, logging.StreamHandler):
                handler.stream = sys.__stderr__  # not setStream: it flushes the old stream, maybe closed already
                if getattr(handler, "console", None) is not None:  # PrefectConsoleHandler prints through rich
                    handler.console.file = sys.__stderr__
