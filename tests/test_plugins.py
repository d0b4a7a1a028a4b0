"""Plugins from outside the repository (issue 44, item 2): files named in a params file's ``plugins:`` and an installed
package's ``jagg.plugins`` entry point.

Fast, in this process: the example reward and backbone (examples/plugins/) named by path load and their options are
read through their schemas; a name clashing with a built-in, a plugin that fails to import, a path outside the
project, a missing file and a file that is not Python are each one sentence. Plugins are imported once per process and
registered process-wide, so every registration made here is removed when this file's tests end.

Slow, through the command line in a copy of the project (no file of jagg_core, tasks or flows changed): the example
backbone (tiny-sana) with the example pointwise reward through train, evaluate, plan, export and report; and one
training on the toy backbone with three rewards from three places: the example groupwise reward by file, the built-in
groupwise ``toy_fidelity_rank`` and a reward installed as a package with a ``jagg.plugins`` entry point (a
``.dist-info`` folder on PYTHONPATH, which ``importlib.metadata`` finds as pip's own: nothing is installed into the
venv).
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_module
from jagg_core.setup import registry
from jagg_core.setup.config import ParamsError
from jagg_core.setup.params_io import load_params

EXAMPLES = REPO / "examples/plugins"
# What this file's plugins register (removed at teardown: tests/test_config.py and others see the built-ins only).
REGISTERED = (("reward", "colorfulness"), ("backbone", "tiny-sana"), ("reward", "plugin_test_broken_after"))

CLASH = '''
from jagg_core.rewards import register_reward


@register_reward("toy_fidelity")  # a built-in's name
def my_fidelity():
    return lambda images, prompts, metadata: (images.mean((1, 2, 3)), {})
'''
BROKEN = '''
import no_such_module_for_jagg_plugin_test  # noqa: F401

from jagg_core.rewards import register_reward


@register_reward("plugin_test_broken_after")  # never reached
def never():
    return None
'''


def _forget(root: Path) -> None:
    """Undo this file's plugin imports: their registrations, and the labels that say a file was imported."""
    from jagg_core.rewards import base as reward_base

    for kind, name in REGISTERED:
        registry.remove(kind, name)
    for key in [k for k in reward_base._BUILT if k[0] in {n for _, n in REGISTERED}]:
        del reward_base._BUILT[key]
    for label in [x for x in registry._LOADED if x.startswith(str(root))]:
        registry._LOADED.discard(label)
        registry._FAILED.pop(label, None)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project folder of its own: params.yaml, the example plugins copied under plugins/, and two bad ones."""
    root = tmp_path_factory.mktemp("plugin_project").resolve()
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    (root / "plugins").mkdir()
    for name in ("colorfulness.py", "tiny_sana.py"):
        shutil.copy(EXAMPLES / name, root / "plugins" / name)
    (root / "plugins/clash.py").write_text(CLASH)
    (root / "plugins/broken.py").write_text(BROKEN)
    (root / "plugins/multiline.py").write_text("raise RuntimeError('the judge is down.\\n  see the log')\n")
    (root / "plugins/notes.txt").write_text("not a module\n")
    yield root
    _forget(root)


@pytest.fixture
def at(project, monkeypatch):
    monkeypatch.chdir(project)  # plugin paths are the project's: every stage runs at its root
    return project


EXAMPLE = {"plugins": ["plugins/colorfulness.py", "plugins/tiny_sana.py"], "model.backbone": "tiny-sana",
           "model.options": {"height": 32, "width": 32}, "reward.weights": {"colorfulness": 1.0},
           "eval.metrics": ["colorfulness"]}


def sentence(overrides: dict) -> str:
    with pytest.raises(ParamsError) as e:
        load_params("params.yaml", "ci", {**EXAMPLE, **overrides})
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg and msg.endswith("."), msg
    return msg


def test_example_reward_and_backbone_load_by_path_and_their_options_are_typed(at):
    params = load_params("params.yaml", "ci", {**EXAMPLE, "model.options": {"height": 32, "width": 32,
                                                                            "guidance_scale": "25e-1"},
                                               "reward.options": {"colorfulness": {"scale": 50}}})
    assert params.model.backbone == "tiny-sana" and not params.is_toy
    assert params.model.options["guidance_scale"] == 2.5  # YAML 1.1's exponent (a string to it) read as its number
    assert params.reward.options == {"colorfulness": {"scale": 50.0}}
    assert registry.backbone_spec("tiny-sana").origin == str(at / "plugins/tiny_sana.py")
    assert registry.reward_spec("colorfulness").origin == str(at / "plugins/colorfulness.py")
    assert registry.backbone_spec("tiny-sana").cost.name  # its cost facts, for `jagg plan`

    assert sentence({"reward.options": {"colorfulness": {"scale": -1}}}) == (
        "params.yaml (profile ci): reward.options.colorfulness.scale = -1 is invalid: Input should be greater than 0.")
    assert "'colorfulness' has no option 'sclae'; its options: scale." in sentence(
        {"reward.options": {"colorfulness": {"sclae": 1.0}}})
    assert "model.options.height = 5000 is invalid: Input should be less than or equal to 1024" in sentence(
        {"model.options": {"height": 5000}})
    assert "'tiny-sana' has no option 'heigth'" in sentence({"model.options": {"heigth": 32}})
    assert "model.options.width = '32' must be a whole number" in sentence({"model.options": {"width": "32"}})


def test_a_name_clashing_with_a_builtin_is_one_sentence_naming_the_file_and_the_builtins_module(at):
    msg = sentence({"plugins": ["plugins/clash.py"]})
    assert msg == (f"params.yaml (profile ci): reward 'toy_fidelity' of {at / 'plugins/clash.py'} clashes with the "
                   f"reward of that name from jagg_core.rewards.toy; give it another name.")
    assert registry.reward_spec("toy_fidelity").origin == "jagg_core.rewards.toy"  # the built-in is kept


def test_a_plugin_failing_to_import_is_one_sentence_naming_the_file_and_the_error(at):
    msg = sentence({"plugins": ["plugins/broken.py"]})
    assert msg == (f"params.yaml (profile ci): plugin {at / 'plugins/broken.py'} failed to import: "
                   f"ModuleNotFoundError: No module named 'no_such_module_for_jagg_plugin_test'.")
    assert "plugin_test_broken_after" not in registry.reward_names()
    # asked for again in this process, the same sentence: not a silent skip (that read the params as if it loaded)
    assert sentence({"plugins": ["plugins/broken.py"]}) == msg


def test_a_plugin_whose_error_spans_lines_is_one_line_with_one_full_stop(at):
    msg = sentence({"plugins": ["plugins/multiline.py"]})  # the helper checks: no newline, ends with a full stop
    assert msg.endswith("failed to import: RuntimeError: the judge is down. see the log."), msg


def test_a_rewards_list_option_is_passed_as_given_and_its_reward_built_once():
    from typing import Annotated, Any

    from pydantic import Field

    from jagg_core.rewards import base as reward_base
    from jagg_core.rewards import make_reward, register_reward

    got = []

    @register_reward("plugin_test_palette", options={"palette": (Annotated[list[int], Field(max_length=8)], None),
                                                     "weights": (dict[str, Any], None)})
    def palette(palette=(0,), weights=None):
        got.append((palette, weights))
        return lambda images, prompts, metadata: (images.mean((1, 2, 3)), {})

    try:
        first = make_reward("plugin_test_palette", palette=[1, 2], weights={"a": 1.0, "b": {"c": 2.0}})
        again = make_reward("plugin_test_palette", weights={"b": {"c": 2.0}, "a": 1.0}, palette=[1, 2])
        other = make_reward("plugin_test_palette", palette=[2, 1])
        assert first is again and other is not first
        assert got == [([1, 2], {"a": 1.0, "b": {"c": 2.0}}), ([2, 1], None)]
    finally:
        registry.remove("reward", "plugin_test_palette")
        for key in [k for k in reward_base._BUILT if k[0] == "plugin_test_palette"]:
            del reward_base._BUILT[key]


@pytest.mark.parametrize("given, expected", [
    ("../outside.py", "plugins '../outside.py' leads outside the project ({root}); pass a path inside it."),
    ("/etc/hostname", "plugins '/etc/hostname' leads outside the project ({root}); pass a path inside it."),
    ("plugins/missing.py", "plugin file {root}/plugins/missing.py does not exist; params.yaml's plugins names files "
                           "inside the project."),
    ("plugins/notes.txt", "plugin file {root}/plugins/notes.txt is not a Python module (a .py file)."),
    ("plugins", "plugins 'plugins' is not a regular file (a folder?); pass a file name."),
], ids=["parent", "absolute", "missing", "not-python", "folder"])
def test_a_bad_plugin_path_is_one_sentence(at, given, expected):
    (at.parent / "outside.py").write_text("raise SystemExit('imported from outside the project')\n")
    assert sentence({"plugins": [given]}) == "params.yaml (profile ci): " + expected.format(root=at)


def test_plugins_must_be_a_list_of_paths(at):
    assert sentence({"plugins": "plugins/colorfulness.py"}) == (
        "params.yaml (profile ci): plugins must be a list of file paths inside the project, e.g. "
        "[plugins/my_reward.py].")



def test_the_entry_points_are_read_once_per_process_however_often_the_registry_is_asked(monkeypatch):
    """Every registry lookup imports the plugins it has not imported yet; reading the entry points scans every
    installed distribution's metadata (~5 ms), which one `jagg evaluate` did 70 times. Now once per process."""
    calls = []

    def counted(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    real = registry.entry_points
    monkeypatch.setattr(registry, "entry_points", counted)
    registry._plugin_entry_points.cache_clear()
    try:
        for _ in range(5):
            assert registry.reward_spec("toy_fidelity").name == "toy_fidelity"
            assert "toy-flux" in registry.backbone_names()
        assert calls == [{"group": registry.ENTRY_POINT_GROUP}]
    finally:
        registry._plugin_entry_points.cache_clear()  # the next lookup reads the real ones again

# --- Through the command line, in a copy of the project ----------------------------------------------------------

STYLES = ("anime", "concept-art", "paintings", "photo")
TRAIN_PROMPTS = ["a red apple on a table", "a blue car in the rain", "a yellow bird", "green hills at dawn"]


def _curve(root: Path, profile: str, run: str) -> list[dict]:
    return list(csv.DictReader((root / f"runs/{profile}/{run}/curve.tsv").open(), delimiter="\t"))


def _ok(out, what: str) -> str:
    assert out.returncode == 0, f"{what}: " + (out.stdout + out.stderr)[-3000:]
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def sana_project(tmp_path_factory) -> Path:
    """A project of the user's own: the repository's params.yaml with a profile ``sana`` (ci's sizes) that names the
    example backbone and reward by their files, training prompts in a .txt and an HPDv2-style test set (a
    benchmark/<style>.json per style), as a user brings them."""
    root = tmp_path_factory.mktemp("sana_project").resolve()
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    (root / "examples/plugins").mkdir(parents=True)
    for name in ("tiny_sana.py", "colorfulness.py"):
        shutil.copy(EXAMPLES / name, root / "examples/plugins" / name)
    (root / "mine/hpdv2/benchmark").mkdir(parents=True)
    for style in STYLES:
        prompts = [f"a {colour} {style} picture of a house" for colour in ("red", "green")]
        (root / f"mine/hpdv2/benchmark/{style}.json").write_text(json.dumps(prompts))
    (root / "mine/train.txt").write_text("\n".join(TRAIN_PROMPTS) + "\n")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    ci = {k: v for k, v in raw["profiles"]["ci"].items() if k not in ("world", "pretrain", "reward")}
    raw = {"extends": "../params.yaml", "profiles": {}}  # a user's file builds on the project's, adding its profile
    raw["profiles"]["sana"] = {
        **ci,
        "plugins": ["examples/plugins/tiny_sana.py", "examples/plugins/colorfulness.py"],
        "model": {"backbone": "tiny-sana", "options": {"height": 32, "width": 32}},  # model.path unset: from seed
        "data": {"train_prompts": "mine/train.txt"},
        "reward": {"weights": {"colorfulness": 1.0}},
        "train": {**ci["train"], "iterations": 2},
        "eval": {**ci["eval"], "benchmark": "mine/hpdv2", "metrics": ["colorfulness"]},
        "run": {"methods": ["jagg"], "seeds": [0]},
    }
    (root / "mine/params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return root


@pytest.mark.slow  # prepare, train (2 ci iterations), evaluate ×2, plan, export, report through the CLI: ~1.5 min
def test_example_backbone_and_reward_by_file_through_every_stage(sana_project):
    from safetensors.torch import load_file
    import torch

    from jagg_core.trainer.checkpoint import load_tensors

    root, run = sana_project, "jagg-s0"

    def stage(module: str, *args: str) -> str:
        return _ok(run_module(module, "--params", "mine/params.yaml", "--profile", "sana", *args, root=root,
                              timeout=900), module)

    stage("tasks.prepare")
    assert json.loads((root / "data/sana/prompts/benchmark/photo.json").read_text())[0].endswith("photo picture of "
                                                                                                  "a house")
    stage("tasks.train", "--method", "jagg", "--seed", "0")
    rows = _curve(root, "sana", run)
    assert [int(r["iteration"]) for r in rows] == [1, 2]
    assert all(0 < float(r["reward/colorfulness/mean"]) for r in rows)
    ckpts = root / f"checkpoints/sana/{run}"
    first, last = (load_tensors(ckpts / f"checkpoint-00000{i}/trainable.safetensors") for i in (1, 2))
    assert first.keys() == last.keys() and len(last) == 54  # the tiny Sana transformer, full fine-tune
    assert all(not torch.equal(first[k], last[k]) for k in last)  # the second update moved every tensor

    stage("tasks.evaluate", "--run", run)
    stage("tasks.evaluate", "--run", "base")
    trained = json.loads((root / f"eval/sana/{run}/metrics.json").read_text())
    base = json.loads((root / "eval/sana/base/metrics.json").read_text())
    assert trained["step"] == 2 and set(trained["metrics"]) == {"colorfulness"}
    assert trained["metrics"]["colorfulness"]["n_images"] == 8  # 2 prompts × 4 styles
    assert set(trained["metrics"]["colorfulness"]["styles"]) == set(STYLES)
    assert trained["metrics"]["colorfulness"]["mean"] != base["metrics"]["colorfulness"]["mean"]

    text = stage("tasks.plan")
    assert "jagg plan — profile sana: tiny Sana (random) at 32×32" in text
    assert "examples/plugins/tiny_sana.py: 2 Sana blocks of width 32" in text
    plan = json.loads(run_module("tasks.plan", "--params", "mine/params.yaml", "--profile", "sana", "--json",
                                 root=root).stdout)
    assert plan["architecture"] == "tiny Sana (random)" and plan["trainable_params"] == 54084
    assert plan["forward_tflop_per_image_step"] > 0 and [m["method"] for m in plan["methods"]] == ["jagg"]

    stage("tasks.export", "--run", run)
    out = root / f"exports/sana/{run}-step2"
    facts = json.loads((out / "export.json").read_text())
    assert facts["backbone"] == "tiny-sana" and facts["pipeline"] == "SanaPipeline" and facts["kind"] == "full"
    exported = load_file(out / "transformer/diffusion_pytorch_model.safetensors")
    assert set(exported) == set(last) and all(torch.equal(exported[k], last[k]) for k in last)

    stage("tasks.report")
    summary = json.loads((root / "reports/sana/summary.json").read_text())
    assert summary["profile"] == "sana" and summary["primary"] == "colorfulness"
    assert [(r["method"], r["step"]) for r in summary["runs"]] == [("jagg", 2)]
    assert summary["runs"][0]["final"]["colorfulness"] == pytest.approx(trained["metrics"]["colorfulness"]["mean"])
    assert (root / "reports/sana/index.html").is_file()
    shutil.rmtree(root / "checkpoints", ignore_errors=True)


PACKAGE_MODULE = '''
"""A user's package: one reward, registered where it is defined, found through its `jagg.plugins` entry point."""
from jagg_core.rewards import register_reward


@register_reward("my_pkg_reward")
def my_pkg_reward():
    def fn(images, prompts, metadata):
        return images.mean((1, 2, 3)).float().cpu(), {}  # brightness
    return fn
'''


def _site_package(site: Path) -> Path:
    """The package as pip lays one out (the module and its ``.dist-info`` with entry_points.txt) in a site folder:
    on a stage's PYTHONPATH, ``importlib.metadata`` finds it as any installed distribution, and the project's venv is
    left as it was."""
    info = site / "my_pkg_reward-0.1.0.dist-info"
    info.mkdir(parents=True)
    (site / "my_pkg_reward.py").write_text(PACKAGE_MODULE)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-pkg-reward\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text('[jagg.plugins]\nmy_pkg_reward = my_pkg_reward\n')
    (info / "RECORD").write_text("")
    return site


@pytest.fixture(scope="module")
def three_rewards(ci_base, tmp_path_factory):
    """ONE ci training of 2 iterations through the launcher and a worker, on the toy backbone, with three rewards
    from three places: the example groupwise reward by file (``plugins:``), the built-in groupwise
    ``toy_fidelity_rank``, and a pointwise reward from an installed package's entry point. Each test below asserts
    what its own reward did (one training instead of three: the suite's time)."""
    work = tmp_path_factory.mktemp("three_rewards")
    root = work / "project"
    shutil.copytree(ci_base, root)
    (root / "examples/plugins").mkdir(parents=True)
    shutil.copy(EXAMPLES / "colorfulness_rank.py", root / "examples/plugins/colorfulness_rank.py")
    site = _site_package(work / "site")
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--seed", "0",
                     "--set", "plugins=[examples/plugins/colorfulness_rank.py]",
                     "--set", "reward.weights={colorfulness_rank: 1.0, toy_fidelity_rank: 1.0, my_pkg_reward: 1.0}",
                     root=root, env={"PYTHONPATH": f"{REPO}:{site}"}, timeout=900)
    _ok(out, "train")
    yield root, _curve(root, "ci", "jagg-s0")
    shutil.rmtree(root / "checkpoints", ignore_errors=True)


@pytest.mark.slow
def test_example_groupwise_reward_by_file_trains_on_the_toy_backbone(three_rewards):
    root, rows = three_rewards
    assert len(rows) == 2
    for row in rows:  # a ranking of each group of 4: the mean over a group is exactly 0.5
        assert float(row["reward/colorfulness_rank/mean"]) == pytest.approx(0.5)
    assert (root / "checkpoints/ci/jagg-s0/checkpoint-000002/trainable.safetensors").is_file()


@pytest.mark.slow
def test_a_builtin_groupwise_reward_trains_through_the_cli(three_rewards):
    _, rows = three_rewards
    assert len(rows) == 2
    for row in rows:  # tests/test_groupwise_rewards.py checks its ranks; here: one rank per group, mean 0.5
        assert float(row["reward/toy_fidelity_rank/mean"]) == pytest.approx(0.5)


@pytest.mark.slow
def test_a_reward_from_an_installed_package_entry_point_trains(three_rewards):
    from importlib.metadata import entry_points

    root, rows = three_rewards
    assert len(rows) == 2 and all(0 < float(r["reward/my_pkg_reward/mean"]) < 1 for r in rows)
    assert float(rows[0]["reward/my_pkg_reward/group_std"]) > 0  # a signal to train on
    # without the package on the path the name is unknown: one sentence, and this process never saw it
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--seed", "1",
                     "--set", "reward.weights={my_pkg_reward: 1.0}", root=root)
    assert out.returncode != 0 and "unknown reward 'my_pkg_reward'" in out.stderr and "Traceback" not in out.stderr
    assert "my_pkg_reward" not in {ep.name for ep in entry_points(group="jagg.plugins")}
