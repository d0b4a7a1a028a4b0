"""What every flow of jagg shares: a flow run's validated params (a sweep point with overrides) and its sweep name.

A flow run with overrides is a sweep point: its runs, checkpoints, evaluations and report go to folders of their own
(``<profile>-<digest of the overrides>``), beside the profile's, while it shares the profile's prompt set and base
model. Overrides of ``tracking.*`` and ``resources.*`` (where results are logged, which devices run them) are no part of
the digest: alone they keep the profile's folders, beside others the point's; a secret is hashed redacted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Any, Iterator, Sequence

from prefect.context import FlowRunContext

from jagg_core.pipeline.tracking import Tracker, check_sweep_name
from jagg_core.setup.config import Params, ParamsError
from jagg_core.setup.paths import inside
from jagg_core.setup.redact import mask, redact_own
from tasks.common import ROOT, load

from .secrets import restore

__all__ = ["flow_params", "sweep_digest", "sweep_name", "sweep_tracked"]

# Overrides that would change the prompt set or the base model, which a sweep point shares with its profile.
_SHARED_SECTIONS = ("data.", "world.", "model.", "pretrain.", "profile", "outputs")
# Overrides of how runs are logged and placed, not of what they compute: the profile's own folders.
_NEUTRAL_SECTIONS = ("tracking.", "resources.")


def sweep_name(sweep: str | None, params: Params) -> str:
    """The MLflow parent run of this flow run's runs: the given name, checked at the flow's door before anything is
    stored under it (MLflow, the units' Prefect tags: ``check_sweep_name``, no secret of ``params`` and MLflow's
    characters), else the flow run's id."""
    if sweep:
        return check_sweep_name(sweep, params)
    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx and ctx.flow_run else "default"


@contextlib.contextmanager
def sweep_tracked(params: Params, sweep: str) -> Iterator[str]:
    """The sweep's MLflow parent run while the flow's block runs: RUNNING, owned by this process, then FINISHED when
    the block completes, FAILED (its ``jagg.failure`` tag the error's sentence, redacted) when it fails, KILLED when
    it is interrupted, cancelled or crashes (SIGTERM; a SIGKILLed one is marked KILLED at once by its watcher,
    :mod:`jagg_core.pipeline.sweep_watch`): :meth:`Tracker.sweeping`."""
    with Tracker(params, ROOT).sweeping(sweep) as run_id:
        yield run_id


def flow_params(profile: str | None, params_file: str | None = None, overrides: dict[str, Any] | None = None) -> Params:
    """The validated params of a flow run; with overrides, a sweep point with output folders of its own."""
    if overrides is not None and not isinstance(overrides, dict):
        raise ParamsError(f"overrides must be a mapping of dotted keys to values, e.g. {{\"train.iterations\": 8}}; "
                          f"got {type(overrides).__name__}.")
    overrides = restore(overrides)  # `jagg run` hands Prefect its secrets redacted (flows/secrets.py)
    shared = sorted(k for k in overrides or {} if k.startswith(_SHARED_SECTIONS))
    if shared:
        raise ParamsError(f"override {shared[0]} would change the prompt set or the base model that a sweep point "
                          f"shares with its profile; add a profile to params.yaml for that.")
    if params_file is not None:  # a flow run's parameter (a pool unit's may be forged): the path rule before any read
        params_file = str(inside(ROOT, params_file, "params_file", kind="file"))
    params = load(profile, params_file, overrides)
    if any(not k.startswith(_NEUTRAL_SECTIONS) for k in overrides or {}):
        digest = sweep_digest(overrides, params.secret_options())
        params = params.model_copy(update={"outputs": f"{params.profile}-{digest}"})
    return params


def sweep_digest(overrides: dict[str, Any], secret_options: Sequence[Sequence[str]] = ()) -> str:
    """The digest that names a sweep point's folders: of the overrides that change its results only. Those of
    ``tracking.*`` and ``resources.*`` are left out (a thread count or a rotated password keeps the point's folders
    and its trained runs), and the rest is hashed with its secrets redacted (a served reward's token, a URL's
    password, the options a plugin marks secret: ``secret_options``, their paths in params): no folder name is a
    function of a secret. A point without such overrides hashes as before."""
    kept = {k: v for k, v in overrides.items() if not k.startswith(_NEUTRAL_SECTIONS)}
    for key in kept:
        at = tuple(key.split("."))  # `reward.options.mine.seed_phrase`, or a section holding it as a mapping
        inner = [tuple(p[len(at):]) for p in secret_options if tuple(p[:len(at)]) == at]
        if () in inner:
            kept[key] = mask({"v": kept[key]}, [("v",)])["v"]
        elif inner:
            kept[key] = mask(kept[key], inner)
    return hashlib.sha256(json.dumps(redact_own(kept), sort_keys=True, default=str).encode()).hexdigest()[:8]
