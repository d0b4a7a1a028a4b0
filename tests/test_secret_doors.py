"""A secret leaves by no door (issue 61, mechanism 3; docs/reliability.md, round 7): a sweep's name that holds a secret
is refused where it comes in, before MLflow or Prefect stores it; a flow run's ``params_file`` outside the project is
refused before it is read, and no YAML error quotes a line of a file; an option that a plugin's spec marks secret is
redacted wherever params are (params.json, state.json, MLflow, a provenance, a fingerprint, a sweep point's folder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO
from jagg_core.errors import UserError
from jagg_core.setup import registry
from jagg_core.setup.config import ParamsError
from jagg_core.setup.params_io import load_params, parse_yaml
from jagg_core.setup.registry import PluginError, RewardSpec

PARAMS = REPO / "params.yaml"
TOKEN = "tok-9f3e1c2d7b"  # a served reward's token: a secret by its key's name
PHRASE = "vault-phrase-5d8a2e71"  # a plugin's option under a name the word list does not know, marked secret
VAULT = "doors_vault"  # the test plugin's reward


def _served(token: str = TOKEN) -> dict:
    return {"reward.options": {"served": {"url": "http://127.0.0.1:9/score", "token": token}}}


@pytest.fixture
def vault():
    """A reward plugin whose option ``seed_phrase`` is a secret its spec marks (``secret=("seed_phrase",)``)."""
    registry.add("reward", RewardSpec(VAULT, lambda **_: None, options={"seed_phrase": (str, None),
                                                                         "scale": (float, 1.0)},
                                      secret=("seed_phrase",)))
    try:
        yield lambda phrase=PHRASE, **more: load_params(
            PARAMS, "ci", {"reward.options": {VAULT: {"seed_phrase": phrase, **more}}})
    finally:
        registry.remove("reward", VAULT)


def _store_bytes(tmp_path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())


# --- (a) a sweep's name ---------------------------------------------------------------------------------------------


def test_a_sweep_name_holding_a_secret_is_refused_before_mlflow_stores_it(tmp_path):
    """Before: `--sweep <token>` was MLflow's `runs.name`, the tags `jagg.sweep` and `mlflow.runName` (only MLflow's
    characters were checked). After: one sentence, nothing stored; a name without a secret still makes its run."""
    from jagg_core.pipeline.tracking import Tracker

    params = load_params(PARAMS, "ci", {**_served(), "tracking.mlflow_uri": f"sqlite:///{tmp_path}/m.db"})
    tracker = Tracker(params, tmp_path)
    for name in (TOKEN, f"sweep-{TOKEN}-2"):
        with pytest.raises(ParamsError, match="sweep name holds a secret") as e:
            tracker.sweep_run(name)
        assert TOKEN not in str(e.value)
    with pytest.raises(ParamsError, match="sweep name holds a secret"):
        tracker.child_run(f"x{TOKEN}", "jagg-s0", method="jagg", seed=0, key="k")
    assert tracker.client.search_runs([tracker.experiment_id]) == []
    assert TOKEN.encode() not in _store_bytes(tmp_path)
    assert tracker.sweep_run("plain-sweep")  # the rule refuses secrets, not names


def test_a_flows_and_a_pool_units_sweep_name_are_checked_at_their_door(tmp_path):
    """Before: a flow's `sweep` parameter went unchecked into the units' Prefect tags and parameters, and a forged
    unit's straight to its checks; after: both refused by the one rule before anything runs."""
    from flows.pool import evaluate_unit, train_unit
    from flows.sweep import sweep_name

    overrides = {"reward.options": {"served": {"url": "http://127.0.0.1:9/score", "token": TOKEN}}}
    shared = {"root": str(tmp_path), "host": "h", "file": "none", "token": "t" * 32, "mlflow_uri": "x"}
    with pytest.raises(ParamsError, match="sweep name holds a secret") as e:
        train_unit.fn(profile="ci", method="jagg", seed=0, shared=shared, sweep=TOKEN, overrides=overrides)
    assert TOKEN not in str(e.value)
    with pytest.raises(ParamsError, match="sweep name holds a secret"):
        evaluate_unit.fn(profile="ci", run="base", shared=shared, sweep=f"a{TOKEN}", overrides=overrides)
    params = load_params(PARAMS, "ci", _served())
    with pytest.raises(ParamsError, match="sweep name holds a secret"):
        sweep_name(f"s-{TOKEN}", params)
    assert sweep_name("s-1", params) == "s-1"


# --- (b) a params file: the path rule before the read; no error quotes a line ---------------------------------------


def test_a_forged_units_params_file_outside_the_project_is_refused_before_it_is_read(tmp_path):
    """Before: `params_file=/elsewhere/secrets.yaml` was read and its YAML error quoted a line of it (Prefect's
    database keeps the flow run's state message); after: the path rule refuses it unread, in one sentence."""
    from flows.pool import evaluate_unit
    from flows.sweep import flow_params
    from tasks.common import ROOT

    outside = tmp_path / "secrets.yaml"
    assert not outside.resolve().is_relative_to(ROOT)
    outside.write_text(f"db_host: h\n{PHRASE}: [unclosed\n")
    for call in (lambda: flow_params("ci", str(outside)),
                 lambda: evaluate_unit.fn(profile="ci", run="base", shared={}, sweep="s", params_file=str(outside)),
                 lambda: flow_params("ci", f"../{'../' * len(ROOT.parts)}{str(outside).lstrip('/')}")):
        with pytest.raises(UserError, match="leads outside the project") as e:
            call()
        assert PHRASE not in str(e.value)
    assert flow_params("ci", str(PARAMS)).profile == "ci"  # inside: read as before


def test_a_yaml_error_names_the_file_and_line_never_the_lines_text(tmp_path):
    """Before: "x.yaml is not valid YAML (… line 2, column 9: planted: <the line> ^)"; after: the problem, line and
    column only, for a params file and a `--set` value alike."""
    for text, line in ((f"a: 1\n{PHRASE}: b: c\n", 2), (f"a: 1\n\n{PHRASE}: [unclosed\n", 4),
                       (f"- x\n{PHRASE}: v\n", 2), (f'a: "{PHRASE}\\q"\n', 1), (f"\t{PHRASE}: 1\n", 1)):
        with pytest.raises(ParamsError) as e:
            parse_yaml(text, "x.yaml")
        assert PHRASE not in str(e.value) and f"line {line}" in str(e.value), str(e.value)
        f = tmp_path / "bad.yaml"
        f.write_text(text)
        with pytest.raises(ParamsError) as e:
            load_params(f, "ci")
        assert PHRASE not in str(e.value) and str(e.value).startswith(f"{f} is not valid YAML"), str(e.value)


# --- (c) an option a plugin's spec marks secret ---------------------------------------------------------------------


def test_an_option_a_plugin_marks_secret_is_redacted_wherever_params_are(tmp_path, vault):
    """Before: `reward.options.<plugin>.seed_phrase` (no secret word in its name) was in clear in params.json,
    state.json (both `Params.redacted()`), MLflow's params, speed.json's provenance and a log line quoting it; after:
    `***` in each, by the spec's mark."""
    from jagg_core.pipeline.tracking import Tracker, param_strings
    from jagg_core.setup.provenance import speed_made_from
    from jagg_core.setup.redact import redact

    params = vault(scale=2.0)
    assert params.secret_options() == [("reward", "options", VAULT, "seed_phrase")]
    redacted = params.redacted()
    assert redacted["reward"]["options"][VAULT] == {"seed_phrase": "***", "scale": 2.0}
    assert PHRASE not in json.dumps(redacted) and PHRASE not in json.dumps(param_strings(params.masked()))
    assert PHRASE not in redact(f"the vault said no to {PHRASE}")  # remembered: a library's error quoting it
    assert PHRASE not in json.dumps(speed_made_from(params, ["jagg"]))
    params.tracking.mlflow_uri = f"sqlite:///{tmp_path}/m.db"
    tracker = Tracker(params, tmp_path)
    run = tracker.child_run("s", "jagg-s0", method="jagg", seed=0, key="k")
    logged = tracker.client.get_run(run).data.params
    assert logged[f"reward.options.{VAULT}.seed_phrase"] == "***" and logged[f"reward.options.{VAULT}.scale"] == "2.0"
    assert PHRASE.encode() not in _store_bytes(tmp_path)
    with pytest.raises(ParamsError, match="sweep name holds a secret"):  # the names' rule knows it too
        tracker.sweep_run(f"s-{PHRASE}")
    with pytest.raises(ParamsError, match="tracking.experiment holds a secret"):
        load_params(PARAMS, "ci", {"reward.options": {VAULT: {"seed_phrase": PHRASE}},
                                   "tracking.experiment": f"e-{PHRASE}"})


def test_a_secret_option_is_hashed_redacted_and_other_params_hash_as_before(tmp_path, vault):
    """The run's fingerprint and a sweep point's folder hash a marked option as `***` (a rotated phrase resumes the
    run and keeps the folder; no digest of the secret), while params without secret options dump, and so hash,
    exactly as before (`masked()` is `model_dump()`)."""
    from flows.sweep import sweep_digest
    from jagg_core.setup.paths import Layout
    from jagg_core.trainer.fingerprint import run_fingerprint

    plain = load_params(PARAMS, "ci", _served())
    assert plain.secret_options() == [] and plain.masked() == plain.model_dump(mode="json")
    one, other = vault(), vault("another-phrase-0042")
    assert one.masked() == other.masked() and one.masked() != one.model_dump(mode="json")
    lay = Layout(tmp_path, "ci")
    assert run_fingerprint(one, lay, "jagg", 0) == run_fingerprint(other, lay, "jagg", 0)
    assert run_fingerprint(one, lay, "jagg", 0) != run_fingerprint(vault(scale=3.0), lay, "jagg", 0)
    for key, value in ((f"reward.options.{VAULT}.seed_phrase", PHRASE),
                       (f"reward.options.{VAULT}", {"seed_phrase": PHRASE}),
                       ("reward", {"options": {VAULT: {"seed_phrase": PHRASE}}})):
        digests = {sweep_digest({key: v, "train.lr": 1e-4}, one.secret_options())
                   for v in (value, json.loads(json.dumps(value).replace(PHRASE, "another")))}
        assert len(digests) == 1, key
    assert sweep_digest({"train.lr": 1e-4}, one.secret_options()) == sweep_digest({"train.lr": 1e-4})


def test_a_spec_marks_only_its_own_options_secret():
    """A typo in `secret` would leave the secret in clear, silently: one sentence at registration instead."""
    for secret in (("seed_frase",), "seed_phrase", None, ["seed_phrase"]):
        with pytest.raises(PluginError, match="marks secret"):
            registry.add("reward", RewardSpec("doors_typo", lambda **_: None,
                                              options={"seed_phrase": (str, None)}, secret=secret))
    registry.remove("reward", "doors_typo")
