"""Pipeline stages: one plain function per stage, its Prefect task, and a `python -m tasks.<stage>` entry.

Importing the package checks that this Python is the project's environment (jagg installed in its site-packages, as
`make setup` installs it into `.venv`, with the packages the stages import), before any stage module is imported or
anything written: DVC runs a stage's `python -m tasks.<stage>` with whichever `python` is first on PATH, and a
system Python that happened to hold numpy and PyYAML rewrote the prompts and the base model before failing on
MLflow's import. Elsewhere it says, in one sentence, how to run the stage, and exits with status 1.
"""

from __future__ import annotations


def _in_project_environment() -> bool:
    """jagg's distribution is installed where this interpreter installs packages (its site-packages, or the user's
    where the interpreter reads it), not merely importable from the checkout (the repository root is on sys.path
    under `python -m`, and its jagg.egg-info with it)."""
    import site
    import sys
    import sysconfig
    from pathlib import Path

    places = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")} | set(site.getsitepackages())
    if site.ENABLE_USER_SITE and not sys.flags.no_user_site:
        places.add(site.getusersitepackages())
    return any(next(Path(p).glob("jagg-*.dist-info"), None) is not None for p in places if Path(p).is_dir())


if not _in_project_environment():
    import sys as _sys

    raise SystemExit(f"jagg: error: {_sys.executable} is not the project's Python (jagg is not installed there), so "
                     f"the stage did not run; activate the project's environment (`source .venv/bin/activate`, built "
                     f"by `make setup`) or run the pipeline with `make repro`.")
