"""Reliability, round 6 (issue 47), mechanisms 5–7: ownership that can expire, every entry point refuses bad input in
one sentence, small things a user sees.

Each test is named after its mechanism (``test_m5_…``, ``test_m6_…``, ``test_m7_…``) and failed on the code before its
fix; the rows of docs/reliability.md's "Round 6" section name them. Cheap probes call the library in-process or start
one short command on the ci profile.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_module
from jagg_core.setup.config import ParamsError
from jagg_core.setup.params_io import load_params

PARAMS = REPO / "params.yaml"


def _one_sentence(text: str) -> str:
    text = text.strip()
    assert "\n" not in text and "Traceback" not in text and len(text) < 600, text
    return text


# --- mechanism 5: ownership that can expire -------------------------------------------------------------------------

ANOTHER_HOST = "a-container-that-restarted:4242:1700000000.00"


def _held_run(root: Path, owner: str, heartbeat_age: float | None = None):
    """jagg-s0's MLflow run in the real store under ``root``, RUNNING, its owner tag ``owner`` (and, given
    ``heartbeat_age``, a heartbeat that many seconds old); returns (tracker, params, layout, run id)."""
    import time

    from jagg_core.pipeline.tracking import OWNER_TAG
    from jagg_core.trainer.fingerprint import run_fingerprint

    tracker, params, lay = _tracker(root)
    run_id = tracker.child_run("default", "jagg-s0", method="jagg", seed=0,
                               key=run_fingerprint(params, lay, "jagg", 0))
    tags = {OWNER_TAG: owner}
    if heartbeat_age is not None:
        tags["jagg.heartbeat"] = f"{time.time() - heartbeat_age:.0f}"
    tracker.set_tags(run_id, tags)
    return tracker, params, lay, run_id


@pytest.mark.parametrize("owner", ["garbage", ANOTHER_HOST])
def test_m5_restart_takes_over_a_run_whose_owner_cannot_be_checked(ci_project, monkeypatch, caplog, owner):
    """A RUNNING run whose owner tag this machine cannot check (garbage, or another host's, as after a container
    restart) refused `jagg train` for good, `--restart` included ("is being trained by process garbage"). Now the
    refusal says how to get out, and `--restart` takes the run over with one warning naming the old owner."""
    import logging

    from jagg_core.pipeline.tracking import OWNER_TAG, owner_id
    from jagg_core.setup.storage import LockedError
    from tasks.train import train_run

    tracker, params, lay, run_id = _held_run(ci_project, owner)
    with pytest.raises(LockedError) as refused:
        train_run(params, lay, "jagg", 0)
    said = _one_sentence(str(refused.value))
    assert "cannot check" in said and "--restart" in said, said
    assert "'garbage'" in said or "a-container-that-restarted:4242 " in said, said
    assert tracker.client.get_run(run_id).info.status == "RUNNING"
    monkeypatch.setenv("JAGG_FAULT", "run_created@0:oserror")  # stop right after the claim: no worker starts
    with caplog.at_level(logging.WARNING), pytest.raises(OSError, match="injected"):
        train_run(params, lay, "jagg", 0, restart=True)
    taken = [r.getMessage() for r in caplog.records if "takes it over" in r.getMessage()]
    assert len(taken) == 1 and run_id in taken[0] and owner.split(":")[0] in taken[0], taken
    run = tracker.client.get_run(run_id)
    assert run.data.tags[OWNER_TAG] == owner_id() and run.info.status == "FAILED"  # ours, ended by the injected error


def test_m5_a_crashed_units_run_is_taken_over_after_two_missed_heartbeats_not_at_once(ci_project, monkeypatch, caplog):
    """A pool-dispatched training submitted again after Prefect saw its flow run crash (`take_over`) took the MLflow
    run over at once, even from an owner on a host cut off from Prefect but not from MLflow, still training. Now it
    waits until the owner has missed two heartbeats: a beat meanwhile keeps the run its owner's (refused, one
    sentence); none, and it takes the run over with one warning."""
    import logging
    import time
    from types import SimpleNamespace

    import jagg_core.pipeline.tracking as tracking
    from jagg_core.pipeline.tracking import CRASHED_OWNER_STALE_SECONDS, OWNER_TAG, owner_id
    from jagg_core.setup.storage import LockedError
    from tasks.train import train_run

    tracker, params, lay, run_id = _held_run(ci_project, ANOTHER_HOST, heartbeat_age=30)
    clock = SimpleNamespace(now=time.time(), slept=[], beat=None)

    def sleep(seconds: float) -> None:
        clock.now += seconds
        clock.slept.append(seconds)
        if clock.beat is not None and len(clock.slept) == clock.beat:  # the owner beats while the unit waits
            tracker.set_tags(run_id, {"jagg.heartbeat": f"{clock.now:.0f}"})

    monkeypatch.setattr(tracking, "time", SimpleNamespace(time=lambda: clock.now, sleep=sleep))
    clock.beat = 2
    with pytest.raises(LockedError, match="a-container-that-restarted:4242"):
        train_run(params, lay, "jagg", 0, take_over=True)
    assert len(clock.slept) == 2 and tracker.client.get_run(run_id).data.tags[OWNER_TAG] == ANOTHER_HOST
    clock.beat, clock.slept = None, []
    started = clock.now
    monkeypatch.setenv("JAGG_FAULT", "run_created@0:oserror")  # stop right after the claim: no worker starts
    with caplog.at_level(logging.WARNING), pytest.raises(OSError, match="injected"):
        train_run(params, lay, "jagg", 0, take_over=True)
    last_beat = float(tracker.client.get_run(run_id).data.tags["jagg.heartbeat"])
    assert clock.now - started >= CRASHED_OWNER_STALE_SECONDS - 30 and len(clock.slept) >= 2  # it waited, then took it
    said = [r.getMessage() for r in caplog.records if "a-container-that-restarted:4242" in r.getMessage()]
    assert len(said) == 1 and "whose flow run crashed" in said[0] and "taking it over" in said[0], said
    run = tracker.client.get_run(run_id)
    assert run.data.tags[OWNER_TAG] == owner_id() and run.info.status == "FAILED" and last_beat >= started


def test_m5_an_owner_without_a_heartbeat_for_the_bound_is_stale(ci_project, monkeypatch, caplog):
    """Another host's owner that has not renewed its heartbeat for longer than OWNER_STALE_SECONDS (10 min; here an
    hour) is gone: `jagg train` (without --restart) marks its run KILLED and takes the run over, with one warning
    naming the old owner; one whose heartbeat is a minute old is still refused. The owner renews its heartbeat while
    it trains (Tracker.heartbeat)."""
    import logging
    import time

    from jagg_core.pipeline.tracking import OWNER_TAG, owner_id
    from jagg_core.setup.storage import LockedError
    from tasks.train import train_run

    tracker, params, lay, run_id = _held_run(ci_project, ANOTHER_HOST, heartbeat_age=60)  # a minute ago: alive
    with pytest.raises(LockedError, match="a-container-that-restarted:4242"):
        train_run(params, lay, "jagg", 0)
    tracker.set_tags(run_id, {"jagg.heartbeat": f"{time.time() - 3600:.0f}"})  # an hour ago: gone
    monkeypatch.setenv("JAGG_FAULT", "run_created@0:oserror")
    with caplog.at_level(logging.WARNING), pytest.raises(OSError, match="injected"):
        train_run(params, lay, "jagg", 0)
    said = [r.getMessage() for r in caplog.records if "a-container-that-restarted:4242" in r.getMessage()]
    assert len(said) == 1 and "no sign of life for 60 min" in said[0], said
    run = tracker.client.get_run(run_id)
    assert run.data.tags[OWNER_TAG] == owner_id() and run.info.status == "FAILED"
    # a live owner's heartbeat: renewed while its block runs
    tracker.set_tags(run_id, {"jagg.heartbeat": "0"})
    with tracker.heartbeat(run_id, every=0.1):
        time.sleep(1.0)
    assert time.time() - float(tracker.client.get_run(run_id).data.tags["jagg.heartbeat"]) < 5


# --- mechanism 6: every entry point refuses bad input in one sentence ------------------------------------------------


def test_m6_a_key_path_1200_deep_is_one_sentence(tmp_path):
    """`--set a.a.…(1200 parts)=1` was a RecursionError traceback (validation recursed through the nested tree)."""
    deep = ".".join(["a"] * 1200)
    with pytest.raises(ParamsError, match="1,200 levels deep"):
        load_params(PARAMS, "ci", {deep: 1})
    out = run_module("tasks.plan", "--profile", "ci", "--params", str(PARAMS), "--set", f"{deep}=1", root=tmp_path)
    assert out.returncode == 1 and _one_sentence(out.stderr).startswith("jagg: error: override a.a."), out.stderr


def _script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})


def _refused(out: subprocess.CompletedProcess, *words: str) -> str:
    assert out.returncode != 0, out.stdout[-2000:]
    text = _one_sentence(out.stderr)
    assert all(w in text for w in words), text
    return text


SUMMARY = REPO / "docs" / "results" / "summary.json"  # toy-full's, as `jagg report --copy-to docs/results` wrote it


def _page_inputs(tmp_path: Path) -> dict[str, Path]:
    """toy-full's summary and variants of it, and report READMEs of toy-full and of ci (their first line)."""
    s = json.loads(SUMMARY.read_text())
    files = {"toy-full": SUMMARY}
    (tmp_path / "cut.json").write_text(SUMMARY.read_text()[:3000])
    files["cut"] = tmp_path / "cut.json"
    (tmp_path / "ci.json").write_text(json.dumps({**s, "profile": "ci"}))
    files["ci"] = tmp_path / "ci.json"
    no_jagg = {**s, "final": [r for r in s["final"] if r["method"] != "jagg"],
               "paired": [p for p in s["paired"] if "jagg" not in (p["a"], p["b"])]}
    (tmp_path / "no-jagg.json").write_text(json.dumps(no_jagg))
    files["no-jagg"] = tmp_path / "no-jagg.json"
    for profile in ("toy-full", "ci"):
        (tmp_path / f"{profile}.md").write_text(f"# jagg report — profile `{profile}`\n\nThe report's tables.\n")
        files[f"{profile}.md"] = tmp_path / f"{profile}.md"
    return files


@pytest.mark.parametrize("summary, report, words", [
    ("missing", "toy-full.md", ["does not exist", "jagg report --profile toy-full"]),
    ("cut", "toy-full.md", ["is not whole JSON"]),
    ("ci", "ci.md", ["profile 'ci'", "toy-full"]),
    ("no-jagg", "toy-full.md", ["has no jagg result"]),
    ("toy-full", "ci.md", ["report of profile 'ci'", "toy-full's"]),
])
def test_m6_results_page_refuses_a_summary_or_report_it_cannot_write_from(tmp_path, summary, report, words):
    """scripts/results_page.py: a missing, cut or ci summary and one without jagg ended in tracebacks
    (FileNotFoundError, JSONDecodeError, KeyError); toy-full's summary with ci's README wrote a mixed page, rc 0. Now
    one sentence, exit 1, and no page written."""
    files = _page_inputs(tmp_path)
    page = tmp_path / "results.md"
    out = _script("results_page.py", "--summary", str(files.get(summary, tmp_path / "none.json")), "--report",
                  str(files[report]), "--wall", "1 min", "--date", "2026-01-01", "--commit", "abc", "--out", str(page),
                  cwd=tmp_path)
    _refused(out, *words)
    assert not page.exists()


def test_m6_results_page_still_writes_toy_full_s_page(tmp_path):
    files = _page_inputs(tmp_path)
    page = tmp_path / "results.md"
    out = _script("results_page.py", "--summary", str(files["toy-full"]), "--report", str(files["toy-full.md"]),
                  "--wall", "1 min", "--date", "2026-01-01", "--commit", "abc", "--out", str(page), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "**The verdict.**" in page.read_text() and "The report's tables." in page.read_text()


def _study():
    """scripts/jagg_fidelity_study.py as a module (in this process: torch is imported once)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("jagg_fidelity_study", REPO / "scripts" / "jagg_fidelity_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _refused_by_study(capsys, *args: str) -> str:
    assert _study().main(list(args)) == 1
    return _one_sentence(capsys.readouterr().err)


def test_m6_fidelity_study_summarise_only_on_an_empty_folder_is_one_sentence(tmp_path, capsys):
    """`scripts/jagg_fidelity_study.py --summarise-only` on an empty folder was "ValueError: min() arg is an empty
    sequence" (a traceback). Now one sentence, exit 1, nothing written."""
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no readings to summarise" in _refused_by_study(capsys, "--summarise-only", "--out", str(empty))
    assert list(empty.iterdir()) == []


def test_m6_fidelity_study_a_cut_readings_file_is_one_sentence(tmp_path, capsys):
    """A readings.jsonl cut in its second line was a JSONDecodeError traceback. Now one sentence naming the line, exit
    1, the file as it was and no summary written."""
    cut = tmp_path / "cut"
    cut.mkdir()
    readings = (REPO / "docs" / "jagg_fidelity" / "readings.jsonl").read_text()
    text = readings[: len(readings.splitlines()[0]) * 3 // 2]
    (cut / "readings.jsonl").write_text(text)
    said = _refused_by_study(capsys, "--summarise-only", "--out", str(cut))
    assert "readings.jsonl line 2 is not a whole reading" in said
    assert sorted(p.name for p in cut.iterdir()) == ["readings.jsonl"] and (cut / "readings.jsonl").read_text() == text


def test_m6_fidelity_study_a_model_name_with_dot_dot_is_one_sentence(tmp_path, capsys):
    """`--models 'jagg-s0/../x'` loaded the toy model, then ended in FileNotFoundError (a traceback) for the folder
    the name led to. Now the name is refused as a run name before anything is loaded or written."""
    fresh, work = tmp_path / "fresh", tmp_path / "work"
    said = _refused_by_study(capsys, "--models", "base,jagg-s0/../x", "--out", str(fresh), "--work", str(work))
    assert "'jagg-s0/../x' is not a run name" in said
    assert not fresh.exists() and not work.exists()


# --- mechanism 7: small things a user sees ----------------------------------------------------------------------------


def _umask() -> int:
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_m7_checkpoint_folders_have_the_permissions_of_their_files(tmp_path):
    """A checkpoint's folder was 0700 (``mkdtemp``'s) while its files were 0644: another user allowed to read the files
    could not open the folder. Now a folder gets what any folder the process makes gets (0755 under umask 022)."""
    import stat

    import torch

    from jagg_core.trainer.checkpoint import save_checkpoint

    ckpt = save_checkpoint(tmp_path / "ckpts", 1, trainable={"w": torch.zeros(2)}, optimizer=None,
                           state={"run_key": "k"})
    mask = _umask()
    assert stat.S_IMODE(ckpt.path.stat().st_mode) == 0o777 & ~mask
    assert {stat.S_IMODE(f.stat().st_mode) for f in ckpt.path.iterdir()} == {0o666 & ~mask}


def test_m7_the_base_model_folder_has_the_permissions_of_its_files(ci_base):
    """`jagg pretrain`'s models/<profile>/base was 0700 with 0644 files inside (as a checkpoint's)."""
    import stat

    base = ci_base / "models" / "ci" / "base"
    mask = _umask()
    assert stat.S_IMODE(base.stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE((base / "card.json").stat().st_mode) == 0o666 & ~mask


def _tracker(root: Path):
    """A real MLflow store (SQLite) under ``root`` and the ci profile's params and layout."""
    from jagg_core.pipeline.tracking import Tracker
    from jagg_core.setup.paths import Layout

    params = load_params(PARAMS, "ci")
    return Tracker(params, root), params, Layout.of(params, root)


def test_m7_a_damaged_pending_buffer_line_is_reported_once(tmp_path, caplog):
    """The launcher's replay of a run's pending buffer read it twice (how many records wait, then sending them) and
    printed "line 2 is not a whole record" twice for one cut line."""
    import logging

    from tasks.train import _replay_pending, pending_file

    tracker, _, lay = _tracker(tmp_path)
    run_id = tracker.child_run("default", "jagg-s0", method="jagg", seed=0, key="k")
    buffer = pending_file(lay, "jagg-s0")
    buffer.parent.mkdir(parents=True, exist_ok=True)
    record = {"kind": "metrics", "run_id": run_id, "step": 1, "time": 1, "metrics": {"reward/mean": 0.5}}
    buffer.write_text(json.dumps(record) + "\n" + json.dumps(record)[:20] + "\n")
    with caplog.at_level(logging.WARNING):
        _replay_pending(tracker, run_id, lay, "jagg-s0", logging.getLogger("jagg.train"))
    said = [r.getMessage() for r in caplog.records if "not a whole record" in r.getMessage()]
    assert len(said) == 1, said
    assert not buffer.exists()
    assert [m.value for m in tracker.client.get_metric_history(run_id, "reward/mean")] == [0.5]
    tracker.finish(run_id)


_ACCELERATE = """
import os, signal, subprocess, sys
# as accelerate's simple_launcher: its one worker (here, one that is SIGKILLed) run with check, the error re-raised
cmd = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "--worker-context",
       "/tmp/x/runs/ci/jagg-s0/.worker-context-1.json"]
process = subprocess.Popen(cmd)
process.wait()
raise subprocess.CalledProcessError(returncode=process.returncode, cmd=cmd)
"""


def test_m7_a_sigkilled_worker_is_one_plain_sentence():
    """A SIGKILLed worker's failure relayed accelerate's last line, "subprocess.CalledProcessError: Command '[…the
    worker's whole command…]' died with <Signals.SIGKILL: 9>.". Now the sentence says which signal, what it usually
    means and what a rerun does; it is still a death (retried), and the command line is not in it."""
    from collections import deque

    from tasks.train import WorkerDied, _failure

    out = subprocess.run([sys.executable, "-c", _ACCELERATE], capture_output=True, text=True, timeout=60)
    tail = deque(out.stderr.splitlines(), maxlen=30)
    assert out.returncode == 1 and "CalledProcessError" in tail[-1], out.stderr  # what accelerate leaves
    failure = _failure("jagg-s0", out.returncode, tail)
    assert isinstance(failure, WorkerDied)
    text = _one_sentence(str(failure))
    assert "SIGKILL" in text and "out of memory" in text and "resumes from its last complete checkpoint" in text, text
    assert "CalledProcessError" not in text and "worker-context" not in text and "Command" not in text, text
    # torchrun's report of several processes, and a worker that exited with a status of its own
    elastic = deque(["  exitcode  : -9 (pid: 4242)", "  error_file: <N/A>",
                     "  traceback : Signal 9 (SIGKILL) received by PID 4242", "=" * 60])
    assert "killed by SIGKILL" in str(_failure("jagg-s0", 1, elastic))
    exited = deque(["subprocess.CalledProcessError: Command '['python', '-m', 'tasks.train']' returned non-zero exit "
                    "status 3."])
    assert "exited with status 3" in str(_failure("jagg-s0", 1, exited))


def test_m7_a_sweep_without_the_baseline_says_why_there_is_no_speedup(tmp_path):
    """`jagg run` of methods without the exact baseline ended with "update speedup vs the exact baseline, every method
    timed side by side: " and nothing after it. Now it says there is no baseline and gives the seconds it has."""
    from flows.run import _speed_line
    from jagg_core.bench.side_by_side import speed_rows
    from jagg_core.setup.paths import Layout
    from jagg_core.setup.provenance import fingerprint, speed_made_from

    def measured(params, result):  # speed.json as the speed stage writes it: what it timed, and its fingerprint
        made = speed_made_from(params, list(result["methods"]))
        lay.speed.write_text(json.dumps({**result, "table": speed_rows(result), "made_from": made,
                                         "fingerprint": fingerprint(made)}))

    params = load_params(PARAMS, "ci", {"run.methods": ["jagg", "ablate"]})
    lay = Layout.of(params, tmp_path)
    counts = {"grad_forwards": 2, "nograd_forwards": 2, "reused_velocities": 0}
    timed = {"update": {"median": 0.25, "q1": 0.2, "q3": 0.3}, "counts": counts}
    result = {"methods": {"jagg": {**timed, "mode": "jagg"}, "ablate": {**timed, "mode": "ablate"}}}
    lay.speed.parent.mkdir(parents=True, exist_ok=True)
    measured(params, result)
    line = _one_sentence(_speed_line(params, lay))
    assert "no exact baseline" in line and "jagg 0.250 s" in line and not line.endswith(": "), line
    result["methods"]["baseline"] = {**timed, "mode": "exact"}
    params = load_params(PARAMS, "ci", {"run.methods": ["baseline", "jagg", "ablate"]})
    measured(params, result)
    assert "jagg 1.00x" in _speed_line(params, lay)  # with it, the speedups as before
