"""Secrets kept out of Prefect's records: a flow run's parameters are stored by the Prefect server as they are given.

`jagg run` hands its flow the overrides redacted (``http://user:***@host/``, ``model.options.hf_token: ***``, by the
one redaction of :mod:`jagg_core.setup.redact`) and keeps the real values out of band: in this process, and in
``JAGG_SECRET_OVERRIDES`` (a JSON mapping of dotted keys to real values) for a flow run in another process — a
deployment run's worker gets it from its environment (``JAGG_SECRET_OVERRIDES`` set where `jagg services up` or
`prefect worker start` runs), while the run's parameters carry only the redacted form. The flow puts a real value back
where a parameter is exactly the redaction of it, so its trainers (0600 context files) still get the real URI.
"""

from __future__ import annotations

import os
from typing import Any

from jagg_core.setup.config import ParamsError
from jagg_core.setup.json_read import parse_json
from jagg_core.setup.redact import redact

__all__ = ["ENV", "restore", "withhold"]

ENV = "JAGG_SECRET_OVERRIDES"
_withheld: dict[str, Any] = {}  # this process's own: what `jagg run` took out of its flow's parameters


def withhold(overrides: dict[str, Any] | None) -> dict[str, Any] | None:
    """``overrides`` as Prefect may store them: every secret redacted; the real values stay in this process."""
    if not overrides:
        return overrides
    shown = redact(overrides)
    _withheld.update({k: v for k, v in overrides.items() if shown[k] != v})
    return shown


def _store(environ: dict | None) -> dict[str, Any]:
    raw = (os.environ if environ is None else environ).get(ENV)
    if not raw:
        return dict(_withheld)
    given = parse_json(raw, ParamsError, ENV, fix="it must be a JSON mapping of dotted params to values")
    if not isinstance(given, dict):
        raise ParamsError(f"{ENV} must be a JSON mapping of dotted params to values; it holds a "
                          f"{type(given).__name__}.")
    return {**given, **_withheld}


def restore(overrides: dict[str, Any] | None, environ: dict | None = None) -> dict[str, Any] | None:
    """The overrides with each redacted value that a withheld real value redacts to put back (others as given)."""
    if not overrides:
        return overrides
    store = _store(environ)
    shown = redact(store)  # the whole mapping: a secret of one key is redacted inside the others' values too
    return {k: store[k] if k in store and shown[k] == v else v for k, v in overrides.items()}
