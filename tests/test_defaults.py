"""One source of defaults: the code's defaults (jagg_core/setup/config.py) are the values params.yaml's main
sections set, so ``Params()`` (or ``JaggConfig()``, ``SampleConfig()`` ...) is the embedded default. A value changed
on one side only fails here, naming the key and both values."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel

from jagg_core.setup.config import Params

REPO = Path(__file__).resolve().parents[1]
# Not defaults: the active profile's name, the overlays, and the named methods (a mapping of names, not settings).
NOT_DEFAULTS = ("profile", "profiles", "methods")


def _drift(yaml_tree: dict, code: BaseModel, path: str = "") -> list[str]:
    """Every key params.yaml sets under ``path`` whose value is not the code's default; sections recurse, mappings
    (``reward.weights``) and lists compare whole."""
    out = []
    for key, value in yaml_tree.items():
        where = f"{path}{key}"
        if key not in type(code).model_fields:
            out.append(f"{where}: in params.yaml, not a field of the code")
            continue
        default = getattr(code, key)
        if isinstance(default, BaseModel) and isinstance(value, dict):
            out += _drift(value, default, where + ".")
            continue
        default = default.model_dump(mode="json") if isinstance(default, BaseModel) else default
        if isinstance(default, tuple):
            default = list(default)
        if value != default:
            out.append(f"{where}: params.yaml {value!r}, code {default!r}")
    return out


def test_the_code_defaults_are_the_values_params_yaml_sets():
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    sections = {k: v for k, v in raw.items() if k not in NOT_DEFAULTS}
    drift = _drift(sections, Params())
    assert not drift, "params.yaml and jagg_core/setup/config.py disagree: " + "; ".join(drift)


def test_the_drift_check_sees_a_changed_value():
    code = Params()
    assert _drift({"jagg": {"reuse_rollout_velocity": not code.jagg.reuse_rollout_velocity}}, code)
    assert _drift({"reward": {"weights": {"toy_fidelity": 2.0}}}, code)
    assert _drift({"sample": {"no_such_key": 1}}, code)
