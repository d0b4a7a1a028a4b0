"""Secrets (jagg_core/setup/redact.py and every string that leaves a process): redacted by key and by value in errors,
log records, params and the files a run writes, whatever the password holds ('@', '/', '#', '?', a space); refused
where they would name something (an MLflow experiment, a params path); and a planted password in no store, no file, no
folder name and nothing printed after a whole `jagg run`."""

from __future__ import annotations

import pytest

from conftest import run_module


# --- redaction by key and by value ---------------------------------------------------------------------------------


def test_secrets_are_redacted_by_key_and_by_value_everywhere():
    from jagg_core.pipeline.tracking import param_strings

    tree = {"reward": {"options": {"hpsv2.1": {"api_token": "hf_abcdef12", "checkpoint": "x.pt",
                                               "mirror": "https://h/?t=hf_abcdef12"}}},
            "tracking": {"mlflow_uri": "postgresql://admin:s3cret-pw@db:5432/mlflow", "passwd": "p4ssw0rd"},
            "model": {"options": {"tokenizer": "t5", "max_tokens": 77,
                                  "headers": [{"Authorization": "Bearer abcdef"}, "plain"]}},
            "keys": {"private_key": "-----BEGIN", "access_key": "AKIA1234", "auth": "u:p"}}
    flat = param_strings(tree)
    text = repr(flat)
    for secret in ("hf_abcdef12", "s3cret-pw", "p4ssw0rd", "Bearer abcdef", "-----BEGIN", "AKIA1234", "u:p"):
        assert secret not in text, secret
    assert flat["tracking.mlflow_uri"] == "postgresql://admin:***@db:5432/mlflow"
    assert flat["reward.options.hpsv2.1.mirror"] == "https://h/?t=***"  # the token's value, elsewhere too
    assert flat["reward.options.hpsv2.1.checkpoint"] == "x.pt" and flat["model.options.tokenizer"] == "t5"
    assert flat["model.options.max_tokens"] == "77"


def test_user_errors_and_every_log_record_are_redacted(capsys):
    """One redaction for what is raised and what is logged: a user error quoting a credentialed URI prints it as
    ``user:***@``, a stage's Prefect task or a flow hands it to Prefect so (its state message is the error's text),
    and so does every log handler (ours, MLflow's, Prefect's console and API handlers get the same filter)."""
    import logging

    from jagg_core.setup.config import ParamsError
    from tasks.common import cli, shown_redacted, stage_logger

    def err():
        return ParamsError("the MLflow store http://user:s3cret@127.0.0.1:1/ cannot open")

    def fail():
        raise err()

    with pytest.raises(ParamsError) as raised:  # what a stage's Prefect task or a flow lets out
        shown_redacted(fail)()
    assert "s3cret" not in str(raised.value) and "user:***@" in str(raised.value)
    assert "s3cret" not in repr(raised.value)

    @cli
    def main(argv=None):
        fail()

    assert main() == 1 and "user:***@" in (printed := capsys.readouterr().err) and "s3cret" not in printed
    seen = []

    class Capture(logging.Handler):
        def emit(self, record):
            seen.append(self.format(record))

    handler = Capture()
    logging.getLogger("prefect.flow_runs").addHandler(handler)
    try:
        stage_logger("test")  # puts the filter on every handler there is
        logging.getLogger("prefect.flow_runs").warning("store %s", "http://user:s3cret@host:1/")
    finally:
        logging.getLogger("prefect.flow_runs").removeHandler(handler)
    assert seen == ["store http://user:***@host:1/"]


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


# --- a run's files, output and stores hold no secret ---------------------------------------------------------------


@pytest.mark.slow  # launched training runs beside live servers (20-50 s)
def test_a_run_writes_no_secret_to_disk_or_to_its_command_line(ci_project):
    """params.json, every checkpoint's state.json, the MLflow params and the workers' command line: no secret."""
    import sqlite3

    secret = "pw-7d1f0c"
    store = ci_project / "mlflow.db"
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--set", "train.iterations=1",
                     "--set", f"tracking.ui_url=http://admin:{secret}@127.0.0.1:5000", root=ci_project)
    assert out.returncode == 0, out.stderr[-2000:]
    assert secret not in out.stdout + out.stderr  # the launcher logs the worker's command line
    written = [p for p in ci_project.rglob("*.json") if "mlflow" not in p.name]
    assert any(p.name == "state.json" for p in written) and any(p.name == "params.json" for p in written)
    for p in written:
        assert secret not in p.read_text(), p
    with sqlite3.connect(store) as db:
        values = [v for (v,) in db.execute("select value from params")]
    assert values and not any(secret in v for v in values)
    assert not list(ci_project.rglob(".worker-context-*"))  # the launcher's private file is gone
