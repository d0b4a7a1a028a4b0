"""Each profile's DVC pipeline (pipelines/<profile>/dvc.yaml, written by tasks/dvc_pipelines.py) runs that profile's
runs: what `dvc stage list` shows is what `jagg run --profile <it>` trains, and `dvc exp run -S` / an edit of the key
its sweep is read from changes the stages. Listing only parses, so the real backbones' profiles are checked too."""

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
from tasks.dvc_pipelines import GENERATED, pipelines, profile_names, stale

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
    _dvc(root, "init", "--no-scm", "-q")
    return root


def _listed(root: Path) -> dict[str, set[str]]:
    """profile -> the stages `dvc stage list --all` shows in its pipeline."""
    out: dict[str, set[str]] = {}
    for line in _dvc(root, "stage", "list", "--all", "--name-only").stdout.split():
        path, _, stage = line.rpartition(":")
        assert re.fullmatch(r"pipelines/[\w-]+/dvc\.yaml", path), line
        out.setdefault(path.split("/")[1], set()).add(stage)
    return out


def _runs(params_path: Path, profile: str) -> set[str]:
    run = load_params(params_path, profile).run
    return {f"{m}-{s}" for m in run.methods for s in run.seeds}


def test_the_written_pipelines_are_what_the_generator_writes():
    """Edit pipelines/template.yaml or params.yaml's profiles, then run `python -m tasks.dvc_pipelines`."""
    assert stale(REPO) == [], "run `python -m tasks.dvc_pipelines` (make pipelines)"
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    assert set(pipelines(REPO)) == {Path("pipelines") / p / "dvc.yaml" for p in profile_names(raw)}
    assert not (REPO / "dvc.yaml").exists()  # one pipeline per profile, none of them the repository's default


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
            assert stage["wdir"] == "../..", (profile, name)
            assert re.match(rf"python -m tasks\.\w+ --profile {re.escape(profile)}( |$)", stage["cmd"]), stage["cmd"]
            params = stage["params"]
            assert "profile" not in params  # the command is given its profile; params.yaml's key is not read
            assert f"profiles.{profile}" in params, (profile, name)


def test_a_profile_that_gains_a_run_key_needs_its_pipeline_written_again(tmp_path):
    """A pipeline reads `${run.seeds}` where the profile's overlay does not set them; once it does, the pipeline is
    stale until the generator runs (make repro checks it first)."""
    (tmp_path / "pipelines").mkdir()
    shutil.copy(REPO / "pipelines/template.yaml", tmp_path / "pipelines/template.yaml")
    text = (REPO / "params.yaml").read_text()
    (tmp_path / "params.yaml").write_text(text)
    for path, body in pipelines(tmp_path).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(body)
    assert stale(tmp_path) == []
    toy = "    run: {methods: [baseline, exact-batched, jagg, ablate]}\n"
    assert toy in text
    (tmp_path / "params.yaml").write_text(text.replace(toy, toy.replace("]}", "], seeds: [0, 1]}"), 1))
    assert stale(tmp_path) == ["pipelines/toy/dvc.yaml"]
    assert "${profiles.toy.run.seeds}" in pipelines(tmp_path)[Path("pipelines/toy/dvc.yaml")]
    out = subprocess.run([sys.executable, "-m", "tasks.dvc_pipelines", "--check"], cwd=tmp_path, capture_output=True,
                         text=True, env={**os.environ, "JAGG_ROOT": str(tmp_path), "PYTHONPATH": str(REPO)})
    assert out.returncode == 1 and "pipelines/toy/dvc.yaml" in out.stderr, out.stderr


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
