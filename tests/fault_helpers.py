"""What the fault tests of several files share: the ci profile's params and checkpoint folder, the one-sentence
check, a live MLflow server, the project's live processes, a grep of a folder for a secret, a real MLflow store.

Not a test file (pytest collects ``test_*.py`` only); test files import it as they import conftest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from jagg_core.setup.params_io import load_params
from jagg_core.setup.paths import Layout
from tasks.common import free_port

PARAMS = REPO / "params.yaml"

JPEG = {"reward.weights": {"jpeg_compressibility": 1.0}}


def ci(root, **overrides):
    return load_params(root / "params.yaml", "ci", {**JPEG, **overrides})


def _ckpts(root, run="jagg-s0"):
    return Layout(root, "ci").checkpoints(run)


def _one_sentence(said) -> str:
    """``said`` (an error, or what a command printed, stripped) is one sentence: one line, no traceback, < 600
    characters; returns its text."""
    text = str(said) if isinstance(said, BaseException) else str(said).strip()
    assert "\n" not in text and "Traceback" not in text and len(text) < 600, text
    return text


class _MlflowServer:
    """A real `mlflow server` on a sqlite store, that a test can stop and start again on the same port."""

    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, free_port(), None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import time
        import urllib.request

        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}", "--workers", "1"],
            cwd=self.root, env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise AssertionError("the MLflow server did not start")

    def stop(self) -> None:
        import signal

        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=60)


def _own_processes(root: Path) -> list:
    """Every live process started for the project ``root`` (by its JAGG_ROOT), the test's own excepted."""
    import psutil

    mine = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("JAGG_ROOT") == str(root):
                mine.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return mine


def _files_holding(folder: Path, secret: bytes) -> list[str]:
    hits = []
    for f in folder.rglob("*"):
        try:
            if f.is_file() and not f.is_symlink() and secret in f.read_bytes():
                hits.append(str(f.relative_to(folder)))
        except OSError:
            pass
    return hits


def _tracker(root: Path):
    """A real MLflow store (SQLite) under ``root`` and the ci profile's params and layout."""
    from jagg_core.pipeline.tracking import Tracker
    from jagg_core.setup.paths import Layout

    params = load_params(PARAMS, "ci")
    return Tracker(params, root), params, Layout.of(params, root)
