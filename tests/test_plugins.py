"""Plugins from outside the repository (issue 44, item 2): files named in a params file's ``plugins:`` and an installed
package's ``jagg.plugins`` entry point.

Fast, in this process: the example reward and backbone (examples/plugins/) named by path load and their options are
read through their schemas; a name clashing with a built-in, a plugin that fails to import, a path outside the
project, a missing file and a file that is not Python are each one sentence. Plugins are imported once per process and
registered process-wide, so every registration made here is removed when this file's tests end.

Slow, through the command line in a copy of the project (no file of jagg_core, tasks or flows changed): the example
backbone (tiny-sana) with the example pointwise reward through train, evaluate, plan, export and report; the example
groupwise reward trained on the toy backbone; and a reward installed as a package with a ``jagg.plugins`` entry point
(a ``.dist-info`` folder on PYTHONPATH, which ``importlib.metadata`` finds as pip's own: nothing is installed into the
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
                                                                            "guidance_scale": "2.5"},
                                               "reward.options": {"colorfulness": {"scale": "50"}}})
    assert params.model.backbone == "tiny-sana" and not params.is_toy
    assert params.model.options["guidance_scale"] == 2.5  # a numeric string read as the number it says
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
