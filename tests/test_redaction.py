"""Secrets (jagg_core/setup/redact.py and every string that leaves a process): redacted by key and by value in errors,
log records, params and the files a run writes, whatever the password holds ('@', '/', '#', '?', a space); refused
where they would name something (an MLflow experiment, a params path); and a planted password in no store, no file, no
folder name and nothing printed after a whole `jagg run`."""

from __future__ import annotations

import re
import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

from conftest import run_module
from fault_helpers import PARAMS, _MlflowServer, _files_holding, _one_sentence
from jagg_core.setup.config import ParamsError
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


# Where an earlier test in this worker set Prefect's logging up, its API handler on `prefect.flow_runs` warns that
# this record has no flow run to go to: Prefect's, not this test's subject (the record still reaches every handler).
@pytest.mark.filterwarnings("ignore:Logger 'prefect.flow_runs' attempted to send logs to the API:UserWarning")
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


def test_m3_a_password_with_a_space_in_the_ui_url_is_not_echoed_in_the_validation_error():
    """`--set 'tracking.ui_url=http://alice:Kv8Q z3Wm7Tx2@h:5000'` is no URL (a space), and the validation error
    quoted it whole: the free-text pattern ends a password at a space. The value a field was given is one value:
    its userinfo runs to its last '@', redacted whatever it holds."""
    from jagg_core.setup.redact import redact

    password = "Kv8Qz3 Wm7Tx2ab"
    with pytest.raises(ParamsError) as e:
        load_params(PARAMS, "ci", {"tracking.ui_url": f"http://alice:{password}@127.0.0.1:5000"})
    shown = _one_sentence(redact(str(e.value)))
    assert "tracking.ui_url" in shown and "alice:***@127.0.0.1:5000" in shown, shown
    assert not any(p in shown for p in ["Kv8Qz3", "Wm7Tx2ab", password]), shown


# --- a secret field's value in no error, whatever its type; a URL's query ------------------------------------------

TOKEN = 98765432109876
# a secret given in each shape YAML can give it; the 4 k string is too long for a token (its first 80 characters
# were quoted)
_SHAPES = {"a number": TOKEN, "a list": [TOKEN, "Lq8Wz3Xc5Vb"], "a mapping": {"k": TOKEN, "j": "Lq8Wz3Xc5Vb"},
           "a 4 k string": "Zr4Kw9" * 700}


def _pieces_of(value) -> list[str]:
    from jagg_core.setup.redact import _scalars

    return sorted(_scalars([value]) | {s[:20] for s in _scalars([value])})


def _secret_options():
    """Every option a registered plugin takes whose value is a secret (its name a secret word, or its spec's mark):
    the served reward's token and whatever a plugin adds, each as the override that sets it."""
    from jagg_core.setup.redact import _is_secret_key
    from jagg_core.setup.registry import backbone_names, backbone_spec, reward_names, reward_spec

    load_params(PARAMS, "ci")  # the plugins loaded
    found = [(f"reward.options.{n}", k) for n in reward_names() for k in reward_spec(n).options
             if _is_secret_key(k) or k in reward_spec(n).secret]
    found += [("model.options", k) for n in backbone_names() for k in backbone_spec(n).options
              if _is_secret_key(k) or k in backbone_spec(n).secret]
    return found


@pytest.mark.parametrize("shape", _SHAPES)
def test_a_secret_fields_value_is_in_no_validation_error_whatever_its_type(shape):
    """`--set reward.options.served.token=98765432109876` (a number, a list, a mapping, a 4 k string) was echoed in
    clear: "… token = 98765432109876 is invalid". Every secret option of every registered plugin (and one a
    plugin marks secret, typed as a count so that the quoted-number check speaks too) is refused without its value."""
    from jagg_core.setup import registry
    from jagg_core.setup.registry import RewardSpec

    value = _SHAPES[shape]
    registry.add("reward", RewardSpec("vault-count", lambda **_: None, options={"pin": (int, None)}, secret=("pin",)))
    try:
        options = [*_secret_options(), ("reward.options.vault-count", "pin")]
        assert ("reward.options.served", "token") in options
        for where, key in options:
            for given in (value, str(TOKEN)) if key == "pin" else (value,):
                try:
                    params = load_params(PARAMS, "ci", {f"{where}.{key}": given})
                except ParamsError as e:
                    shown = _one_sentence(str(e))
                    assert f"{key} = ***" in shown or f"{where}." in shown, shown
                    assert not any(p in shown for p in _pieces_of(given)), shown
                else:  # taken: then redacted wherever params are written
                    assert not any(p in repr(params.redacted()) for p in _pieces_of(given))
    finally:
        registry.remove("reward", "vault-count")


def test_a_secret_given_in_any_shape_is_not_printed_by_plan_train_or_run(tmp_path, monkeypatch, capsys):
    """The issue's three commands, as a user types them (in process: the same `main` the `jagg` command calls)."""
    from flows.cli import main

    shutil.copy(PARAMS, tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    for command, more in (("plan", []), ("train", ["--method", "jagg"]), ("run", [])):
        for shape, value in (("a number", TOKEN), ("a list", "[98765432109876, Lq8Wz3Xc5Vb]")):
            rc = main([command, "--profile", "ci", *more, "--set", f"reward.options.served.token={value}"])
            err = capsys.readouterr().err.strip()
            assert rc == 1 and f"token = *** ({shape}) is invalid" in err, (command, err)
            assert str(TOKEN) not in err and "Lq8Wz3Xc5Vb" not in err, (command, err)


def test_an_errors_input_is_quoted_only_through_invalid_value():
    """The rule behind the test above, for the next check that quotes a value: a pydantic error's ``input`` (what a
    user gave) is read only as an argument of ``redact.invalid_value``, which hides a secret field's value whatever
    its type. An ast walk of jagg_core, tasks and flows."""
    import ast

    from conftest import REPO

    found = []
    for path in [p for d in ("jagg_core", "tasks", "flows") for p in (REPO / d).rglob("*.py")]:
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            reads = (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                     and node.slice.value == "input"
                     or isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                     and node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant)
                     and node.args[0].value == "input")
            if not reads or isinstance(parents.get(node), ast.Compare):  # `"input" in err` is no read
                continue
            call = parents.get(node)
            name = getattr(getattr(call, "func", None), "id", getattr(getattr(call, "func", None), "attr", ""))
            if not (isinstance(call, ast.Call) and name in ("invalid_value", "isinstance")):  # quoted, or its type
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"a validation error's input quoted outside redact.invalid_value: {found}"


def test_a_urls_query_is_secret_in_stored_params_and_in_messages():
    """`reward.options.served.url: http://…/score?api_key=…` was hidden in messages (the served reward shows its
    address without the query) but in clear in MLflow's params, params.json and state.json (`Params.redacted()`).
    Every value of a URL's query is `***` there and in anything redacted; a key-like one is remembered on its own."""
    from jagg_core.pipeline.tracking import param_strings
    from jagg_core.setup.redact import holds_secret, redact

    key = "QK3yS3cretA9"
    url = f"http://127.0.0.1:9/score?api_key={key}&v=2"
    params = load_params(PARAMS, "ci", {"reward.options": {"served": {"url": url}},
                                        "tracking.ui_url": "http://h:5000/?sig=Hx7Nq2Lp5Rt"})
    stored = params.redacted()
    assert stored["reward"]["options"]["served"]["url"] == "http://127.0.0.1:9/score?api_key=***&v=***"
    assert stored["tracking"]["ui_url"] == "http://h:5000/?sig=***"
    assert key not in repr(param_strings(params.masked())) and "Hx7Nq2Lp5Rt" not in repr(stored)
    shown = redact(f"GET {url} failed; {key} refused")
    assert shown == "GET http://127.0.0.1:9/score?api_key=***&v=*** failed; *** refused", shown
    assert holds_secret(f"s-http://h/?x={key}")  # a name (a sweep's, an experiment's) holding a query is refused


# --- secrets where they would name something: refused --------------------------------------------------------------


@pytest.mark.parametrize("experiment, extra", [
    (f"jagg-{{profile}}-http://alice:{PASSWORD}@mlflow.example", {}),  # a URL's credentials in the name
    (f"jagg-{{profile}}-{PASSWORD}", {"reward.options": {"served": {"url": "http://127.0.0.1:9/score",
                                                                    "token": PASSWORD}}}),  # a secret param's value
])
def test_m3_a_password_in_the_experiment_name_never_reaches_mlflows_experiments_table(tmp_path, experiment, extra):
    """`--set tracking.experiment=…<password>…` created an MLflow experiment of that name: the password in clear in
    the experiments table of every store it was logged to. Now the name is refused with one sentence (a redacted
    name would not be the one given, and two passwords would share it), before any store is opened."""
    from jagg_core.pipeline.tracking import Tracker
    from jagg_core.setup.redact import redact

    db = tmp_path / "mlflow.db"
    overrides = {"tracking.experiment": experiment, "tracking.mlflow_uri": f"sqlite:///{db}", **extra}
    try:
        params = load_params(PARAMS, "ci", overrides)
    except ParamsError as e:
        shown = _one_sentence(redact(str(e)))  # what `jagg …` prints
        assert "tracking.experiment holds a secret" in shown, shown
        assert not any(p in shown for p in _pieces(PASSWORD)), shown
    else:
        Tracker(params, tmp_path)  # opens (creates) the experiment, as every stage does
    if db.exists():
        assert _sqlite_cells_holding(db, _pieces(PASSWORD)) == [], "the password is in mlflow.db"
    assert not db.exists(), "a store was opened for params that hold a secret in a name"


def _prefect_env(root: Path) -> dict[str, str]:
    return {"PREFECT_HOME": str(root / ".prefect"), "PREFECT_API_URL": ""}


def test_m3_a_params_path_holding_a_urls_password_is_neither_printed_nor_stored_by_prefect(ci_project):
    """`jagg run --params http://alice:<pw>@host/params.yaml`: the "does not exist" sentence printed the password (the
    path's `//` became `/`, which the URL pattern did not take for a URL), and where such a path exists the flow run's
    parameters in Prefect's database held it. Now a params path with a URL's credentials is refused in one redacted
    sentence before Prefect starts; the pattern also takes a path's `scheme:/` for a URL."""
    url = f"http://alice:{PASSWORD}@files.example/params.yaml"
    missing = run_module("flows.run", "--profile", "ci", "--params", url, root=ci_project,
                         env=_prefect_env(ci_project), timeout=600)
    text = missing.stdout + missing.stderr
    assert missing.returncode == 1, text[-3000:]
    assert "alice:***@" in _one_sentence(missing.stderr.strip().splitlines()[-1]), text[-3000:]
    # The same path as a file that exists (`http:/alice:<pw>@files.example/params.yaml` under the project). On main
    # the flow started (Prefect stored the path) and failed at its first MLflow call (a store nothing listens on).
    planted = ci_project / "http:" / f"alice:{PASSWORD}@files.example" / "params.yaml"
    planted.parent.mkdir(parents=True)
    shutil.copy(ci_project / "params.yaml", planted)
    present = run_module("flows.run", "--profile", "ci", "--params", url, "--set", "run.methods=[jagg]",
                         "--set", "tracking.mlflow_uri=http://127.0.0.1:9/", "--set", "tracking.retries=0",
                         root=ci_project, env=_prefect_env(ci_project), timeout=900)
    both = text + present.stdout + present.stderr
    assert present.returncode == 1, both[-3000:]
    for piece in _pieces(PASSWORD):
        assert piece not in both, f"{piece!r} was printed"
    db = ci_project / ".prefect" / "prefect.db"
    if db.exists():
        assert _sqlite_cells_holding(db, _pieces(PASSWORD)) == [], "Prefect's database holds the password"
    from jagg_core.setup.redact import redact

    assert redact(f"{Path(url)} does not exist") == "http:/alice:***@files.example/params.yaml does not exist"


def test_m3_a_sweep_points_folder_covers_only_what_changes_results_and_hashes_no_secret():
    """A sweep point's folder digest hashed every override: `resources.num_threads` or a rotated password beside
    `train.iterations` retrained the whole sweep in a new folder, and a served reward's token (a secret) was hashed
    into a folder name. Now tracking.* and resources.* are no part of it, secrets are hashed redacted, and a point
    without either keeps the folder it had (so existing sweep points keep theirs)."""
    from flows.reproduce import flow_params

    point = {"train.iterations": 8, "jagg.window": 2}
    plain = flow_params("ci", overrides=point).outputs
    assert plain == "ci-91f2a6db"  # main's name for this point: unchanged
    assert flow_params("ci", overrides={**point, "resources.num_threads": 1}).outputs == plain
    assert flow_params("ci", overrides={**point, "tracking.retries": 1,
                                        "tracking.mlflow_uri": f"http://bob:{PASSWORD}@127.0.0.1:9/"}).outputs == plain

    def served(token: str, url: str = "http://127.0.0.1:9/score") -> str:
        return flow_params("ci", overrides={**point, "reward.options": {"served": {"url": url, "token": token}}}).outputs

    assert served("tokA-" + PASSWORD) == served("tokB-" + PASSWORD[::-1]) != plain  # the token: not hashed
    assert served("t0k3n", f"http://alice:{PASSWORD}@127.0.0.1:9/score") == served(
        "t0k3n", "http://alice:an0ther-pw@127.0.0.1:9/score")  # a URL's password: not hashed
    assert served("t0k3n", "http://127.0.0.1:9/score") != served("t0k3n", "http://127.0.0.1:8/score")  # the host is


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
                     "--set", f"tracking.ui_url=http://admin:{secret}@127.0.0.1:5000",
                     "--set", "reward.options={served: {url: 'http://127.0.0.1:9/score?api_key=Qk4Rz8Wm2Tx'}}",
                     root=ci_project)
    assert out.returncode == 0, out.stderr[-2000:]
    assert secret not in out.stdout + out.stderr  # the launcher logs the worker's command line
    written = [p for p in ci_project.rglob("*.json") if "mlflow" not in p.name]
    assert any(p.name == "state.json" for p in written) and any(p.name == "params.json" for p in written)
    for p in written:  # a URL's query (the served reward's api_key) too: it was in clear in all three stores
        assert secret not in p.read_text() and "Qk4Rz8Wm2Tx" not in p.read_text(), p
    with sqlite3.connect(store) as db:
        values = [v for (v,) in db.execute("select value from params")]
    assert values and not any(secret in v or "Qk4Rz8Wm2Tx" in v for v in values)
    assert not list(ci_project.rglob(".worker-context-*"))  # the launcher's private file is gone


@dataclass
class CredentialedRun:
    """One whole `jagg run` with a password in every place mechanism 3 and round 4 found one leaking."""

    root: Path
    printed: str
    returncode: int


@pytest.fixture(scope="module")
def credentialed_run(ci_base, tmp_path_factory) -> CredentialedRun:
    """One `jagg run --profile ci` sweep point (a temporary Prefect server, a live MLflow server; ~1-2 min) that the
    two tests below read, each for its own passwords (they each ran one such run: the suite's time): tracking.ui_url
    with :data:`UI_PASSWORD` ('/', '#', '?' and '@'), tracking.mlflow_uri reaching the live server with
    :data:`STORE_PASSWORD` ('@'), a served reward's URL and token with :data:`PASSWORD` (a section that changes
    results, so in the point's digest) and a thread count beside them. Tests copy the project before they write."""
    root = tmp_path_factory.mktemp("credentialed") / "project"
    shutil.copytree(ci_base, root)
    server = _MlflowServer(root)
    server.start()
    ui = f"http://alice:{UI_PASSWORD}@127.0.0.1:5000"
    store = f"http://bob:{STORE_PASSWORD}@127.0.0.1:{server.port}/"
    served = f"{{served: {{url: 'http://alice:{PASSWORD}@127.0.0.1:9/score', token: '{PASSWORD}'}}}}"
    try:
        out = run_module("flows.run", "--profile", "ci", "--set", "run.methods=[jagg]", "--set", "train.iterations=1",
                         "--set", f"tracking.ui_url={ui}", "--set", f"tracking.mlflow_uri={store}",
                         "--set", f"reward.options={served}", "--set", "resources.num_threads=1",
                         root=root, env=_prefect_env(root), timeout=900)
    finally:
        server.stop()
    return CredentialedRun(root, out.stdout + out.stderr, out.returncode)


@pytest.mark.slow  # reads the module's one credentialed `jagg run` (a temporary Prefect server, a live MLflow server)
def test_c1_a_credentialed_jagg_run_leaves_no_password_anywhere(credentialed_run):
    """`jagg run --profile ci` with credentials in every URL field (tracking.ui_url: a password holding '/', '#',
    '?' and '@'; tracking.mlflow_uri: a live server reached with a password holding '@'): no piece of either password
    is in mlflow.db, mlruns/, Prefect's database (artifacts, artifact collections, events, flow-run parameters, logs,
    read row by row and as bytes), runs/, eval/, reports/, any other file of the project, or the output. (Round 4:
    the MLflow link artifact and the report's markdown held the UI's password, in `artifact`, `artifact_collection`
    and the events.)"""
    root, text = credentialed_run.root, credentialed_run.printed
    assert credentialed_run.returncode == 0, text[-4000:]
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


@pytest.mark.slow  # reads the module's one credentialed `jagg run` sweep point, in a copy, after three refused starts
def test_m3_a_planted_password_is_in_no_store_no_file_and_no_folder_name(credentialed_run, tmp_path):
    """The password planted wherever mechanism 3 found it leaking: refused at once (the experiment's name, a params
    path with a URL's credentials, a UI URL with a space in its password), then a whole `jagg run` sweep point with
    it in a served reward's URL and token (a section that changes results, so in the point's digest), a password in
    the UI's URL (tracking.*: the module's run holds :data:`UI_PASSWORD` there) and a thread count beside them. No
    piece of either is in mlflow.db (the experiments table included), Prefect's database (flow-run parameters, logs,
    events, artifacts), any file or folder name of the project, or what was printed."""
    root = tmp_path / "project"
    shutil.copytree(credentialed_run.root, root)  # the refused starts below run in the run's project, a copy of it
    env = _prefect_env(root)
    printed = credentialed_run.printed
    assert credentialed_run.returncode == 0, printed[-4000:]
    for args in (["--set", f"tracking.experiment=jagg-{{profile}}-{PASSWORD}",
                  "--set", f"tracking.ui_url=http://alice:{PASSWORD}@127.0.0.1:5000"],
                 ["--params", f"http://alice:{PASSWORD}@files.example/params.yaml"],
                 ["--set", f"tracking.ui_url=http://alice:{PASSWORD[:6]} {PASSWORD[6:]}@127.0.0.1:5000"]):
        refused = run_module("flows.run", "--profile", "ci", *args, root=root, env=env, timeout=300)
        printed += refused.stdout + refused.stderr
        assert refused.returncode == 1, printed[-3000:]
        _one_sentence(refused.stderr.strip().splitlines()[-1])
    points = [p.name for p in (root / "runs").iterdir() if p.name.startswith("ci-")]
    assert len(points) == 1 and (root / "reports" / points[0] / "index.html").exists(), points  # it ran, as a point
    needles = _pieces(PASSWORD) + _pieces(UI_PASSWORD)
    mlflow_db, prefect_db = root / "mlflow.db", root / ".prefect" / "prefect.db"
    assert mlflow_db.exists() and prefect_db.exists(), "a store was not written: the grep would prove nothing"
    con = sqlite3.connect(f"file:{mlflow_db}?mode=ro", uri=True)
    try:
        assert "jagg-ci" in [r[0] for r in con.execute("select name from experiments")]  # (and MLflow's Default)
        assert con.execute("select count(*) from params").fetchone()[0] > 0
    finally:
        con.close()
    assert _sqlite_cells_holding(mlflow_db, needles) == []
    assert _sqlite_cells_holding(prefect_db, needles) == []
    for needle in needles:
        assert _files_holding(root, needle.encode()) == [], f"{needle!r} reached the project's files"
        assert not [p for p in root.rglob("*") if needle in p.name], f"{needle!r} names a file or folder"
        assert needle not in printed, f"{needle!r} was printed"
