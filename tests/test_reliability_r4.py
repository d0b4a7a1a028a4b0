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

from jagg_core.pipeline.config import ParamsError
from jagg_core.pipeline.params_io import load_params, parse_yaml

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
])
def test_every_value_is_read_typed_and_bounded(overrides, says):
    with pytest.raises(ParamsError) as e:
        load_params(PARAMS, "ci", overrides)
    assert says in _one_sentence(e.value), e.value


def test_an_anchored_string_bomb_in_a_params_file_is_refused(tmp_path):
    """Item 1 as reported: the bomb in the params file itself (10 MB × 1000 × 500 to serialise before)."""
    text = PARAMS.read_text() + "\n".join([
        "", "bomb:", "  big: &s '" + "x" * 1_000_000 + "'", "  l1: &l1 [" + ", ".join(["*s"] * 1000) + "]",
        "  l2: [" + ", ".join(["*l1"] * 500) + "]", ""])
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(ParamsError) as e:
        load_params(tmp_path / "params.yaml", "ci")
    assert "expands to more than" in _one_sentence(e.value)


def test_typed_options_keep_what_is_valid_and_read_numeric_strings_as_numbers():
    p = load_params(PARAMS, "ci", {"model.options.guidance_scale": "3e0", "reward.options.toy_fidelity.tau": "1e2"})
    assert p.model.options == {"guidance_scale": 3.0} and p.reward.options == {"toy_fidelity": {"tau": 100.0}}
    for profile in ("flux", "sd3", "qwenimage", "wan"):  # every shipped profile's options still read
        load_params(PARAMS, profile)


def test_option_tables_agree_with_the_backbones_and_the_rewards():
    import importlib
    import inspect

    from jagg_core.pipeline.config import MODEL_OPTIONS, REWARD_OPTIONS
    from jagg_core.rewards.base import _FACTORIES

    for backbone in ("flux", "sd3", "qwenimage", "wan"):
        defaults = importlib.import_module(f"jagg_core.policies.{backbone}").DEFAULTS
        assert set(MODEL_OPTIONS[backbone]) == set(defaults), backbone
    assert set(MODEL_OPTIONS["toy-flux"]) == {"lora", "guidance_scale"}  # policies/toy_flux.py:load_toy_flux
    for name, factory in _FACTORIES.items():
        assert set(REWARD_OPTIONS[name]) == set(inspect.signature(factory).parameters), name


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
