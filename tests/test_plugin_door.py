"""A plugin is held at its door (issue 61, mechanism 4; docs/reliability.md, Round 7): a plugin that exits at import,
a reward name that cannot name a metric, a reward's answer of the wrong shape, dtype or NaN, a metric's NaN in
evaluation and a plugin path DVC would misread are each one sentence naming the plugin. Each test failed on the code
before its fix. In this process, but one `python -m tasks.train` and one in-process ci training."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, run_module
from jagg_core.evaluation.benchmark import score_batch, summarize_scores
from jagg_core.rewards import RewardError, make_metric, make_weighted_reward, register_reward
from jagg_core.rewards import base as reward_base
from jagg_core.setup import registry
from jagg_core.setup.params_io import load_params
from jagg_core.setup.registry import PluginError, RewardSpec, load_plugins

PROMPTS = ["a", "b", "c", "d"]
IMAGES = torch.rand(4, 3, 8, 8)


@pytest.fixture
def forget():
    """Names of test rewards and plugin files to unregister at the end (the registry is process-wide)."""
    names: list[str] = []
    files: list[Path] = []
    yield names, files
    for name in names:
        registry.remove("reward", name)
        for key in [k for k in reward_base._BUILT if k[0] == name]:
            del reward_base._BUILT[key]
    for f in files:
        registry._LOADED.discard(str(f))
        registry._FAILED.pop(str(f), None)


def _plugin(tmp_path: Path, forget, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(source)
    forget[1].append(path)
    return path


def _reward(forget, name: str, answer) -> None:
    """Register the reward ``name`` whose every call returns ``answer(images, prompts)``."""
    forget[0].append(name)
    register_reward(name, options={})(lambda: (lambda images, prompts, metadata: answer(images, prompts)))


# --- a plugin that exits at import ---------------------------------------------------------------------------------


@pytest.mark.parametrize("body, said", [
    ("import sys\nsys.exit(0)\n", "exited while importing (SystemExit(0))"),
    ("raise SystemExit(3)\n", "exited while importing (SystemExit(3))"),
    ("class Halt(BaseException):\n    pass\n\nraise Halt('stop here')\n", "failed to import: Halt: stop here."),
], ids=["sys.exit(0)", "SystemExit(3)", "a BaseException"])
def test_a_plugin_exiting_at_import_is_one_sentence_naming_it(tmp_path, forget, body, said):
    path = _plugin(tmp_path, forget, "quits.py", body)
    with pytest.raises(PluginError) as e:
        load_plugins((path,))
    assert str(e.value).startswith(f"plugin {path} ") and said in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(PluginError, match="plugin .*quits.py"):  # asked for again: the same sentence, not a skip
        load_plugins((path,))


def test_a_plugin_interrupted_at_import_stays_an_interruption_and_is_not_taken_as_loaded(tmp_path, forget, caplog):
    path = _plugin(tmp_path, forget, "interrupted.py", "raise KeyboardInterrupt\n")
    with caplog.at_level(logging.ERROR, logger="jagg_core.setup.registry"):
        with pytest.raises(KeyboardInterrupt):
            load_plugins((path,))
    assert f"interrupted while importing plugin {path}" in caplog.text
    with pytest.raises(KeyboardInterrupt):  # not marked loaded: asked again, it is imported again (was: a silent skip)
        load_plugins((path,))


def test_jagg_train_with_a_plugin_calling_sys_exit_is_one_sentence_and_exit_1(tmp_path):
    root = tmp_path / "project"
    (root / "plugins").mkdir(parents=True)
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    (root / "plugins/exits.py").write_text("import sys\nsys.exit(0)\n")
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--seed", "0",
                     "--set", "plugins=[plugins/exits.py]", root=root, timeout=300)
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])  # was 0, silently, having done nothing
    lines = [x for x in out.stderr.splitlines() if x.startswith("jagg: error:")]
    assert len(lines) == 1 and f"plugin {root / 'plugins/exits.py'} exited while importing" in lines[0], out.stderr
    assert "Traceback" not in out.stderr and not (root / "runs").exists()


# --- reward names ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a/b", "..", "../x", "x\ny", "r" * 300, "Upper", "", " x", "x.", "a..b", ".x"])
def test_a_reward_name_that_cannot_name_a_metric_is_refused_at_registration(name):
    with pytest.raises(PluginError, match=r"reward name .* must match \[a-z0-9\]"):
        registry.add("reward", RewardSpec(name=name, factory=lambda: None))
    assert name not in registry._SPECS["reward"]


def test_a_plugin_file_registering_a_bad_name_is_one_sentence_naming_the_file(tmp_path, forget):
    path = _plugin(tmp_path, forget, "slash.py", "from jagg_core.rewards import register_reward\n\n\n"
                                                  "@register_reward('my/reward')\ndef mine():\n    return None\n")
    with pytest.raises(PluginError) as e:
        load_plugins((path,))
    assert str(e.value) == (f"reward name 'my/reward' of {path} must match [a-z0-9][a-z0-9_-]*, single dots inside in "
                            f"at most 64 characters (it names metric keys, MLflow params and folders); give it such "
                            f"a name.")


def test_good_reward_names_still_register(forget):
    for name in ("door_ok-1", "door.v2.1"):
        _reward(forget, name, lambda images, prompts: (torch.zeros(len(prompts)), {}))
        assert name in registry.reward_names()
    assert "hpsv2.1" in registry.reward_names()  # jagg's own dotted name


# --- a reward's answer ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer, said", [
    (lambda i, p: (torch.zeros(len(p), 1), {}), r"returned 4 scores for a batch of 4 images \(shape \(4, 1\)\)"),
    (lambda i, p: (torch.zeros(len(p) - 1), {}), r"returned 3 scores for a batch of 4 images \(shape \(3,\)\)"),
    (lambda i, p: (torch.tensor(0.5), {}), r"returned 1 scores for a batch of 4 images \(shape \(\)\)"),
    (lambda i, p: (torch.arange(len(p)), {}), r"dtype torch.int64, which jagg refuses rather than converts"),
    (lambda i, p: ([0.0] * len(p), {}), r"returned its scores as a list"),
    (lambda i, p: torch.zeros(len(p)), r"returned a Tensor; a reward returns \(scores, info\)"),
], ids=["(B, 1)", "(B-1,)", "scalar", "int64", "list", "no info"])
def test_a_pointwise_rewards_wrong_answer_is_one_sentence_naming_it(forget, answer, said):
    _reward(forget, "door_shape", answer)
    fn = make_weighted_reward({"door_shape": 1.0})
    with pytest.raises(RewardError, match=said) as e:
        fn(IMAGES, PROMPTS, [{}] * 4)
    assert str(e.value).startswith("reward 'door_shape' (pointwise) ") and "\n" not in str(e.value)
    assert "is registered by" in str(e.value)


def test_a_pointwise_reward_on_clips_is_checked_on_its_frames(forget):
    _reward(forget, "door_shape", lambda images, prompts: (torch.zeros(len(prompts), 1), {}))
    fn = make_weighted_reward({"door_shape": 1.0}, frames="all")
    with pytest.raises(RewardError, match=r"'door_shape' \(pointwise\) returned 12 scores for a batch of 12 images"):
        fn(torch.rand(4, 3, 3, 8, 8), PROMPTS, [{}] * 4)  # 4 clips of 3 frames: 12 images scored


@pytest.mark.parametrize("kind", ["pointwise", "groupwise"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_local_reward_returning_nan_stops_as_a_served_one_does(forget, kind, bad):
    forget[0].append("door_nan")

    def factory():
        def fn(images, prompts, metadata):
            scores = torch.ones(len(prompts))
            scores[-1] = bad
            return scores, {}
        return fn

    register_reward("door_nan", kind=kind, options={})(factory)
    fn = make_weighted_reward({"door_nan": 1.0})
    with pytest.raises(RewardError, match=rf"reward 'door_nan' \({kind}\) gave image \d of a (batch|group) of \d the "
                                          rf"score {bad}, not a finite number; .* as it does for a served reward's"):
        fn(IMAGES, PROMPTS, [{}] * 4, groups=[0, 0, 1, 1])


def test_a_ci_training_whose_reward_answers_nan_fails_instead_of_finishing(ci_project, forget):
    """Before: every update skipped with a warning, FINISHED, checkpoints of the untrained model."""
    from jagg_core.trainer import list_checkpoints, train
    from jagg_core.setup.paths import Layout

    _reward(forget, "door_nan", lambda images, prompts: (torch.full((len(prompts),), float("nan")), {}))
    params = load_params(ci_project / "params.yaml", "ci", {"reward.weights": {"door_nan": 1.0}})
    with pytest.raises(RewardError, match="reward 'door_nan' .* not a finite number"):
        train(params, "jagg", 0, root=ci_project, progress=False)
    ckpts = Layout(ci_project, "ci").checkpoints("jagg-s0")
    assert not ckpts.exists() or not list_checkpoints(ckpts)


# --- a metric's NaN in evaluation -----------------------------------------------------------------------------------


def test_a_metric_returning_nan_in_evaluation_is_one_sentence_naming_it(forget):
    _reward(forget, "door_metric", lambda images, prompts: (torch.tensor([1.0, float("nan")]), {}))
    scores: dict = {"door_metric": {"anime": {}}}
    with pytest.raises(RewardError, match=r"reward 'door_metric' \(pointwise\) gave image 1 .* not a finite number"):
        score_batch(scores, {"door_metric": make_metric("door_metric")}, torch.rand(2, 3, 8, 8), ["a", "b"],
                    "anime", [0, 1])
        summarize_scores({k: {s: [v[i] for i in sorted(v)] for s, v in by.items()} for k, by in scores.items()})


# --- a plugin path in the DVC pipelines -----------------------------------------------------------------------------


def _dvc_root(tmp_path: Path, plugin: str) -> Path:
    """A project whose params name one profile (ci) and the plugin file ``plugin`` (registering nothing)."""
    root = tmp_path / "project"
    (root / "pipelines").mkdir(parents=True)
    shutil.copy(REPO / "pipelines/template.yaml", root / "pipelines/template.yaml")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["profiles"] = {"ci": raw["profiles"]["ci"]}
    raw.update(profile="ci", plugins=[plugin])
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    (root / plugin).write_text("# a plugin that registers nothing\n")
    return root


def test_a_plugin_path_with_a_hash_is_quoted_in_dvc_yaml_and_check_notices_an_unquoted_one(tmp_path, forget,
                                                                                          monkeypatch):
    from tasks.dvc_pipelines import pipelines, stale

    root = _dvc_root(tmp_path, "my #plug.py")
    forget[1].append(root / "my #plug.py")
    monkeypatch.chdir(root)  # plugin paths are the project's
    text = pipelines(root)[Path("dvc.yaml")]  # ci, the active profile: its pipeline is the root's
    stages = yaml.safe_load(text)["stages"]
    assert all("my #plug.py" in body["deps"] for body in stages.values())  # was "my": the plugin was not tracked
    written = root / "dvc.yaml"
    written.write_text(text.replace('"my #plug.py"', "my #plug.py"))  # what the generator wrote before
    assert stale(root) == ["dvc.yaml"]  # was: up to date
    written.write_text(text)
    assert stale(root) == []
