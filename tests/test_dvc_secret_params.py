"""A secret in a profile's overlay never reaches a pipeline's params (DVC copies each param's value into dvc.lock):
every stage listed the whole overlay ``profiles.<p>``, so a tracking URL's password and a served reward's token were
in ``pipelines/<p>/dvc.lock``. Each stage lists only the overlay's keys it reads, and no secret key nor a section
holding one (issue 61, mechanism 3)."""

from __future__ import annotations

import shutil

import yaml

from conftest import REPO
from tasks.dvc_pipelines import pipelines

SECRET = "s3cret"


def _project(tmp_path):
    (tmp_path / "pipelines").mkdir()
    shutil.copy(REPO / "pipelines/template.yaml", tmp_path / "pipelines/template.yaml")
    overlay = {
        "tracking": {"mlflow_uri": f"http://user:{SECRET}@host/"},
        "reward": {"weights": {"toy_fidelity": 1.0},
                   "options": {"served": {"url": "http://scores.lab:8000/score", "token": SECRET, "retries": 1}}},
        "train": {"iterations": 2},
        "sample": {"group_size": 4},
    }
    raw = {"profile": "toy", "run": {"methods": ["baseline", "jagg"], "seeds": [0]},
           "profiles": {"toy": {}, "leaky": overlay}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path


def _holds(tree, key: str) -> bool:
    """Whether the dotted ``key`` of ``tree`` is the secret or a section holding it."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return SECRET in yaml.safe_dump(tree)


def test_a_profiles_secrets_are_no_stage_param_and_each_stage_lists_the_overlay_keys_it_reads(tmp_path):
    root = _project(tmp_path)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    texts = pipelines(root)
    stages = yaml.safe_load(texts[next(p for p in texts if p.parent.name == "leaky")])["stages"]
    template = yaml.safe_load((REPO / "pipelines/template.yaml").read_text())["stages"]
    for name, stage in stages.items():
        params = [str(k) for k in stage["params"]]
        leaked = [k for k in params if _holds(raw, k) or "token" in k or "mlflow_uri" in k]
        assert not leaked, (name, leaked)
        overlay = {k.removeprefix("profiles.leaky.") for k in params if k.startswith("profiles.leaky")}
        reads = {k.split(".${")[0] for k in template[name]["params"] if not k.startswith("profiles.")}
        # each overlay key is (under) a key the stage reads at top level; none is the whole overlay
        assert "profiles.leaky" not in params, name
        assert all(any(k == r or k.startswith(r + ".") for r in reads) for k in overlay), (name, overlay, reads)
    assert "profiles.leaky.reward.options.served.url" in stages["evaluate"]["params"]  # its non-secret keys stay
    assert "profiles.leaky.reward.options.served.retries" in stages["evaluate"]["params"]
    assert "profiles.leaky.train" in stages["train"]["params"] and "profiles.leaky.train" in stages["speed"]["params"]
    assert not any(k.startswith("profiles.leaky") for k in stages["prepare"]["params"])  # it reads none of them
    assert SECRET not in "".join(texts.values())
