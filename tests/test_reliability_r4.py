"""Reliability, round 4 (issue 34): what a hostile tester broke, fixed by class.

Cheap probes are batched into parametrised tests that call the library in-process (no training is launched where a
unit-level test shows the fix); real-signal and live-server ones are marked ``slow``. The rows of
docs/reliability.md's "Round 4" section name these tests.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import yaml

from jagg_core.setup.config import ParamsError
from jagg_core.setup.params_io import load_params, parse_yaml

REPO = Path(__file__).resolve().parents[1]
PARAMS = REPO / "params.yaml"


def _one_sentence(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and "Traceback" not in text and len(text) < 600, text
    return text


# --- items 1, 2, 4, 6, 12, 14, 18: one typed, bounded reading of every value ------------------------------------

_BIG = "x" * 2_000_000


@pytest.mark.parametrize("overrides, says", [
    # 1: an anchored string counts by its size, each time an alias copies it
    ({"model.options": yaml.safe_load("{big: &s '" + "x" * 20_000 + "', l1: &l1 [" + ", ".join(["*s"] * 100) +
                                      "], l2: [" + ", ".join(["*l1"] * 100) + "]}")}, "expands to more than"),
    # 2 (regression): numbers written as strings are read as numbers, and must be finite
    ({"model.options.guidance_scale": "1e400"}, "model.options.guidance_scale = '1e400'"),
    ({"model.options.guidance_scale": "nan"}, "finite number"),
    ({"reward.options.toy_fidelity.tau": "-inf"}, "finite number"),
    # 4: option values are typed, against what the backbone / reward takes
    ({"model.options.guidance_scale": "abc"}, "model.options.guidance_scale = 'abc' is invalid"),
    ({"model.options.guidance_scale": [3]}, "model.options.guidance_scale"),
    ({"model.options.height": 64}, "'toy-flux' has no option 'height'"),
    ({"reward.options.toy_fidelity.tau": "abc"}, "reward.options.toy_fidelity.tau = 'abc'"),
    ({"reward.options.toy_fidelity.tau": [100]}, "reward.options.toy_fidelity.tau = [100]"),
    ({"reward.options.toy_fidelity.tau": True}, "reward.options.toy_fidelity.tau"),
    ({"reward.options.jpeg_compressibility.quality": 9.5}, "reward.options.jpeg_compressibility.quality"),
    ({"reward.options.toy_preference.sigma": -1}, "reward.options.toy_preference.sigma"),
    ({"reward.options.toy_fidelity": [1]}, "reward.options.toy_fidelity"),
    ({"model.options.lora": {"rank": "abc"}}, "model.options.lora.rank = 'abc'"),  # a dict inside the options
    ({"reward.weights": {"toy_fidelity": "nan"}}, "finite number"),
    # 6: seeds are not negative
    ({"run.seeds": [-1]}, "run.seeds.0 = -1"),
    ({"world.seed": -1}, "world.seed = -1"),
    ({"eval.seed": -3}, "eval.seed = -3"),
    ({"pretrain.seed": -1}, "pretrain.seed = -1"),
    # 12: a format spec in the experiment name would allocate 100 GB to validate it
    ({"tracking.experiment": "{profile:>99999999999}"}, "without a format spec"),
    ({"tracking.experiment": "x-{profile!r}"}, "without a format spec"),
    ({"tracking.experiment": "a\nb"}, "printable"),
    # 14: names the pattern allowed but MLflow or the file system refuse
    ({"methods": {"jagg\n": {"mode": "jagg"}}, "run.methods": ["jagg\n"]}, "method name 'jagg\\n'"),
    ({"methods": {"m" * 300: {"mode": "jagg"}}, "run.methods": ["m" * 300]}, "at most 64"),
    ({"outputs": "o" * 300}, "outputs ="),
    ({"outputs": "a\n"}, "outputs ="),
    # 18: sizes bounded before anything is allocated
    ({"sample.group_size": 100_000_000}, "sample.group_size"),
    ({"sample.group_size": "1e8"}, "sample.group_size"),
    ({"sample.prompts_per_iteration": 10 ** 9}, "sample.prompts_per_iteration"),
    ({"world.n_train": 10 ** 12}, "world.n_train"),
    ({"sample.sde_window_range": [0, 10 ** 30]}, "sample.sde_window_range"),
])
def test_every_value_is_read_typed_and_bounded(overrides, says):
    with pytest.raises(ParamsError) as e:
        load_params(PARAMS, "ci", overrides)
    assert says in _one_sentence(e.value), e.value


def test_an_anchored_string_bomb_in_a_params_file_is_refused(tmp_path):
    """Item 1 as reported: the bomb in the params file itself (10 MB × 1000 × 500 to serialise before)."""
    bomb = ("options: {big: &s '" + "x" * 1_000_000 + "', l1: &l1 [" + ", ".join(["*s"] * 1000) + "], l2: [" +
            ", ".join(["*l1"] * 500) + "]}")
    text = PARAMS.read_text().replace("options: {}", bomb, 1)  # model.options, the first of the file
    assert bomb in text
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(ParamsError) as e:
        load_params(tmp_path / "params.yaml", "ci")
    assert "expands to more than" in _one_sentence(e.value)


def test_typed_options_keep_what_is_valid_and_read_numeric_strings_as_numbers():
    p = load_params(PARAMS, "ci", {"model.options.guidance_scale": "3e0", "reward.options.toy_fidelity.tau": "1e2"})
    assert p.model.options == {"guidance_scale": 3.0} and p.reward.options == {"toy_fidelity": {"tau": 100.0}}
    for profile in ("flux", "sd3", "qwenimage", "wan"):  # every shipped profile's options still read
        load_params(PARAMS, profile)


def test_option_schemas_agree_with_the_backbones_and_the_rewards():
    import inspect

    from jagg_core.setup.registry import backbone_names, backbone_spec, reward_names, reward_spec

    for backbone in backbone_names():
        spec = backbone_spec(backbone)
        if spec.defaults:  # a diffusers backbone: its schema is its DEFAULTS' keys
            assert set(spec.options) == set(spec.defaults), backbone
    assert set(backbone_spec("toy-flux").options) == {"lora", "guidance_scale"}  # policies/toy_flux.py:load_toy_flux
    for name in reward_names():
        spec = reward_spec(name)
        assert set(spec.options) == set(inspect.signature(spec.factory).parameters), name


@pytest.mark.parametrize("value, says", [
    ("9" * 5000, "--set x holds a value YAML cannot read"),  # 12 (regression): PyYAML's int of 5000 digits
    ("!!binary /w==", "--set x holds a"),  # 12: bytes that are not UTF-8
    ("!!binary aGVsbG8=", "bytes value"),  # bytes at all: not a param
    ("!!set {a, b}", "set value"),  # 4: YAML features a worker crashed on
    ("2001-12-14", "date value"),
    ("2001-12-14t21:59:43.10-05:00", "datetime value"),
    ("[&s '" + "y" * 600_000 + "', *s]", "expands to more than"),  # 1: an aliased string counts twice
])
def test_parse_level_values_are_one_sentence(value, says):
    with pytest.raises(ParamsError) as e:
        parse_yaml(value, "--set x")
    assert says in _one_sentence(e.value)


def test_a_long_set_value_is_refused_before_it_is_parsed():
    from tasks.common import parse_overrides

    with pytest.raises(ParamsError) as e:
        parse_overrides(["model.options.guidance_scale=" + "9" * 100_000])
    assert "characters long" in _one_sentence(e.value)


@pytest.mark.parametrize("kind", ["dev-zero", "dev-urandom", "fifo"])
def test_params_on_a_file_that_is_not_regular_is_refused_at_once(kind, tmp_path):
    path = {"dev-zero": Path("/dev/zero"), "dev-urandom": Path("/dev/urandom"), "fifo": tmp_path / "fifo"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    with pytest.raises(ParamsError) as e:
        load_params(path)
    assert "not a regular file" in _one_sentence(e.value)


# --- item 8: no silent defaults ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text, profile, says", [
    ("profile: ci\n", None, "holds no sections"),
    ("", None, "is empty"),
    ("# nothing but a comment\n", None, "is empty"),
    (None, "", "--profile is empty"),
    (None, " ", "--profile is empty"),
])
def test_no_silent_defaults(text, profile, says, tmp_path):
    path = tmp_path / "params.yaml"
    if text is None:
        shutil.copy(PARAMS, path)
    else:
        path.write_text(text)
    with pytest.raises(ParamsError) as e:
        load_params(path, profile)
    assert says in _one_sentence(e.value)


# --- item 3 (regression): retries only where a retry can help --------------------------------------------------


class _State:
    def __init__(self, exc: BaseException):
        self.exc = exc

    def result(self, raise_on_failure: bool = True):
        raise self.exc


def _errors():
    from jagg_core.evaluation.evaluate import EvalError
    from jagg_core.rewards import RewardError
    from jagg_core.trainer.checkpoint import CheckpointError

    from tasks.train import TrainingError

    return [TypeError("tau"), RewardError("tau=200"), PermissionError(13, "read-only"), CheckpointError("[]"),
            MemoryError(), EvalError("x"), TrainingError("x"), ParamsError("x")]


@pytest.mark.parametrize("task", ["flows.stages:train_task", "flows.stages:evaluate_task",
                                  "flows.stages:pretrain_task"])
def test_no_task_retries_an_error_that_cannot_succeed(task):
    import importlib

    from tasks.train import WorkerDied

    module, _, name = task.partition(":")
    prefect_task = getattr(importlib.import_module(module), name)
    condition = prefect_task.retry_condition_fn
    assert condition is not None, f"{task} retries every error"
    for exc in _errors():
        assert condition(prefect_task, None, _State(exc)) is False, exc
    assert condition(prefect_task, None, _State(WorkerDied("killed"))) is True


def test_a_workers_python_error_reaches_its_launcher_as_an_error_not_a_death(capsys):
    from collections import deque

    from tasks.launch import report_error_class
    from tasks.train import WorkerDied, _failure

    with pytest.raises(TypeError):
        with report_error_class():
            raise TypeError("unsupported operand type(s) for -: 'str' and 'float'")
    tail = deque(["Traceback (most recent call last):", *capsys.readouterr().err.splitlines(),
                  "subprocess.CalledProcessError: Command '[...]' returned non-zero exit status 1."])
    failure = _failure("jagg-s0", 1, tail)
    assert not isinstance(failure, WorkerDied) and "TypeError" in str(failure)
    assert isinstance(_failure("jagg-s0", -9, deque(["Killed"])), WorkerDied)  # a death is still retried


# --- item 10 (regression for `jagg train` + SIGTERM): no MLflow run left RUNNING ---------------------------------


def _tracker(tmp_path):
    from jagg_core.pipeline.tracking import Tracker

    params = load_params(PARAMS, "ci", {"tracking.mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db"})
    return Tracker(params, tmp_path)


def _statuses(tracker) -> dict[str, str]:
    runs = tracker.client.search_runs([tracker.experiment_id])
    return {r.data.tags.get("jagg.run", r.data.tags.get("jagg.kind")): r.info.status for r in runs}


def test_every_mlflow_run_a_command_opens_ends_whatever_ends_it(tmp_path, monkeypatch):
    from jagg_core.pipeline.tracking import Tracker

    from tasks.launch import Interrupted

    tracker = _tracker(tmp_path)
    for run, exc, status in (("a", Interrupted(15), "KILLED"), ("b", KeyboardInterrupt(), "KILLED"),
                             ("c", RuntimeError("x"), "FAILED")):
        run_id = tracker.child_run("s", run, method=None, seed=None, key=run)
        with pytest.raises(type(exc)):
            with tracker.ending(run_id):
                raise exc
        assert _statuses(tracker)[run] == status
    # a signal while the new run's params are logged, before its id reaches the caller
    monkeypatch.setattr(Tracker, "log_params", lambda self, run_id, tree: (_ for _ in ()).throw(Interrupted(15)))
    with pytest.raises(Interrupted):
        tracker.child_run("s", "d", method=None, seed=None, key="d")
    monkeypatch.undo()
    statuses = _statuses(tracker)
    assert statuses["d"] == "KILLED" and statuses["sweep"] == "FINISHED"  # a sweep's run is never left RUNNING
    # a training run evaluated afterwards keeps its own status when the evaluation fails
    run_id = tracker.child_run("s", "e", method=None, seed=None, key="e")
    tracker.finish(run_id)
    with pytest.raises(ValueError):
        with tracker.ending(run_id, only_running=True):
            raise ValueError("x")
    assert _statuses(tracker)["e"] == "FINISHED"


def test_evaluate_ends_its_run_failed_on_any_error(ci_project, monkeypatch):
    import jagg_core.evaluation.evaluate as ev

    from jagg_core.pipeline.tracking import Tracker
    from tasks.common import layout
    from tasks.evaluate import evaluate

    params = load_params(ci_project / "params.yaml", "ci")
    monkeypatch.setattr(ev, "evaluate_run", lambda *a, **k: (_ for _ in ()).throw(TypeError("after generation")))
    with pytest.raises(TypeError):
        evaluate(params, layout(params, ci_project), "base")
    assert _statuses(Tracker(params, ci_project))["base"] == "FAILED"


@pytest.mark.slow
def test_sigterm_right_after_jagg_train_creates_its_run_marks_it_killed(ci_project):
    """The regression of item 10: a real SIGTERM in the half second after the run is created (a fault point there)."""
    from conftest import run_module

    from jagg_core.pipeline.tracking import Tracker

    env = {"JAGG_FAULT": "run_created:term"}
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--seed", "0", root=ci_project, env=env,
                     timeout=300)
    assert out.returncode == 143, out.stderr[-2000:]
    params = load_params(ci_project / "params.yaml", "ci")
    assert _statuses(Tracker(params, ci_project))["jagg-s0"] == "KILLED"


# --- item 5: a damaged curve does not resume silently ----------------------------------------------------------


@pytest.mark.parametrize("damage, says", [
    ("truncate", "lacks iteration(s) 3, 4"),
    ("delete", "does not exist"),
    ("twice", "twice"),
])
def test_a_damaged_curve_refuses_resume_with_one_sentence(damage, says, tmp_path):
    from jagg_core.trainer.curve import TsvCurve
    from jagg_core.trainer.errors import TrainingError

    curve = tmp_path / "curve.tsv"
    rows = "".join(f"{i}\t0.{i}\n" for i in range(1, 5))
    curve.write_text("iteration\treward/mean\n" + {"truncate": "1\t0.1\n2\t0.2\n", "delete": "",
                                                    "twice": rows + "2\t0.2\n"}[damage] if damage != "twice" else
                     "iteration\treward/mean\n1\t0.1\n2\t0.2\n2\t0.2\n3\t0.3\n4\t0.4\n")
    if damage == "delete":
        curve.unlink()
    with pytest.raises(TrainingError) as e:
        TsvCurve(curve, resume_from=4)
    text = _one_sentence(e.value)
    assert says in text and "--restart" in text
    curve.write_text("iteration\treward/mean\n" + rows + "5\t0.5\n")  # rows after the checkpoint: dropped, as before
    assert [r["iteration"] for r in TsvCurve(curve, resume_from=4).rows] == [1, 2, 3, 4]
    assert TsvCurve(tmp_path / "new.tsv", resume_from=0).rows == []  # a fresh run needs none


# --- item 9: a checkpoint's manifest lists and proves every file ------------------------------------------------


def _checkpoints(root: Path):
    import torch

    from jagg_core.trainer.checkpoint import save_checkpoint

    for it in (1, 2):
        save_checkpoint(root, it, trainable={"w": torch.full((4, 4), float(it))}, optimizer={"step": it},
                        state={"run_key": "k"}, keep=4)
    return root / "checkpoint-000002"


def _rematch(ckpt: Path, drop: str | None = None) -> None:
    """Rewrite the manifest to match the folder as it is now (an attacker's or a bug's matching manifest)."""
    import json

    from jagg_core.trainer.checkpoint import file_sha256

    manifest = {}
    for p in sorted(ckpt.iterdir()):
        if p.name in ("manifest.json", drop):
            continue
        manifest[p.name] = {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _damage(ckpt: Path, how: str) -> None:
    import torch
    from safetensors.torch import save

    w = ckpt / "trainable.safetensors"
    if how == "list":
        (ckpt / "manifest.json").write_text("[]")
    elif how == "empty":
        (ckpt / "manifest.json").write_text("{}")
    elif how == "no-weights-entry":
        w.write_bytes(save({"w": torch.full((4, 4), 7.0)}))
        _rematch(ckpt, drop="trainable.safetensors")
    elif how == "huge-header":
        w.write_bytes((2 ** 62).to_bytes(8, "little") + b"{}")
        _rematch(ckpt)
    elif how == "symlink-passwd":
        w.unlink()
        w.symlink_to("/etc/passwd")
        _rematch(ckpt)
    elif how == "nan-weights":
        w.write_bytes(save({"w": torch.full((4, 4), float("nan"))}))
        _rematch(ckpt)
    elif how == "unlisted-file":
        (ckpt / "extra.bin").write_bytes(b"x")
    elif how == "entry-without-digest":
        import json

        (ckpt / "manifest.json").write_text(json.dumps({"state.json": {}, "trainable.safetensors": {}}))
    elif how == "dev-zero":  # a listed entry that is a symlink to /dev/zero (size 0 by stat): hashing never ended
        import hashlib
        import json

        o = ckpt / "optimizer.pt"
        o.unlink()
        o.symlink_to("/dev/zero")
        manifest = json.loads((ckpt / "manifest.json").read_text())
        manifest["optimizer.pt"] = {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}
        (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("how", ["list", "empty", "no-weights-entry", "huge-header", "symlink-passwd", "nan-weights",
                                 "unlisted-file", "entry-without-digest", "dev-zero"])
def test_a_checkpoint_whose_manifest_does_not_prove_it_is_skipped_and_resume_falls_back(how, tmp_path):
    from jagg_core.trainer.checkpoint import latest_checkpoint, verify_checkpoint

    ckpt = _checkpoints(tmp_path / "ckpts")
    assert verify_checkpoint(ckpt) is None
    _damage(ckpt, how)
    problem = verify_checkpoint(ckpt)
    assert problem, how
    assert "\n" not in problem
    assert latest_checkpoint(tmp_path / "ckpts").iteration == 1  # the previous one, never a traceback


# --- item 11: content digests, not mtimes -------------------------------------------------------------------------


def test_the_base_models_digest_is_its_content_not_its_file_times(tmp_path, monkeypatch):
    from jagg_core.setup.storage import folder_digest

    monkeypatch.setenv("JAGG_DIGEST_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "a.safetensors").write_bytes(b"a" * 100)
    (model / "config.json").write_text("{}")
    for limit in (1 << 30, 10):  # hashed as one stream, and file by file (a large model)
        before = folder_digest(model, content_limit=limit)
        os.utime(model / "a.safetensors", (1, 1))  # `touch`
        assert folder_digest(model, content_limit=limit) == before
        (model / "a.safetensors").write_bytes(b"b" * 100)  # same size, other content, then the old time again
        os.utime(model / "a.safetensors", (1, 1))
        assert folder_digest(model, content_limit=limit) != before
        (model / "a.safetensors").write_bytes(b"a" * 100)


# --- item 7: the services' pid file is checked against the process it names ------------------------------------


def test_services_never_signal_a_process_that_took_over_their_pid(tmp_path, monkeypatch, capsys):
    import json
    import subprocess
    import sys

    import tasks.services as services

    monkeypatch.setattr(services, "STATE", tmp_path)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        for record in ({"pid": stranger.pid, "started": 12345.0}, stranger.pid):  # stale, and the old format
            (tmp_path / "pids.json").write_text(json.dumps({"server": record}))
            assert services.main(["status"]) == 0
            assert "running" not in capsys.readouterr().out
            services.down()
            assert stranger.poll() is None, "down signalled a stranger"
        # a service of ours (its start time recorded) is still stopped
        ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        services._write_pids({"server": ours.pid})
        services.main(["status"])
        assert "running" in capsys.readouterr().out
        services.down()
        assert ours.wait(timeout=20) is not None
    finally:
        stranger.kill()
        stranger.wait()


# --- item 13: redaction of '@' in passwords and of token-only userinfo -----------------------------------------


@pytest.mark.parametrize("text, secret", [
    ("postgresql://admin:p@ss@db:5432/mlflow", "ss@db"),
    ("postgresql://admin:p@ss@db:5432/mlflow", "p@ss"),
    ("http://ghp_TOKEN1234@github.com/x", "ghp_TOKEN1234"),
    ("https://u:s3cr@t@h:5000/ and later s3cr@t alone", "s3cr@t"),
])
def test_credentials_with_an_at_sign_or_a_token_alone_are_redacted(text, secret):
    from jagg_core.setup.redact import redact

    shown = redact({"tracking": {"mlflow_uri": text}})["tracking"]["mlflow_uri"]
    assert secret not in shown and "***" in shown
    assert redact("sqlite:///mlflow.db") == "sqlite:///mlflow.db" and redact("http://h/a@b") == "http://h/a@b"


# --- item 15: the report on damaged or missing evaluation files ------------------------------------------------


@pytest.mark.parametrize("damage, says", [
    ("metrics-garbage", "cannot be read as JSON"),
    ("metrics-list", "does not hold an evaluation's metrics"),
    ("metrics-nan", "does not hold an evaluation's metrics"),
    ("curve-garbage", "is not a row of numbers"),
    ("curve-binary", "cannot be read as a curve"),
    ("nothing", "nothing to report"),
])
def test_the_report_on_damaged_or_missing_files_is_one_sentence(damage, says, tmp_path):
    import json

    from jagg_core.setup.paths import Layout
    from jagg_core.pipeline.report import build_report

    params = load_params(PARAMS, "toy", {"profile": "rep", "run.methods": ["jagg"], "eval.metrics": ["toy_fidelity"]})
    lay = Layout(tmp_path, "rep")
    mf = lay.eval_dir("jagg-s0") / "metrics.json"
    curve = lay.curve("jagg-s0")
    mf.parent.mkdir(parents=True)
    curve.parent.mkdir(parents=True)
    mf.write_text(json.dumps({"metrics": {"toy_fidelity": {"benchmark": 0.5}}}))
    curve.write_text("iteration\treward/mean\n1\t0.5\n")
    if damage == "metrics-garbage":
        mf.write_bytes(b"\xff{not json")
    elif damage == "metrics-list":
        mf.write_text("[]")
    elif damage == "metrics-nan":
        mf.write_text('{"metrics": {"toy_fidelity": {"benchmark": NaN}}}')
    elif damage == "curve-garbage":
        curve.write_text("iteration\treward/mean\n1\tgarbage\n")
    elif damage == "curve-binary":
        curve.write_bytes(b"\xff\xfe\x00")
    elif damage == "nothing":
        mf.unlink()
    from jagg_core.pipeline.report import ReportError

    with pytest.raises(ReportError) as e:
        build_report(params, lay)
    assert says in _one_sentence(e.value)


# --- item 16: test prompts outside the toy grammar, before any image is generated ------------------------------


@pytest.mark.parametrize("prompt", ["a cat riding a bicycle", "x" * 10_000_000])
def test_a_test_prompt_outside_the_toy_grammar_is_one_short_sentence(prompt, tmp_path):
    import json

    from jagg_core.evaluation.evaluate import EvalError, test_prompts
    from jagg_core.setup.paths import Layout

    params = load_params(PARAMS, "ci")
    lay = Layout(tmp_path, "ci")
    bench = lay.prompts / "benchmark"
    bench.mkdir(parents=True)
    (bench / "anime.json").write_text(json.dumps([prompt]))
    with pytest.raises(EvalError) as e:
        test_prompts(params, lay)
    text = _one_sentence(e.value)
    assert "toy world's grammar" in text and "anime.json: prompt 0" in text


def test_a_test_list_prompt_outside_the_toy_grammar_names_the_test_list(tmp_path):
    """eval.protocol hpdv2-test reads test.json: its sentence names that file, not a benchmark style's."""
    import json

    from jagg_core.evaluation.evaluate import EvalError, test_prompts
    from jagg_core.setup.paths import Layout

    params = load_params(PARAMS, "ci", {"eval.protocol": "hpdv2-test"})
    lay = Layout(tmp_path, "ci")
    lay.prompts.mkdir(parents=True)
    (lay.prompts / "test.json").write_text(json.dumps([{"prompt": "a red circle"}, {"prompt": "a cat on a mat"}]))
    with pytest.raises(EvalError) as e:
        test_prompts(params, lay)
    text = _one_sentence(e.value)
    assert f"{lay.prompts / 'test.json'}: prompt 1 'a cat on a mat'" in text and "benchmark" not in text


# --- item 17: export cleans up after itself -----------------------------------------------------------------------


def test_export_on_a_full_disk_is_one_sentence_and_leaves_nothing(tmp_path):
    from safetensors import SafetensorError

    from jagg_core.pipeline.export import ExportError, export_transformer

    class Full:
        def save_pretrained(self, folder, **kwargs):
            Path(folder).mkdir(parents=True)
            (Path(folder) / "part.safetensors").write_bytes(b"x")
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    with pytest.raises(ExportError) as e:
        export_transformer(Full(), tmp_path / "exports" / "out", backbone="flux", card={})
    assert "nothing was written" in _one_sentence(e.value)
    assert list((tmp_path / "exports").iterdir()) == []


def test_export_removes_what_a_killed_export_left(tmp_path):
    from jagg_core.pipeline.export import export_transformer

    dead = tmp_path / ".tmp-old-999999999-abc"  # a pid no process has
    alive = tmp_path / f".tmp-other-{os.getpid()}-abc"  # an export running now
    dead.mkdir()
    alive.mkdir()

    class Ok:
        def save_pretrained(self, folder, **kwargs):
            Path(folder).mkdir(parents=True)

    export_transformer(Ok(), tmp_path / "out", backbone="flux", card={})
    assert not dead.exists() and alive.exists() and (tmp_path / "out" / "export.json").exists()
