"""A sweep on the work pool (``resources.dispatch: pool``): every training and every evaluation a flow run of its own.

The reproduce flow (``flows/reproduce.py``) hands its units to :func:`run_on_pool`, which submits each as a run of a
deployment of prefect.yaml (``jagg-train/pool``: :func:`train_unit`; ``jagg-evaluate-run/pool``:
:func:`evaluate_unit`) through Prefect's ``run_deployment``. Any worker of the pool, on any host, takes it; the Prefect
UI shows each as a child of the sweep's flow run, tagged with the worker and host that ran it. At most
``parallel_runs`` are in flight, the next one as soon as one ends; a run's evaluation follows its training.

What the hosts share is checked before any unit trains (``tasks/dispatch.py``). A unit whose flow run CRASHED — its
worker or host died: Prefect marks a run CRASHED when its heartbeats stop (the automation `jagg services up` creates,
docs/scaling.md) — is submitted again (a training at most twice, an evaluation once, as the stage tasks retry a
process that died) and resumes from its last complete checkpoint on whichever worker takes it; a unit that FAILED on
an error of its own is not, and fails the sweep with its sentence. A sweep none of whose units in flight a worker has
taken for ``resources.pool_wait_s`` seconds (no worker serves the pool's queue) fails in one sentence.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from prefect import flow, get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.context import FlowRunContext
from prefect.deployments import run_deployment

from jagg_core.errors import UserError
from jagg_core.pipeline.tracking import check_sweep_name
from jagg_core.setup.config import Params
from jagg_core.setup.paths import run_name
from tasks.common import ROOT, shown_redacted
from tasks.dispatch import check_shared, remove_sentinel, where, write_sentinel

from .stages import evaluate_task, train_task
from .sweep import flow_params

__all__ = ["EVALUATE_DEPLOYMENT", "TRAIN_DEPLOYMENT", "PoolError", "evaluate_unit", "run_on_pool", "train_unit"]

TRAIN_DEPLOYMENT = "jagg-train/pool"
EVALUATE_DEPLOYMENT = "jagg-evaluate-run/pool"
# Submissions again after a CRASHED flow run, as the stage tasks' retries of a process that died (flows/stages.py)
RESUBMITS = {"train": 2, "evaluate": 1}
POLL_S = 2.0
UNTAKEN_S = 120.0  # a unit no worker has taken for this long: said in the sweep's log and its flow run's state
# A unit a worker took (PENDING) but whose process never started — the worker died in between; Prefect's heartbeat
# automation only sees processes that started — is marked CRASHED after this long, and submitted again as a crash is.
PENDING_S = 600.0


class PoolError(UserError, RuntimeError):
    """A unit of a pool-dispatched sweep failed, or crashed more often than it is submitted again."""


def _announce(what: str) -> dict[str, str]:
    """Say, in the log and as tags of this flow run, which worker and host run this unit."""
    me = where()
    ctx = FlowRunContext.get()
    if ctx and ctx.flow_run:
        tags = sorted({*ctx.flow_run.tags, f"worker:{me['worker']}", f"host:{me['host']}"})
        with get_client(sync_client=True) as client:
            client.update_flow_run(ctx.flow_run.id, tags=tags)
    print(f"{what} on worker {me['worker']!r} (host {me['host']})")
    return me


@flow(name="jagg-train", log_prints=True)
@shown_redacted
def train_unit(profile: str, method: str, seed: int, shared: dict[str, str], sweep: str,
               overrides: dict[str, Any] | None = None, params_file: str | None = None, restart: bool = False,
               take_over: bool = False) -> dict:
    """One training run of a pool-dispatched sweep (submitted by :func:`run_on_pool`); refuses, before it trains, a
    worker that does not see the sweep's project folder and MLflow store (``shared``: the sweep's sentinel)."""
    me = _announce(f"train {run_name(method, seed)}")
    params = flow_params(profile, params_file, overrides)
    check_sweep_name(sweep, params)  # a forged unit's name is checked as the sweep's own was, before any store
    check_shared(params, ROOT, sweep, shared)
    return {**train_task(params, method, seed, sweep, restart, take_over), **me}


@flow(name="jagg-evaluate-run", log_prints=True)
@shown_redacted
def evaluate_unit(profile: str, run: str, shared: dict[str, str], sweep: str, overrides: dict[str, Any] | None = None,
                  params_file: str | None = None) -> dict:
    """One evaluation (a trained run's checkpoints, or ``base``) of a pool-dispatched sweep."""
    me = _announce(f"evaluate {run}")
    params = flow_params(profile, params_file, overrides)
    check_sweep_name(sweep, params)  # a forged unit's name is checked as the sweep's own was, before any store
    check_shared(params, ROOT, sweep, shared)
    evaluate_task(params, run, sweep)
    return {"run": run, **me}


@dataclass
class _Unit:
    kind: str  # train | evaluate
    run: str
    method: str | None = None
    seed: int | None = None
    crashes: int = 0
    flow_runs: list[str] = field(default_factory=list)


def _submit(unit: _Unit, common: dict[str, Any]) -> str:
    if unit.kind == "train":
        name, params = TRAIN_DEPLOYMENT, {"method": unit.method, "seed": unit.seed, "take_over": unit.crashes > 0,
                                          "restart": common["restart"]}
    else:
        name, params = EVALUATE_DEPLOYMENT, {"run": unit.run}
    params.update({k: common[k] for k in ("profile", "shared", "sweep", "overrides", "params_file")})
    # The same submission sent twice (the client retrying a request the server had carried out) gives one flow run,
    # not two trainings of one run on two workers; a submission again after a crash, or a retry of the sweep's own
    # flow run, is another key.
    key = f"{common['key']}/{unit.kind} {unit.run}/{unit.crashes}"
    fr = run_deployment(name, parameters=params, timeout=0, flow_run_name=f"{unit.kind} {unit.run}",
                        tags=[f"sweep:{common['sweep']}"], idempotency_key=key)
    unit.flow_runs.append(str(fr.id))
    return str(fr.id)


def _sweep_key() -> str:
    """This start of the sweep: its flow run and how many times it ran (a retry from the Prefect UI is another)."""
    ctx = FlowRunContext.get()
    if ctx and ctx.flow_run:
        return f"{ctx.flow_run.id}.{ctx.flow_run.run_count}"
    return uuid.uuid4().hex


def _worker(tags: list[str]) -> str:
    return next((t.removeprefix("worker:") for t in tags if t.startswith("worker:")), "?")


def _unit_sentence(message: str | None) -> str:
    """The unit's own sentence out of a FAILED flow run's state message (Prefect prefixes it with "Flow run
    encountered an exception: <Class>: ")."""
    text = " ".join((message or "").split())
    text = re.sub(r"^Flow run encountered an exception: (?:[\w.]+: )?", "", text)
    return text or "no message"


def _cancel(client: Any, in_flight: dict[str, _Unit]) -> list[str]:
    """Cancel the units still in flight (their workers stop their processes and free their devices); returns them,
    as "train jagg-s1", for the sweep's last sentence."""
    from prefect.states import Cancelling

    cancelled = []
    for fid, unit in in_flight.items():
        try:
            client.set_flow_run_state(fid, Cancelling(message="the sweep stopped"), force=True)
            cancelled.append(f"{unit.kind} {unit.run}")
        except Exception as e:  # noqa: BLE001  (the sweep's own error is what the user must see)
            print(f"jagg: warning: could not cancel {unit.kind} {unit.run} (flow run {fid}): {type(e).__name__}")
    return cancelled


def run_on_pool(params: Params, *, profile: str, parallel_runs: int, sweep: str, overrides: dict[str, Any] | None,
                params_file: str | None, restart: bool) -> list[dict]:
    """Evaluate the base model, train every method × seed and evaluate each, every unit a flow run on the pool;
    returns, per unit, its run, flow runs and the worker that completed it. If a unit fails (or the sweep itself
    does), the units still in flight are cancelled and named."""
    pending = [_Unit("evaluate", "base")] + [_Unit("train", run_name(m, s), m, s)
                                               for s in params.run.seeds for m in params.run.methods]
    in_flight: dict[str, _Unit] = {}
    done: list[dict] = []
    submitted_at: dict[str, float] = {}
    shared = write_sentinel(params, ROOT, sweep)
    common = {"profile": profile, "shared": shared, "sweep": sweep, "overrides": overrides,
              "params_file": params_file, "restart": restart, "key": _sweep_key(),
              "wait_s": params.resources.pool_wait_s}
    try:
        with get_client(sync_client=True) as client:
            try:
                _drive(client, pending, in_flight, done, submitted_at, common, parallel_runs)
            except BaseException as e:
                cancelled = _cancel(client, in_flight) if in_flight else []
                if cancelled and isinstance(e, PoolError):
                    raise PoolError(f"{str(e).rstrip('.')}; the sweep stopped and cancelled the units still in "
                                    f"flight ({', '.join(cancelled)}): run it again to resume them.") from None
                if cancelled:
                    print(f"jagg: the sweep stopped; cancelled the units still in flight: {', '.join(cancelled)}")
                raise
    finally:
        remove_sentinel(ROOT, shared)
    return done


def _crash(client: Any, fid: str, message: str) -> Any:
    """Mark flow run ``fid`` CRASHED with ``message`` (its worker will never run it); returns that state."""
    from prefect.states import Crashed

    state = Crashed(message=message)
    client.set_flow_run_state(fid, state, force=True)
    return state


def _tell(client: Any, message: str | None) -> None:
    """Put ``message`` in the state of this sweep's own flow run, which stays RUNNING: what the Prefect UI, `prefect
    flow-run inspect` and the flow run's state events show while the sweep waits (its log alone is easily missed)."""
    from prefect.states import Running

    ctx = FlowRunContext.get()
    if not (ctx and ctx.flow_run):
        return
    try:
        client.set_flow_run_state(ctx.flow_run.id, Running(message=message), force=True)
    except Exception as e:  # noqa: BLE001  (the message only repeats the log's line: the sweep goes on)
        print(f"jagg: warning: could not set the sweep's state message: {type(e).__name__}")


def _drive(client: Any, pending: list[_Unit], in_flight: dict[str, _Unit], done: list[dict],
           submitted_at: dict[str, float], common: dict[str, Any], parallel_runs: int) -> None:
    """Keep ``parallel_runs`` units in flight until every unit has completed; a unit that FAILED raises."""
    since: dict[str, tuple[str, float]] = {}  # flow run -> (its state's type, when this sweep first saw it)
    idle_since: float | None = None  # since when no unit in flight has been taken by a worker
    told: str | None = None  # the message this sweep last put in its flow run's state
    while pending or in_flight:
        while pending and len(in_flight) < parallel_runs:
            unit = pending.pop(0)
            fid = _submit(unit, common)
            in_flight[fid] = unit
            submitted_at[fid] = time.monotonic()
        time.sleep(POLL_S)
        flow_runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(in_flight))))
        seen = {str(fr.id) for fr in flow_runs}
        gone = [fid for fid in in_flight if fid not in seen]
        if gone:
            unit = in_flight.pop(gone[0])
            raise PoolError(f"{unit.kind} {unit.run}: its flow run {gone[0]} is gone from the Prefect server "
                            f"(deleted?).")
        waiting = [fr for fr in flow_runs if fr.state is None or fr.state.is_scheduled()]  # taken by no worker yet
        if len(waiting) == len(flow_runs):  # nothing in flight is taken
            idle_since = time.monotonic() if idle_since is None else idle_since
            if common["wait_s"] and time.monotonic() - idle_since > common["wait_s"]:
                raise PoolError(f"no worker of the pool has taken any of the sweep's units in {common['wait_s']:g} s "
                                f"(resources.pool_wait_s): start one that serves the pool's queue `units` "
                                f"(docs/scaling.md), or set resources.pool_wait_s to 0 to wait for ever.")
        else:
            idle_since = None
        untaken = None
        for fr in flow_runs:
            fid, unit, state, worker = str(fr.id), in_flight[str(fr.id)], fr.state, _worker(fr.tags)
            if state is not None and (since.get(fid) or ("",))[0] != state.type:
                since[fid] = (state.type, time.monotonic())
            if state is not None and state.is_pending() and time.monotonic() - since[fid][1] > PENDING_S:
                state = _crash(client, fid, f"taken by worker {worker!r} but not started in {PENDING_S:.0f} s: the "
                                            f"worker died before it started")
            if state is None or not state.is_final():
                if state is not None and state.is_scheduled() and time.monotonic() - submitted_at[fid] > UNTAKEN_S:
                    untaken = (f"{unit.kind} {unit.run}: no worker of the pool has taken it in {UNTAKEN_S:.0f} s; "
                               f"start one that serves the pool's queue `units` (docs/scaling.md)")
                    print(untaken)
                    submitted_at[fid] = time.monotonic()  # said again every UNTAKEN_S while it waits
                continue
            del in_flight[fid]
            if state.is_completed():
                print(f"{unit.kind} {unit.run} completed on worker {worker!r}")
                done.append({"kind": unit.kind, "run": unit.run, "worker": worker, "flow_runs": unit.flow_runs})
                if unit.kind == "train":
                    pending.insert(0, _Unit("evaluate", unit.run))  # its evaluation next
            elif state.is_crashed() and unit.crashes < RESUBMITS[unit.kind]:
                unit.crashes += 1
                print(f"{unit.kind} {unit.run} crashed on worker {worker!r} ({state.message}); submitting it again "
                      f"({unit.crashes} of {RESUBMITS[unit.kind]}): it resumes from its last complete checkpoint")
                pending.insert(0, unit)
            else:
                raise PoolError(f"{unit.kind} {unit.run} ended {state.name} on worker {worker!r} (flow run {fid}): "
                                f"{_unit_sentence(state.message)}")
        if untaken and untaken != told:
            told = untaken
            _tell(client, told)
        elif told and not waiting:  # every unit in flight is taken: the message is no longer true
            told = None
            _tell(client, None)
