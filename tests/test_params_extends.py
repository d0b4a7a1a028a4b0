"""Issue 61, mechanism 7 (nothing silently defaulted): a user's params file extends the project's (`extends:`), a file
that does not extend it says so, one never changes a profile of the project's (issue 71), the pipelines generator
takes no other params file than the project's, and every sentence about a params file names that file."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from jagg_core.setup.config import ParamsError
from jagg_core.setup.params_io import load_params

PARAMS = REPO / "params.yaml"


def _one_sentence(text: str) -> str:
    text = str(text).strip()
    assert text.count("\n") == 0 and text.endswith("."), text
    return text


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project root holding this checkout's params.yaml, the stages' ROOT and the working directory."""
    import tasks.common

    root = tmp_path / "project"
    (root / "mine").mkdir(parents=True)
    shutil.copy(PARAMS, root / "params.yaml")
    monkeypatch.setattr(tasks.common, "ROOT", root)
    monkeypatch.chdir(root)
    return root


def _main(module, argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = module.main(argv)
    return rc, err.getvalue()


def test_a_users_file_extends_the_projects_params(project):
    """`--params mine/params.yaml` replaced params.yaml: its profile ci got the schema's defaults (32 train prompts,
    4 x 128 test prompts) instead of ci's (64, 4 x 4). Now `extends: ../params.yaml` merges the file over the
    project's, profiles key by key."""
    from tasks.common import load

    (project / "mine/params.yaml").write_text(
        "extends: ../params.yaml\n"
        "profile: ci-mine\n"
        "plugins: []\n"
        "profiles:\n"
        "  ci-mine: {extends: ci, train: {iterations: 5}}\n")
    mine = load(None, project / "mine/params.yaml")
    ci = load_params(PARAMS, "ci")
    assert mine.profile == "ci-mine"
    assert (mine.world.n_train, mine.world.n_test_per_style) == (64, 4)
    assert mine.train.iterations == 5 and mine.train.micro_batch == ci.train.micro_batch  # one key of ci's changed
    assert mine.model_dump() == ci.model_copy(update={"profile": "ci-mine", "train": ci.train.model_copy(
        update={"iterations": 5})}).model_dump()


@pytest.mark.parametrize("text", [
    "profile: ci\nprofiles:\n  ci: {world: {n_train: 32}}\n",  # profiles, no extends: the code's defaults
    "extends: ../params.yaml\nprofile: ci\nprofiles:\n  ci: {world: {n_train: 32}}\n",  # ci's world changed
    "extends: ../params.yaml\nprofile: ci\ntrain: {lr: 0.5}\n",  # ci changed through a section
    "extends: ../params.yaml\nprofiles:\n  toy: {train: {iterations: 5}}\n",  # the project's default profile
])
def test_a_users_file_never_writes_into_a_profile_of_the_projects(project, text):
    """A file with `profiles:` and no `extends:` ran on the code's defaults and `prepare` overwrote data/ci/prompts
    (64 lines became 32); an `extends:` file changing `profiles.ci.world` rewrote all 11 of ci's prompt files, after
    which the project's own ci training refused; docs/extending.md's own example (`profile: ci`) wrote into data/ci,
    runs/ci and the jagg-ci experiment. Now each is one sentence, exit 1, nothing written; a profile of its own that
    extends ci (the test above) gets its own folders."""
    import tasks.prepare

    kept = project / "data/ci/prompts/train.jsonl"
    kept.parent.mkdir(parents=True)
    kept.write_text('{"prompt": "kept"}\n')
    (project / "mine/params.yaml").write_text(text)
    rc, err = _main(tasks.prepare, ["--params", "mine/params.yaml"])
    assert rc == 1, err
    said = _one_sentence(err.removeprefix("jagg: error: "))
    assert ("does not extend" in said if "extends" not in text
            else "of params.yaml" in said and "-mine: {extends: " in said), said
    assert kept.read_text() == '{"prompt": "kept"}\n'
    assert sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file()) == [
        "data/ci/prompts/train.jsonl", "mine/params.yaml", "params.yaml"]


@pytest.mark.parametrize("profile", ["toy", "ci"])
def test_a_file_that_only_extends_is_the_project_itself(project, profile):
    """The project's params.yaml loads as before; a file holding only `extends:` loads to the very same params, so
    the same run fingerprint."""
    from jagg_core.setup.paths import Layout
    from jagg_core.trainer.fingerprint import run_fingerprint
    from tasks.common import load

    (project / "mine/params.yaml").write_text("extends: ../params.yaml\n")
    mine, own = load(profile, project / "mine/params.yaml"), load(profile)
    assert mine.model_dump() == own.model_dump() == load_params(PARAMS, profile).model_dump()
    fingerprint = [run_fingerprint(p, Layout.of(p, project), "jagg", 0) for p in (mine, own)]
    assert fingerprint[0] == fingerprint[1]


def test_a_file_that_neither_extends_nor_is_whole_is_refused_and_prepare_writes_nothing(project):
    """A file holding only `plugins` and `profile: ci` ran prepare on the code's defaults and overwrote
    data/ci/prompts (32 train / 4 x 128 test prompts instead of ci's 64 / 4 x 4): now one sentence, exit 1."""
    import tasks.prepare

    kept = project / "data/ci/prompts/train.jsonl"
    kept.parent.mkdir(parents=True)
    kept.write_text('{"prompt": "kept"}\n')
    (project / "mine/params.yaml").write_text("plugins: []\nprofile: ci\n")
    rc, err = _main(tasks.prepare, ["--params", "mine/params.yaml"])
    assert rc == 1, err
    said = _one_sentence(err.removeprefix("jagg: error: "))
    assert "mine/params.yaml does not extend" in said and "add `extends: ../params.yaml`" in said, said
    assert kept.read_text() == '{"prompt": "kept"}\n'
    assert sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file()) == [
        "data/ci/prompts/train.jsonl", "mine/params.yaml", "params.yaml"]


@pytest.mark.parametrize("files, says", [
    ({"mine/a.yaml": "extends: b.yaml\n", "mine/b.yaml": "extends: a.yaml\n"}, "makes a cycle"),
    ({"mine/a.yaml": "extends: a.yaml\n"}, "makes a cycle"),
    ({"mine/a.yaml": "extends: ../../outside.yaml\n"}, "leads outside the project"),
    ({"mine/a.yaml": "extends: ../mine\n"}, "not a regular file"),
    ({"mine/a.yaml": "extends: [../params.yaml]\n"}, "extends must be the path"),
    ({"mine/a.yaml": "extends: http://alice:pw@host/params.yaml\n"}, "holds a URL's credentials"),
    ({f"mine/{i}.yaml": f"extends: {i + 1}.yaml\n" for i in range(12)}, "makes a chain of more than 8"),
])
def test_an_extends_chain_is_bounded_inside_the_project_and_never_a_cycle(project, files, says):
    from tasks.common import load

    (project.parent / "outside.yaml").write_text("profiles: {}\n")
    for name, text in files.items():
        (project / name).write_text(text)
    first = next(iter(files))
    with pytest.raises(ParamsError) as e:
        load(None, project / first)
    said = _one_sentence(e.value)
    assert says in said and "pw" not in said, said


def test_the_pipelines_generator_refuses_another_params_file(project, monkeypatch):
    """`python -m tasks.dvc_pipelines --params small.yaml` deleted the other profiles' tracked pipelines and rewrote
    toy's, which still read ../../params.yaml: now one sentence, exit 1, nothing deleted or written."""
    import tasks.dvc_pipelines as gen

    raw = yaml.safe_load(PARAMS.read_text())
    raw["profiles"] = {p: raw["profiles"][p] for p in ("toy", "ci")}
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    (project / "pipelines").mkdir()
    shutil.copy(REPO / "pipelines/template.yaml", project / "pipelines/template.yaml")
    gen.write(project)
    before = {p: p.read_bytes() for p in project.rglob("*") if p.is_file()}
    raw["profiles"] = {"toy": {**raw["profiles"]["toy"], "run": {"methods": ["jagg"]}}}  # ci's pipeline: gone
    (project / "small.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    monkeypatch.setattr(gen, "ROOT", project)
    for argv in (["--params", "small.yaml"], ["--check", "--params", "small.yaml"]):
        rc, err = _main(gen, argv)
        assert rc == 1, err
        assert "generated from the project's params.yaml only" in _one_sentence(err.removeprefix("jagg: error: "))
    after = {p: p.read_bytes() for p in project.rglob("*") if p.is_file()}
    assert after.keys() - before.keys() == {project / "small.yaml"}
    assert all(after[p] == b for p, b in before.items())
    for spelt in ("params.yaml", str(project / "params.yaml")):  # the project's own, however spelt: as before
        assert _main(gen, ["--check", "--params", spelt])[0] == 0


@pytest.mark.parametrize("text, profile, says", [
    ("profiles: {ci: {train: {lr: abc}}}\n", "ci", "mine/params.yaml (profile ci): train.lr = 'abc' is invalid"),
    ("profiles: {ci: {}}\n", "nope", "profiles in mine/params.yaml: ci."),
    ("profiles: {ci: {train: {lrr: 1}}}\n", "ci", "mine/params.yaml (profile ci): unknown key 'train.lrr'"),
])
def test_errors_name_the_params_file_they_are_about(project, text, profile, says):
    """"params.yaml (profile ci)" was printed for mine/params.yaml: a sentence names the file as given."""
    from tasks.common import load

    (project / "mine/params.yaml").write_text(text)
    with pytest.raises(ParamsError) as e:
        load(profile, project / "mine/params.yaml")
    assert says in _one_sentence(e.value), str(e.value)
