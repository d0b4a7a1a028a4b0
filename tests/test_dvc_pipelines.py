"""Each profile's DVC pipeline (written by tasks/dvc_pipelines.py: the active profile's is the root's dvc.yaml, every
other one's pipelines/<profile>/dvc.yaml) runs that profile's runs: what `dvc stage list` shows is what `jagg run
--profile <it>` trains, and `dvc exp run -S` / an edit of the key its sweep is read from changes the stages. Listing
only parses, so the real backbones' profiles are checked too. Changing params.yaml's `profile` and running the
generator moves the root pipeline and its dvc.lock."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from jagg_core.setup.params_io import load_params
from jagg_core.setup.config import ParamsError
from tasks.dvc_pipelines import GENERATED, active_profile, pipelines, profile_names, stale, write

BIN = Path(sys.executable).parent
OTHER_STAGES = {"prepare", "pretrain", "evaluate-base", "speed", "report"}


def _dvc(root: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    out = subprocess.run([str(BIN / "dvc"), *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"dvc {' '.join(args)}: {out.stdout[-2000:]}{out.stderr[-2000:]}"
    return out


def _dvc_project(tmp_path: Path) -> Path:
    """A DVC project holding this checkout's params.yaml and pipelines (enough for DVC to parse them)."""
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    shutil.copytree(REPO / "pipelines", root / "pipelines", ignore=shutil.ignore_patterns("dvc.lock"))
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    _dvc(root, "init", "--no-scm", "-q")
    return root


def _listed(root: Path) -> dict[str, set[str]]:
    """profile -> the stages `dvc stage list --all` shows in its pipeline (the root's: the active profile's, its stages
    named without a path)."""
    out: dict[str, set[str]] = {}
    active = active_profile(yaml.safe_load((root / "params.yaml").read_text()))
    for line in _dvc(root, "stage", "list", "--all", "--name-only").stdout.split():
        path, _, stage = line.rpartition(":")
        assert path == "" or re.fullmatch(r"pipelines/[\w-]+/dvc\.yaml", path), line
        out.setdefault(path.split("/")[1] if path else active, set()).add(stage)
    return out


def _runs(params_path: Path, profile: str) -> set[str]:
    run = load_params(params_path, profile).run
    return {f"{m}-{s}" for m in run.methods for s in run.seeds}


def test_the_written_pipelines_are_what_the_generator_writes():
    """Edit pipelines/template.yaml or params.yaml's profiles, then run `python -m tasks.dvc_pipelines`."""
    assert stale(REPO) == [], "run `python -m tasks.dvc_pipelines` (make pipelines)"
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    active = active_profile(raw)
    assert set(pipelines(REPO)) == {Path("dvc.yaml")} | {Path("pipelines") / p / "dvc.yaml"
                                                         for p in profile_names(raw) if p != active}


def test_the_active_profiles_pipeline_is_the_root_dvc_yaml_and_only_there():
    """params.yaml's `profile` (toy): its pipeline is ./dvc.yaml (a bare `dvc repro` runs it), not also under
    pipelines/ (DVC refuses two stages with one output); DVC loads the root's params.yaml itself and refuses it in
    `vars`, so the root file has none and no `wdir`; every other profile's reads ../../params.yaml."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    active = active_profile(raw)
    assert active == raw["profile"] == "toy"
    root = yaml.safe_load((REPO / "dvc.yaml").read_text())
    text = (REPO / "dvc.yaml").read_text()
    assert "vars" not in root and not re.search(r"(?m)^vars:|^\s*- \S*params\.yaml:", text)
    for name, stage in root["stages"].items():
        assert f"--profile {active}" in stage["cmd"] and "wdir" not in stage, name
    assert root["stages"]["train"]["matrix"]["method"] == f"${{profiles.{active}.run.methods}}"
    assert not (REPO / "pipelines" / active).exists()
    for path in (REPO / "pipelines").glob("*/dvc.yaml"):
        assert yaml.safe_load(path.read_text())["vars"] == ["../../params.yaml:run,profiles"], path


def test_what_dvc_exp_run_set_writes_into_params_yaml_dvc_reads_back(tmp_path):
    """`dvc exp run -S KEY=VALUE` rewrites params.yaml through ruamel.yaml's round-trip emitter, then DVC reads it
    with its safe loader. The emitter leaves a URL unquoted inside a flow mapping (``{url: http://host:9/score}``):
    ruamel.yaml's pure-Python parser reads that back, its C parser (ruamel.yaml.clib, YAML 1.1's rule on ':') refuses
    it. Declaring ruamel.yaml.clib (2026-12-06, for DVC's speed: an index of the repository 3.5 -> 2.2 s of CPU) broke
    the DVC experiment of tests/test_dvc_repro.py, whose params hold a served reward's URL so: this is that check in
    a second, whichever parser a later dependency brings."""
    from dvc.utils.hydra import apply_overrides
    from dvc.utils.serialize import load_yaml

    params = tmp_path / "params.yaml"
    text = (REPO / "params.yaml").read_text()
    reward = "    reward: {weights: {toy_fidelity: 1.0, toy_preference: 1.0}}\n"
    assert text.count(reward) == 1
    params.write_text(text.replace(reward, reward[:-2] + ", options: {served: {url: 'http://127.0.0.1:9/score'}}}\n"))
    apply_overrides(str(params), ["profiles.ci.train.iterations=3"])
    loaded = load_yaml(str(params))
    assert loaded["profiles"]["ci"]["train"]["iterations"] == 3
    assert loaded["profiles"]["ci"]["reward"]["options"]["served"]["url"] == "http://127.0.0.1:9/score"
    assert loaded == yaml.safe_load(params.read_text())  # and what the stages' own loader reads, the same


def test_dvc_lists_exactly_each_profiles_runs(tmp_path):
    """For every profile of params.yaml, `dvc stage list` has a train@ and an evaluate@ stage per run that `jagg run
    --profile <it>` trains (its methods x its seeds, the overlay merged by load_params), and nothing else."""
    root = _dvc_project(tmp_path)
    listed = _listed(root)
    profiles = profile_names(yaml.safe_load((REPO / "params.yaml").read_text()))
    assert set(listed) == set(profiles)
    assert {"toy", "toy-full", "toy-w", "toy-mix", "ci", "flux-fast", "flux", "wan"} <= set(profiles)
    for profile in profiles:
        runs = _runs(REPO / "params.yaml", profile)
        want = {f"train@{r}" for r in runs} | {f"evaluate@{r}" for r in runs} | OTHER_STAGES
        assert listed[profile] == want, profile
    assert len({s for s in listed["toy-full"] if s.startswith("train@")}) == 40  # docs/results.md: 4 methods x 10
    assert len({s for s in listed["toy-w"] if s.startswith("train@")}) == 70  # docs/frontier.md: 7 methods x 10
    assert "train@jagg-k3-9" in listed["toy-w"]  # a method the profile's overlay adds
    assert "train@exact-batched-0" in listed["toy"]  # the toy overlay's run.methods, not the top-level's


def test_an_edit_of_the_key_a_sweep_comes_from_changes_the_stages(tmp_path):
    """What `dvc exp run -S KEY=...` does before it reproduces: params.yaml edited, the pipeline parsed again."""
    root = _dvc_project(tmp_path)
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["profiles"]["toy-full"]["run"]["seeds"] = [3, 11]  # toy-full's own seeds
    params["run"]["methods"] = ["jagg", "ablate-matched"]  # the top-level methods: ci's, not toy's (it has its own)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    listed = _listed(root)
    for profile in ("toy-full", "ci", "toy"):
        runs = _runs(root / "params.yaml", profile)
        assert {s for s in listed[profile] if s.startswith("train@")} == {f"train@{r}" for r in runs}, profile
    assert {s for s in listed["ci"] if s.startswith("train@")} == {"train@jagg-0", "train@ablate-matched-0"}
    assert len({s for s in listed["toy-full"] if s.startswith("train@")}) == 8


def test_every_command_runs_its_profile_at_the_repository_root():
    for path, text in pipelines(REPO).items():
        profile = path.parent.name
        assert text.startswith(GENERATED)
        for name, stage in yaml.safe_load(text)["stages"].items():
            if path == Path("dvc.yaml"):
                profile = active_profile(yaml.safe_load((REPO / "params.yaml").read_text()))
                assert "wdir" not in stage, name  # at the root already
            else:
                assert stage["wdir"] == "../..", (profile, name)
            assert re.match(rf"python -m tasks\.\w+ --profile {re.escape(profile)}( |$)", stage["cmd"]), stage["cmd"]
            params = stage["params"]
            assert "profile" not in params  # the command is given its profile; params.yaml's key is not read
            # the overlay's keys it reads (issue 61): never the whole overlay, each under a top-level key it reads
            assert f"profiles.{profile}" not in params, (profile, name)
            tops = [k.split(".${")[0] for k in params if not k.startswith("profiles.")] + ["run"]
            for key in (k.removeprefix(f"profiles.{profile}.") for k in params if k.startswith("profiles.")):
                assert any(key == t or key.startswith(t + ".") or t.startswith(key + ".") for t in tops), (name, key)


def _generated(root: Path, profiles: tuple[str, ...] = ()) -> Path:
    """A project holding the template and this checkout's params.yaml (only ``profiles``' overlays, if given: each
    profile is loaded to write its pipeline), its pipelines written by the generator."""
    (root / "pipelines").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "pipelines/template.yaml", root / "pipelines/template.yaml")
    text = (REPO / "params.yaml").read_text()
    if profiles:
        raw = yaml.safe_load(text)
        raw["profiles"] = {p: raw["profiles"][p] for p in profiles}
        text = yaml.safe_dump(raw, sort_keys=False)
    (root / "params.yaml").write_text(text)
    write(root)
    assert stale(root) == []
    return root


def _set_profile(root: Path, profile: str, text: str | None = None) -> None:
    text = text if text is not None else (root / "params.yaml").read_text()
    (root / "params.yaml").write_text(re.sub(r"(?m)^profile: \S+", f"profile: {profile}", text, count=1))


def _check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tasks.dvc_pipelines", "--check"], cwd=root, capture_output=True,
                          text=True, env={**os.environ, "JAGG_ROOT": str(root), "PYTHONPATH": str(REPO)})


def _lock(profile: str) -> str:
    """A dvc.lock as DVC writes it for ``profile``'s pipeline (its commands carry the profile)."""
    return f"schema: '2.0'\nstages:\n  prepare:\n    cmd: python -m tasks.prepare --profile {profile}\n"


def test_a_profile_that_gains_a_run_key_needs_its_pipeline_written_again(tmp_path):
    """A pipeline reads `${run.seeds}` where the profile's overlay does not set them; once it does, the pipeline is
    stale until the generator runs (make repro checks it first)."""
    _generated(tmp_path)
    text = (tmp_path / "params.yaml").read_text()
    toy = "    run: {methods: [baseline, exact-batched, jagg, ablate]}\n"
    assert toy in text
    (tmp_path / "params.yaml").write_text(text.replace(toy, toy.replace("]}", "], seeds: [0, 1]}"), 1))
    assert stale(tmp_path) == ["dvc.yaml"]  # toy is the active profile: its pipeline is the root's
    assert "${profiles.toy.run.seeds}" in pipelines(tmp_path)[Path("dvc.yaml")]
    out = _check(tmp_path)
    assert out.returncode == 1 and "dvc.yaml" in out.stderr, out.stderr


def test_check_catches_a_missing_or_stale_root_pipeline_and_a_hand_written_one_is_kept(tmp_path):
    root = _generated(tmp_path, ("toy", "ci"))
    text = (root / "dvc.yaml").read_text()
    (root / "dvc.yaml").unlink()
    assert stale(root) == ["dvc.yaml"]
    out = _check(root)
    assert out.returncode == 1 and "dvc.yaml" in out.stderr, out.stderr
    (root / "dvc.yaml").write_text(text.replace("--profile toy --run base", "--profile toy --run base --x"))
    assert stale(root) == ["dvc.yaml"]
    write(root)
    assert (root / "dvc.yaml").read_text() == text and stale(root) == []
    (root / "dvc.yaml").write_text("stages: {mine: {cmd: echo}}\n")  # a user's own: not overwritten
    with pytest.raises(ParamsError, match="was not written by"):
        write(root)
    assert (root / "dvc.yaml").read_text() == "stages: {mine: {cmd: echo}}\n"


def test_changing_profile_moves_the_root_pipeline_and_its_dvc_lock(tmp_path):
    """toy active, with its dvc.lock at the root and ci's beside ci's pipeline; `profile: ci` then the generator:
    ci's pipeline and lock come to the root, toy's go to pipelines/toy/, no pipeline file is left twice; and back."""
    root = _generated(tmp_path, ("toy", "ci"))
    assert not (root / "pipelines/toy").exists() and (root / "pipelines/ci/dvc.yaml").is_file()
    (root / "dvc.lock").write_text(_lock("toy"))
    (root / "pipelines/ci/dvc.lock").write_text(_lock("ci"))
    ci_text = pipelines(root)[Path("pipelines/ci/dvc.yaml")]
    _set_profile(root, "ci")
    assert stale(root) == ["dvc.yaml", "pipelines/ci/dvc.lock", "pipelines/ci/dvc.yaml", "pipelines/toy/dvc.yaml"]
    write(root)
    assert stale(root) == []
    assert (root / "dvc.lock").read_text() == _lock("ci")
    assert (root / "pipelines/toy/dvc.lock").read_text() == _lock("toy")
    assert not (root / "pipelines/ci").exists()  # its pipeline and its lock moved: the folder went too
    assert "--profile ci" in (root / "dvc.yaml").read_text()
    assert "vars" not in yaml.safe_load((root / "dvc.yaml").read_text())
    assert (root / "pipelines/toy/dvc.yaml").read_text().startswith(GENERATED)
    assert (root / "dvc.yaml").read_text().split("\nstages:\n")[1] != ci_text.split("\nstages:\n")[1]  # no wdir
    _set_profile(root, "toy")
    write(root)
    assert stale(root) == [] and not (root / "pipelines/toy").exists()
    assert (root / "dvc.lock").read_text() == _lock("toy")
    assert (root / "pipelines/ci/dvc.lock").read_text() == _lock("ci")
    assert (root / "pipelines/ci/dvc.yaml").read_text() == ci_text


def test_a_checkout_from_before_gets_its_lock_at_the_root_and_two_locks_of_one_pipeline_are_both_kept(tmp_path):
    """A user's checkout of the per-profile layout: toy's pipeline and lock under pipelines/toy/. The generator
    moves the lock to the root beside toy's pipeline, never over a dvc.lock there (one sentence; both kept)."""
    root = _generated(tmp_path, ("toy", "ci"))
    (root / "pipelines/toy").mkdir()
    (root / "pipelines/toy/dvc.yaml").write_text(f"{GENERATED}\nvars:\n  - ../../params.yaml:run,profiles\n")
    (root / "pipelines/toy/dvc.lock").write_text(_lock("toy"))
    assert stale(root) == ["pipelines/toy/dvc.lock", "pipelines/toy/dvc.yaml"]  # make repro would lose the record
    write(root)
    assert (root / "dvc.lock").read_text() == _lock("toy") and not (root / "pipelines/toy").exists()
    (root / "pipelines/toy").mkdir()
    (root / "pipelines/toy/dvc.lock").write_text(_lock("toy") + "# older\n")
    with pytest.raises(ParamsError, match="both pipelines/toy/dvc.lock and dvc.lock exist"):
        write(root)
    assert (root / "dvc.lock").read_text() == _lock("toy")
    assert (root / "pipelines/toy/dvc.lock").read_text() == _lock("toy") + "# older\n"


@pytest.mark.slow
def test_a_param_change_on_toy_full_makes_exactly_its_stages_stale(tmp_path, monkeypatch):
    """toy-full's 85 stages recorded as done (stand-in outputs, `dvc commit`: nothing trains), then one method's param
    changed: `dvc status` on toy-full's pipeline names exactly that method's 10 trainings, speed and report."""
    from dvc.repo import Repo

    root = tmp_path / "clone"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        if (REPO / f).is_file() and not f.startswith(".venv"):
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, root / f)
    target = "pipelines/toy-full/dvc.yaml"
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)  # the copy's .dvc/ (its config) is the checkout's
    monkeypatch.chdir(root)  # DVC's output paths are relative to the working directory
    repo = Repo(str(root))
    stages = repo.stage.collect(target)
    assert len(stages) == 85
    for stage in stages:
        for out in stage.outs:
            path = root / Path(out.fs_path).resolve().relative_to(root)
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.suffix in (".json", ".tsv"):
                path.write_text("{}\n")
            else:
                path.mkdir(exist_ok=True)
                (path / "stand-in").write_text("x\n")
    (root / "data/toy-full/prompts/train.jsonl").write_text("{}\n")
    repo.close()
    _dvc(root, "commit", "--force", "-q", target, timeout=600)
    assert (root / "pipelines/toy-full/dvc.lock").is_file()  # each pipeline's lock beside it

    def stale_stages() -> set[str]:
        out = _dvc(root, "status", "--json", target, timeout=600).stdout
        return {k.rpartition(":")[2] for k in json.loads(out or "{}")}

    assert stale_stages() == set()
    text = (root / "params.yaml").read_text()
    (root / "params.yaml").write_text(text.replace("  jagg: {mode: jagg}\n", "  jagg: {mode: jagg, jagg_frac: 0.5}\n"))
    assert stale_stages() == {f"train@jagg-{s}" for s in range(10)} | {"speed", "report"}


def test_every_params_key_a_stage_lists_is_in_params_yaml(tmp_path, monkeypatch):
    """DVC refuses to run a stage one of whose params keys params.yaml does not hold (MissingParamsError, before its
    command). Before: toy-w's train stages listed `methods.${item.method}` for methods only its overlay defines
    (`jagg-w4`, `jagg-k3`, …: `profiles.toy-w.methods`), so `dvc repro` of toy-w stopped at `train@jagg-w4-0` with
    "Parameters 'methods.jagg-w4' are missing from 'params.yaml'". Each stage's params read by DVC's own code."""
    import dpath
    from dvc.dependency.param import ParamsDependency, read_param_file
    from dvc.repo import Repo

    root = _dvc_project(tmp_path)
    monkeypatch.chdir(root)
    missing, loaded = [], {}
    with Repo(str(root)) as repo:
        deps = [(s, d) for s in repo.index.stages for d in s.deps if isinstance(d, ParamsDependency)]
        for stage, dep in deps:  # what dep.read_params() does, each file loaded once (0.15 s a load)
            if dep.fs_path not in loaded:
                loaded[dep.fs_path] = read_param_file(repo.fs, dep.fs_path)
            for key in dep.params:
                try:
                    dpath.get(loaded[dep.fs_path], key, separator=".")
                except KeyError:
                    missing.append(f"{stage.addressing}: {key}")
    assert len(deps) > 300 and missing == [], missing[:10]


def test_a_bare_dvc_repro_of_a_root_pipeline_written_for_another_profile_is_one_sentence(tmp_path):
    """params.yaml's ``profile:`` changed (toy → ci) and ``make pipelines`` not run: a bare ``dvc repro`` ran toy's
    stages without a word (``make repro`` checks, ``dvc repro`` did not); now the root pipeline's first stage, run by
    DVC itself, is one sentence naming both profiles and `make pipelines`, rc 1, nothing written."""
    root = _dvc_project(tmp_path)
    text = (root / "params.yaml").read_text()
    (root / "params.yaml").write_text(re.sub(r"^profile: toy\b", "profile: ci", text, count=1, flags=re.M))
    # the root pipeline's first stage as written, its dependencies left out (this project holds no code to hash)
    prepare = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]["prepare"]
    assert prepare["cmd"] == "python -m tasks.prepare --profile toy"
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"prepare": {"cmd": prepare["cmd"],
                                                                         "outs": prepare["outs"]}}}))
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(REPO), "JAGG_ROOT": str(root)}
    out = subprocess.run([str(BIN / "dvc"), "repro", "prepare"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    said = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("jagg: error:")]
    assert len(said) == 1 and "written for profile 'toy', but params.yaml's profile is now 'ci'" in said[0], said
    assert "make pipelines" in said[0]
    assert not (root / "data").exists()  # nothing prepared
