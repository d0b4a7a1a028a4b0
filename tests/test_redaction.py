"""Secrets (jagg_core/setup/redact.py and every string that leaves a process): redacted by key and by value in errors,
log records, params and the files a run writes, whatever the password holds ('@', '/', '#', '?', a space); refused
where they would name something (an MLflow experiment, a params path); and a planted password in no store, no file, no
folder name and nothing printed after a whole `jagg run`."""

from __future__ import annotations

import re
import shutil
import sqlite3
from pathlib import Path
from urllib.parse import quote

import pytest

from conftest import run_module
from fault_helpers import PARAMS, _MlflowServer, _files_holding
from jagg_core.setup.params_io import load_params


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


# Passwords with the characters that ended round 4's redaction early ('/', '#', '?') and '@'; each piece between them
# is long enough to be grepped on its own.
UI_PASSWORD = "Qz7Kp9/Vx3Lm5#Wr8Tn2?Hy6Bc4@Jd1Fg0"


STORE_PASSWORD = "Mf9Rt2@Yx5Qw8"  # a password the MLflow client can use as typed ('/', '#' and '?' would end the host)


@pytest.mark.parametrize("text, password", [
    ("http://alice:Pa/ssW0rdXYZ@127.0.0.1:9/", "Pa/ssW0rdXYZ"),
    ("postgresql://alice:Pa#ssW0rdXYZ@host/db", "Pa#ssW0rdXYZ"),
    ("store http://alice:Pa?ssW0rdXYZ@h:5000/api is down", "Pa?ssW0rdXYZ"),
    ("http://alice:Pa@ss/W0#rd?XYZ@127.0.0.1:9/x", "Pa@ss/W0#rd?XYZ"),
    (f"[x](http://alice:{UI_PASSWORD}@h/a.png) [y](http://alice:{UI_PASSWORD}@h/b.png)", UI_PASSWORD),
])
def test_c1_passwords_with_url_delimiters_are_redacted(text, password):
    """A password holding '/', '#', '?' or '@' is redacted whole (round 4 stopped at the first '/', '#' or '?' and
    printed the password); the user and the host stay."""
    from jagg_core.setup.redact import redact

    shown = redact(text)
    assert password not in shown and "alice:***@" in shown, shown
    assert "W0rdXYZ" not in shown and "ssW0rd" not in shown, shown


def test_c1_a_secret_seen_once_is_redacted_where_a_library_quotes_a_piece_of_it():
    """requests reads `http://alice:Pa/ssW0rdXYZ@127.0.0.1:9/` as host "alice" and path "/ssW0rdXYZ@127.0.0.1:9/":
    its error quotes a piece of the password without the URL. Params remember their secrets for every later
    redaction of the process (every log record, every error sentence)."""
    from jagg_core.setup.redact import redact

    load_params(PARAMS, "ci", {"tracking.mlflow_uri": "http://alice:Pa/ssLeakPiece42@127.0.0.1:9/"})
    shown = redact("HTTPConnectionPool(host='alice', port=80): Max retries exceeded with url: "
                   "/ssLeakPiece42@127.0.0.1:9/api/2.0/mlflow/experiments/get-by-name")
    assert "ssLeakPiece42" not in shown, shown


# A password each piece of which (between '/', '#', '?', '@', ':' and the space) is long enough to grep on its own.
PASSWORD = "Kv8Qz3Wm7Tx2"


def _pieces(password: str) -> list[str]:
    return [password, quote(password, safe=""), *(p for p in re.split(r"[/#?@: ]", password) if len(p) >= 6)]


def _sqlite_cells_holding(db: Path, needles: list[str]) -> list[str]:
    """``table.column`` of every cell of a sqlite database holding one of ``needles`` (text or bytes)."""
    hits = []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        for (table,) in con.execute("select name from sqlite_master where type='table'").fetchall():
            for col in [r[1] for r in con.execute(f"pragma table_info('{table}')")]:
                for (value,) in con.execute(f'select "{col}" from "{table}"'):
                    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
                    if any(n in text for n in needles):
                        hits.append(f"{table}.{col}")
                        break
    finally:
        con.close()
    return hits


# --- a run's files, output and stores hold no secret ---------------------------------------------------------------


def test_c1_an_unreachable_store_with_a_slash_in_its_password_prints_no_part_of_it(ci_project):
    """The issue's repro: `jagg train --set tracking.mlflow_uri=http://alice:Pa/ssW0rdXYZ@127.0.0.1:9/ --set
    tracking.retries=0` printed the whole password twice. Now one sentence, exit 1, no piece of it."""
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--seed", "0",
                     "--set", "tracking.mlflow_uri=http://alice:Pa/ssW0rdXYZ@127.0.0.1:9/",
                     "--set", "tracking.retries=0", root=ci_project, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    for piece in ("Pa/ssW0rdXYZ", "ssW0rdXYZ", "Pa%2FssW0rdXYZ"):
        assert piece not in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


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


@pytest.mark.slow  # one `jagg run --profile ci` (a temporary Prefect server, a live MLflow server): ~2-4 min
def test_c1_a_credentialed_jagg_run_leaves_no_password_anywhere(ci_base, tmp_path):
    """`jagg run --profile ci` with credentials in every URL field (tracking.ui_url: a password holding '/', '#',
    '?' and '@'; tracking.mlflow_uri: a live server reached with a password holding '@'): no piece of either password
    is in mlflow.db, mlruns/, Prefect's database (artifacts, artifact collections, events, flow-run parameters, logs,
    read row by row and as bytes), runs/, eval/, reports/, any other file of the project, or the output. (Round 4:
    the MLflow link artifact and the report's markdown held the UI's password, in `artifact`, `artifact_collection`
    and the events.)"""
    root = tmp_path / "project"
    shutil.copytree(ci_base, root)
    server = _MlflowServer(root)
    server.start()
    ui = f"http://alice:{UI_PASSWORD}@127.0.0.1:5000"
    store = f"http://bob:{STORE_PASSWORD}@127.0.0.1:{server.port}/"
    try:
        out = run_module("flows.run", "--profile", "ci", "--set", "run.methods=[jagg]",
                         "--set", f"tracking.ui_url={ui}", "--set", f"tracking.mlflow_uri={store}", root=root,
                         env={"PREFECT_HOME": str(root / ".prefect"), "PREFECT_API_URL": ""}, timeout=900)
    finally:
        server.stop()
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    db = root / ".prefect" / "prefect.db"
    assert db.exists(), "no Prefect database: the grep below would prove nothing"
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:  # the stores were written: the artifacts the report made, the run's parameters, its logs and events
        keys = {r[0] for r in con.execute("select key from artifact")}
        assert {"mlflow", "report"} <= {k.rsplit("-", 1)[-1] for k in keys}, keys
        links = [r[0] for r in con.execute("select data from artifact where key like '%-mlflow'")]
        assert links and all("alice:***@127.0.0.1:5000" in link for link in links), links
        assert con.execute("select count(*) from log").fetchone()[0] > 0
    finally:
        con.close()
    needles = _pieces(UI_PASSWORD) + _pieces(STORE_PASSWORD)
    assert _sqlite_cells_holding(db, needles) == []
    for needle in needles:
        assert _files_holding(root, needle.encode()) == [], f"{needle!r} reached the project's files"
        assert needle not in text, f"{needle!r} was printed"
    for folder in ("mlflow.db", "runs", "eval", "reports"):
        assert (root / folder).exists(), folder
