"""DVC's record of a reproduction the flow ran: after ``jagg run`` (``make run``, a Prefect deployment run) of a
profile as params.yaml states it, every stage of that profile's pipeline (the root ``dvc.yaml`` for the active one) is
recorded in its ``dvc.lock`` by DVC itself (``dvc commit --force``: the deps' and outputs' hashes as they are now,
the outputs linked into DVC's cache), so ``dvc status dvc.yaml`` says it is up to date and a bare ``dvc repro`` runs
nothing: the flow ran the pipeline's very commands into the same folders.

Nothing is recorded for a flow run DVC's pipeline does not describe: a sweep point (overrides), another params file,
a project without DVC, or pipelines that ``make pipelines`` would write otherwise (then it says so). A ``dvc commit``
that fails leaves the lock as it was and the flow's results whole: one warning with DVC's own last line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from jagg_core.setup.config import ParamsError
from jagg_core.setup.params_io import load_params
from jagg_core.setup.storage import read_text

from .common import ROOT
from .dvc_pipelines import TEMPLATE, _raw, pipeline_path, pipeline_text


def _written_text(root: Path, raw: dict[str, Any], profile: str) -> str:
    """The pipeline `make pipelines` writes for ``profile`` now (that profile's alone: all of them take seconds)."""
    params = load_params(root / "params.yaml", profile, root=root)
    template = read_text(root / TEMPLATE, ParamsError)
    return pipeline_text(template, raw, profile, params.secret_options(), params.marked_secrets())

__all__ = ["record_in_dvc"]


def record_in_dvc(profile: str, *, overrides: dict[str, Any] | None, params_file: str | None,
                  root: Path = ROOT) -> str:
    """Record ``profile``'s finished pipeline in its ``dvc.lock``; returns the line that says what was done."""
    if overrides:
        return "DVC's record left as it is: this flow run's overrides make it a sweep point no pipeline describes."
    if params_file is not None and Path(params_file).resolve() != (root / "params.yaml").resolve():
        return "DVC's record left as it is: the pipelines read params.yaml, and this flow run another params file."
    if not (root / ".dvc").is_dir():
        return "DVC's record left as it is: the project has no .dvc folder (`dvc init`)."
    try:
        raw = _raw(root / "params.yaml")
        target = pipeline_path(raw, profile)
        current = (root / target).is_file() and read_text(root / target, ParamsError) == _written_text(root, raw, profile)
    except ParamsError as e:  # what `make pipelines` would say too
        return f"DVC's record left as it is: {e}"
    if not current:
        return f"DVC's record left as it is: {target} is not the pipeline params.yaml makes; run `make pipelines`."
    # DVC of this environment (sys.executable's), as `make repro` runs it
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    out = subprocess.run([sys.executable, "-m", "dvc", "commit", "--force", "--quiet", str(target)], cwd=root,
                         env=env, capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        return f"DVC's record left as it is: `dvc commit {target}` failed ({last})."
    return f"DVC's record of {target} is this run's: `dvc status {target}` is up to date, `dvc repro` runs nothing."
