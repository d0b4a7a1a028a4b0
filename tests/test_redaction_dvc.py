"""A planted password through a ci `jagg run` and a `dvc repro` (issue 61's "done when", mechanism 3): three secrets of
three kinds (a URL's password, a token, an option a plugin marks secret) kept where a user running DVC keeps them, in
the profile's own section of params.yaml, and a sweep name holding one; afterwards none is in any store (mlflow.db,
Prefect's database), dvc.lock, .dvc/, any other file or folder name of the project, or what was printed.
tests/test_redaction.py plants them through `jagg run --set` (a sweep point); this file is the DVC side, where every
param a stage lists is copied into dvc.lock."""

from __future__ import annotations

import secrets
import shutil

import pytest
import yaml

from conftest import run_module
from fault_helpers import _files_holding, _one_sentence
from test_pipeline import BIN, _clone, _run
from test_redaction import _pieces, _prefect_env, _sqlite_cells_holding

# Drawn as the test runs: a secret written in this file would be found in the project's copy of it.
URL_PASSWORD = f"Hn4W{secrets.token_hex(5)}"  # tracking.ui_url's: a URL's credentials
TOKEN = f"tok-{secrets.token_hex(6)}"  # a served reward's token (a secret by its key's name)
PHRASE = f"phrase-{secrets.token_hex(6)}"  # a plugin's option under a name the word list does not know, marked secret

VAULT = '''"""A reward whose option seed_phrase is a secret its spec marks."""
from jagg_core.rewards import register_reward


@register_reward("vault", options={"seed_phrase": (str, None)}, secret=("seed_phrase",))
def vault(seed_phrase: str | None = None):
    def fn(images, prompts, metadata):
        return images.mean(dim=(1, 2, 3)).float().cpu(), {}
    return fn
'''


@pytest.mark.slow  # a ci `jagg run` of one method for one iteration, then a `dvc repro` of its pipeline: ~3-4 min
@pytest.mark.timeout(1500)
def test_a_planted_password_is_in_no_store_no_lock_no_file_and_no_folder_name_after_jagg_run_and_dvc_repro(
        ci_base, tmp_path):
    """Before 4fb33cb every stage listed the whole overlay `profiles.ci` as a DVC param, so a secret there was in
    clear in dvc.lock. Now: a sweep name holding the token is refused in one sentence; `jagg run --profile ci` and
    `dvc repro` of ci's pipeline (each stage recorded, the trained run found trained) leave the URL's password, the
    token and the secret plugin option in params.yaml alone."""
    root = _clone(tmp_path)  # on ci: after the generator below, ci's pipeline is the root's dvc.yaml
    for folder in ("data", "models"):  # the prompts and the pretrained base (its stage finds it built)
        shutil.copytree(ci_base / folder, root / folder, dirs_exist_ok=True)
    (root / "plugins").mkdir()
    (root / "plugins" / "vault.py").write_text(VAULT)
    params = yaml.safe_load((root / "params.yaml").read_text())
    ci = params["profiles"]["ci"]
    ci["plugins"] = ["plugins/vault.py"]
    ci["run"] = {"methods": ["jagg"], "seeds": [0]}  # one method, one iteration: the test's time
    ci.setdefault("train", {})["iterations"] = 1
    ci["tracking"] = {"ui_url": f"http://alice:{URL_PASSWORD}@127.0.0.1:5000"}
    ci.setdefault("reward", {})["options"] = {"served": {"url": "http://127.0.0.1:9/score", "token": TOKEN},
                                              "vault": {"seed_phrase": PHRASE}}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    moved = _run([str(BIN / "python"), "-m", "tasks.dvc_pipelines"], root)
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert "--profile ci " in (root / "dvc.yaml").read_text()
    env = _prefect_env(root)

    # the sweep name: refused at a stage's door before anything is stored under it
    refused = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--seed", "0",
                         "--sweep", f"sweep-{TOKEN}", root=root, env=env, timeout=300)
    printed = refused.stdout + refused.stderr
    assert refused.returncode == 1 and "sweep name holds a secret" in printed, printed[-3000:]
    _one_sentence(refused.stderr.strip().splitlines()[-1])
    out = run_module("flows.run", "--profile", "ci", root=root, env=env, timeout=900)
    printed += out.stdout + out.stderr
    assert out.returncode == 0, printed[-4000:]
    repro = _run([str(BIN / "dvc"), "repro"], root, timeout=900)
    printed += repro.stdout + repro.stderr
    assert repro.returncode == 0, repro.stdout[-3000:] + repro.stderr[-3000:]

    # the stores and the lock were written (else the grep below proves nothing)
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    assert {"train@jagg-0", "evaluate@jagg-0", "report"} <= set(lock), set(lock)
    mlflow_db, prefect_db = root / "mlflow.db", root / ".prefect" / "prefect.db"
    assert mlflow_db.exists() and prefect_db.exists()
    assert (root / "reports/ci/index.html").exists() and (root / "checkpoints/ci/jagg-s0").is_dir()
    for needle in _pieces(URL_PASSWORD) + [TOKEN, PHRASE]:
        assert _sqlite_cells_holding(mlflow_db, [needle]) == [], needle
        assert _sqlite_cells_holding(prefect_db, [needle]) == [], needle
        assert _files_holding(root, needle.encode()) == ["params.yaml"], needle  # the user's own file alone
        assert not [p for p in root.rglob("*") if needle in p.name], f"{needle!r} names a file or folder"
        assert needle not in printed, f"{needle!r} was printed"
    # a section holding a secret is listed by its other keys: the stage still reruns when they change
    listed = lock["train@jagg-0"]["params"]["params.yaml"]
    assert "profiles.ci.train" in listed and "profiles.ci.reward.options.served.url" in listed, listed
