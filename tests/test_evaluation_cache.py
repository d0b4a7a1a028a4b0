"""Evaluation reuses generated test images only for the same checkpoint, base model, model options, sampler and
prompts: anything else regenerates them (a reused image of another setting would report a wrong metric); and their
scores only for the same scorer (options, weights' content, code) and image bytes (score_cache.py)."""

from __future__ import annotations

import shutil

import pytest
import torch


def _generate(root, prompts, **overrides):
    from jagg_core.setup.params_io import load_params
    from jagg_core.evaluation.evaluate import evaluate_step
    from jagg_core.setup.paths import Layout

    params = load_params(root / "params.yaml", "ci", overrides or None)
    out = root / "eval-step"
    evaluate_step(params, Layout(root, "ci"), out, weights=None, step=0, prompts=prompts)
    return {p.relative_to(out): p.stat().st_mtime_ns for p in sorted((out / "images").rglob("*.jpg"))}


@pytest.fixture
def project(ci_base, tmp_path):
    root = tmp_path / "p"
    shutil.copytree(ci_base, root)
    return root


def test_images_are_reused_only_for_the_same_generation(project):
    from safetensors.torch import load_file, save_file

    prompts = {"anime": ["a small red circle"], "photo": ["a purple square at the bottom left"]}
    first = _generate(project, prompts)
    assert len(first) == 2
    assert _generate(project, prompts) == first  # same everything: reused, not rewritten

    other = {"anime": ["a small purple cross"], "photo": ["a purple square at the bottom left"]}
    assert set(_generate(project, other).values()).isdisjoint(first.values())  # new prompts: all regenerated

    again = _generate(project, prompts)
    fewer = _generate(project, prompts, **{"eval.num_steps": 3})  # another sampler: regenerated ...
    assert fewer.keys() == again.keys() and set(fewer.values()).isdisjoint(again.values())
    assert _generate(project, prompts, **{"eval.num_steps": 3}) == fewer  # ... and then reused

    # A retrained (here: perturbed) base model: the same prompts and options, other weights → regenerated.
    before = _generate(project, prompts)
    weights = next((project / "models/ci/base/transformer").glob("*.safetensors"))
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 0.01 * torch.ones_like(tensors[name])
    save_file(tensors, weights)
    assert set(_generate(project, prompts).values()).isdisjoint(before.values())


def test_an_evaluation_whose_images_are_all_there_builds_no_policy(project, monkeypatch):
    """Evaluating again what is evaluated (`jagg evaluate` after `jagg run`, `dvc repro`) scores the images it finds
    without building the policy: building it imported diffusers, transformers and peft and read the base model's
    weights, about half of such a stage's CPU. The scores are the same."""
    from jagg_core.evaluation import evaluate as ev
    from jagg_core.setup.params_io import load_params
    from jagg_core.setup.paths import Layout

    built = []
    real = ev.policy_from_params
    monkeypatch.setattr(ev, "policy_from_params", lambda *a, **k: built.append(a) or real(*a, **k))
    params, lay = load_params(project / "params.yaml", "ci"), Layout(project, "ci")
    first = ev.evaluate_run(params, lay, "base")
    assert len(built) == 1  # the images were generated
    assert ev.evaluate_run(params, lay, "base") == first
    assert len(built) == 1  # every image was there: none generated, no policy built


@pytest.mark.slow
def test_two_processes_evaluate_like_one_and_resume_by_block(ci_base, tmp_path):
    """`jagg evaluate` with resources.num_processes 2 (accelerate, gloo): the processes split the test set by blocks of
    eval.batch_size images; the images, every per-image score and the summary equal one process's, and MLflow gets
    the same metrics. Images deleted from one block (a killed evaluation) are the only ones generated again."""
    import json

    import mlflow

    from conftest import run_module

    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(ci_base, one)
    shutil.copytree(ci_base, two)
    args = ["--profile", "ci", "--run", "base", "--set", "eval.batch_size=4"]  # 16 test images: 4 blocks
    r1 = run_module("tasks.evaluate", *args, root=one)
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = run_module("tasks.evaluate", *args, "--set", "resources.num_processes=2", root=two)
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert "evaluating base in 2 processes" in r2.stderr
    step = "eval/ci/base/steps/000000"
    for name in ("eval/ci/base/metrics.json", f"{step}/scores.jsonl", f"{step}/metrics.json"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    images = sorted(p.relative_to(one / step) for p in (one / step / "images").rglob("*.jpg"))
    assert len(images) == 16
    assert all((one / step / p).read_bytes() == (two / step / p).read_bytes() for p in images)

    def logged(root):
        client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
        exp = client.get_experiment_by_name("jagg-ci")
        run = client.search_runs([exp.experiment_id], "tags.`jagg.run` = 'base'")[0]
        return {k: v for k, v in run.data.metrics.items() if k.startswith("eval/")}

    assert logged(one) and logged(one) == logged(two)

    # A killed evaluation: the second block's images are gone; only they are generated again.
    stamps = {p: (two / step / p).stat().st_mtime_ns for p in images}
    gone = images[4:8]
    for p in gone:
        (two / step / p).unlink()
    r3 = run_module("tasks.evaluate", *args, "--set", "resources.num_processes=2", root=two)
    assert r3.returncode == 0, r3.stderr[-2000:]
    assert [p for p in images if (two / step / p).stat().st_mtime_ns != stamps.get(p)] == gone
    assert json.loads((two / step / "metrics.json").read_text()) == json.loads((one / step / "metrics.json").read_text())


# A scorer of the user's, from a plugin file: its weights are one number in a file named by its option; every call
# appends its batch size to $SCORER_CALLS, so a test counts what was scored.
COUNTED_SCORER = '''
import os
from pathlib import Path

from jagg_core.rewards import register_reward


@register_reward("weighted_mean", options={"weights": (str, None)})
def weighted_mean(weights: str = "") -> object:
    scale = float(Path(weights).read_text())

    def fn(images, prompts, metadata):
        with open(os.environ["SCORER_CALLS"], "a") as f:
            f.write(f"{len(prompts)}\\n")
        return images.mean(dim=(1, 2, 3)) * scale, {"brightness": images.mean(dim=(1, 2, 3))}

    return fn
'''


@pytest.mark.slow
def test_an_evaluated_run_is_scored_again_only_where_its_images_or_scorer_changed(project, tmp_path):
    """`jagg evaluate` of an evaluated run scores nothing again (its scorer is not even called); after the scorer's
    weights file is replaced at the same path (same size, same mtime: only its content differs), every image is
    scored again; after one image changes, only its batch is. The base model's run and the toy's ground truth."""
    import json
    import os

    from conftest import run_module

    (project / "plugins").mkdir()
    (project / "plugins/weighted_mean.py").write_text(COUNTED_SCORER)
    weights, calls = project / "scale.txt", tmp_path / "calls"
    weights.write_text("1.0")
    args = ["--profile", "ci", "--run", "base", "--set", "plugins=[plugins/weighted_mean.py]",
            "--set", "eval.metrics=[weighted_mean, toy_fidelity]", "--set", "eval.batch_size=4",
            "--set", f"reward.options={{weighted_mean: {{weights: {weights}}}}}"]

    def evaluate() -> tuple[list[int], dict]:
        calls.write_text("")
        out = run_module("tasks.evaluate", *args, root=project, env={"SCORER_CALLS": str(calls)})
        assert out.returncode == 0, out.stderr[-2000:]
        summary = json.loads((project / "eval/ci/base/metrics.json").read_text())["metrics"]["weighted_mean"]
        return [int(n) for n in calls.read_text().split()], summary

    first, scores = evaluate()
    images = sum(first) // 2  # the base model's images, then the ground truth's renders as many
    assert images >= 8 and all(n <= 4 for n in first)

    again, same = evaluate()
    assert again == [] and same == scores  # nothing scored again, the same scores

    stat = weights.stat()  # replaced at the same path, with the same size and mtime: only the content tells
    (project / "new-scale.txt").write_text("2.0")
    os.utime(project / "new-scale.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(project / "new-scale.txt", weights)
    rescored, doubled = evaluate()
    assert sorted(rescored) == sorted(first)  # every batch of both folders, once
    assert doubled["benchmark"] == pytest.approx(2 * scores["benchmark"])

    # One image of the base model's changes (here: it becomes another's): its batch alone is scored again.
    step = project / "eval/ci/base/steps/000000/images"
    a, b = sorted(step.rglob("*.jpg"))[:2]
    a.write_bytes(b.read_bytes())
    one, _ = evaluate()
    assert one == [4]
    rows = [json.loads(line) for line in (step.parent / "scores.jsonl").read_text().splitlines()]
    assert rows[0]["weighted_mean"] == rows[1]["weighted_mean"]  # the changed image's score is its new bytes'


def test_a_process_that_scored_with_replaced_weights_builds_its_scorer_again(project, tmp_path, monkeypatch):
    """One process (a flow's evaluations run in it) evaluates, the scorer's weights file is replaced, it evaluates
    again: the scorer is built again from the new file (the built one is kept per options, which did not change), and
    the scores are the new weights'."""
    import json

    from jagg_core.evaluation.evaluate import evaluate_run
    from jagg_core.setup import registry
    from jagg_core.setup.params_io import load_params
    from jagg_core.setup.paths import Layout

    (project / "plugins").mkdir()
    (project / "plugins/weighted_mean.py").write_text(COUNTED_SCORER)
    weights = project / "scale.txt"
    weights.write_text("1.0")
    monkeypatch.setenv("SCORER_CALLS", str(tmp_path / "calls"))
    monkeypatch.chdir(project)  # the plugin file is found from the project's folder
    over = {"plugins": ["plugins/weighted_mean.py"], "eval.metrics": ["weighted_mean"],
            "reward.options": {"weighted_mean": {"weights": str(weights)}}}
    try:
        params, lay = load_params("params.yaml", "ci", over), Layout(project, "ci")
        first = evaluate_run(params, lay, "base")["metrics"]["weighted_mean"]["benchmark"]
        (project / "new.txt").write_text("3.0")
        (project / "new.txt").replace(weights)
        again = evaluate_run(params, lay, "base")["metrics"]["weighted_mean"]["benchmark"]
    finally:
        registry.remove("reward", "weighted_mean")
    assert again == pytest.approx(3 * first)
    assert json.loads((project / "eval/ci/base/metrics.json").read_text())["metrics"]["weighted_mean"]["benchmark"] == again
