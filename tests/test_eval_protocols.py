"""The evaluation protocols (``eval.protocol``): HPDv2's benchmark/ (per-style block means, x100) and its 400-prompt
test.json (plain mean), read from a folder or the HF cache, their arithmetic by hand, and their labels in the report;
a test prompt outside the toy grammar is one sentence before any image is generated."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest

from fault_helpers import PARAMS, _one_sentence
from jagg_core.evaluation.protocols import apply_protocol, load_hpdv2_test
from jagg_core.setup.params_io import load_params
from jagg_core.setup.storage import PromptFileError

REPO = Path(__file__).resolve().parents[1]

HINT = ("download test.json from the Hugging Face dataset zhwang/HPDv2 into the local Hugging Face cache (hf download "
        "zhwang/HPDv2 test.json --repo-type dataset), or into a folder and pass that folder.")


def write_test_list(folder: Path, prompts: list[str]) -> Path:
    """HPDv2's test.json layout: a list of {"prompt", "image_path", "rank", "raw_annotations"}."""
    folder.mkdir(parents=True, exist_ok=True)
    items = [{"prompt": p, "image_path": [f"{i:05d}_{k}.jpg" for k in range(3)], "rank": [2, 1, 3],
              "raw_annotations": [{"rank": [2, 1, 3], "user_hash": "u"}]} for i, p in enumerate(prompts)]
    (folder / "test.json").write_text(json.dumps(items))
    return folder / "test.json"


def test_each_convention_by_hand_on_a_small_case():
    # Two styles of 3 and 2 images, blocks of 2; PickScore's logit-scale score beside its reward (score / 26).
    scores = {"a": [0.30, 0.32, 0.40], "b": [0.20, 0.26]}
    from jagg_core.evaluation import summarize_scores

    summary = summarize_scores({"hpsv2.1": scores, "pickscore": {s: [v / 26 for v in vs] for s, vs in scores.items()},
                                "pickscore/score": {s: [100 * v for v in vs] for s, vs in scores.items()}},
                               block_size=2)
    bench = apply_protocol(json.loads(json.dumps(summary)), "hpdv2-benchmark", both_forms=True)["hpsv2.1"]
    # a: blocks [0.30, 0.32] [0.40] -> 0.31, 0.40 -> 0.355; b: one block -> 0.23; benchmark (0.355 + 0.23) / 2
    assert bench["benchmark"] == pytest.approx(0.2925, abs=1e-15)
    assert bench["forms"]["hpdv2-benchmark"]["raw"] == pytest.approx(0.2925, abs=1e-15)
    assert bench["forms"]["hpdv2-benchmark"]["x100"] == pytest.approx(29.25, abs=1e-12)
    assert bench["forms"]["hpdv2-test"]["raw"] == pytest.approx(1.48 / 5, abs=1e-15)  # plain mean of 5 images
    assert bench["protocol"] == "hpdv2-benchmark"
    test = apply_protocol(json.loads(json.dumps(summary)), "hpdv2-test")
    assert test["hpsv2.1"]["benchmark"] == pytest.approx(1.48 / 5, abs=1e-15)  # the headline is the plain mean
    assert set(test["hpsv2.1"]["forms"]) == {"hpdv2-test"}
    # PickScore's table value is the logit-scale score / 100 (the paper's 0.22), whatever the reward's own scale.
    assert test["pickscore"]["forms"]["hpdv2-test"]["raw"] == pytest.approx(1.48 / 5, abs=1e-14)
    assert test["pickscore"]["benchmark"] == pytest.approx(1.48 / 5 / 26, abs=1e-15)
    with pytest.raises(ValueError, match="^unknown eval.protocol 'paper'; use one of hpdv2-benchmark, hpdv2-test.$"):
        apply_protocol(summary, "paper")


def test_test_list_from_a_folder_or_either_hf_mirror(tmp_path, monkeypatch):
    path = write_test_list(tmp_path / "hpd", [f"prompt {i}" for i in range(400)])
    assert load_hpdv2_test(tmp_path / "hpd") == {"test": [f"prompt {i}" for i in range(400)]}
    assert load_hpdv2_test(path, subset=3) == {"test": ["prompt 0", "prompt 1", "prompt 2"]}
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(FileNotFoundError) as e:
        load_hpdv2_test()
    assert str(e.value) == f"the HPDv2 test list test.json is not in the local Hugging Face cache: {HINT}"
    snapshot = cache / "datasets--ymhao--HPDv2" / "snapshots" / ("1" * 40)
    write_test_list(snapshot, ["from the mirror"])
    (cache / "datasets--ymhao--HPDv2" / "refs").mkdir()
    (cache / "datasets--ymhao--HPDv2" / "refs" / "main").write_text("1" * 40)
    assert load_hpdv2_test() == {"test": ["from the mirror"]}


@pytest.mark.parametrize("content, message", [
    ("[", "is not valid JSON (Expecting value at line 1, column 2)."),
    ("[]", 'must hold a non-empty JSON list of objects with a "prompt" string, as HPDv2\'s test.json.'),
    ('[{"prompt": "a"}, {"image_path": []}]',
     'must hold a non-empty JSON list of objects with a "prompt" string, as HPDv2\'s test.json (entry 1 has none).'),
    (b"\xff[]", "is not UTF-8 text (byte 0)."),
])
def test_bad_test_lists_are_one_sentence(tmp_path, content, message):
    path = tmp_path / "test.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(PromptFileError) as e:
        load_hpdv2_test(tmp_path)
    assert str(e.value) == f"{path} {message}"
    with pytest.raises(FileNotFoundError) as e:
        load_hpdv2_test(tmp_path / "nowhere")
    assert str(e.value) == f"the HPDv2 folder '{tmp_path / 'nowhere'}' does not exist: {HINT}"
    (tmp_path / "sub").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        load_hpdv2_test(tmp_path / "sub")
    assert str(e.value) == f"the HPDv2 test list {tmp_path / 'sub' / 'test.json'} does not exist: {HINT}"


def _scores(step_dir: Path) -> dict[str, list[float]]:
    rows = [json.loads(line) for line in (step_dir / "scores.jsonl").read_text().splitlines()]
    out: dict[str, list[float]] = {}
    for r in rows:
        out.setdefault(r["style"], []).append(r["toy_fidelity"])
    return out


def test_a_test_list_and_a_benchmark_folder_through_evaluation_mlflow_and_the_report(ci_project, monkeypatch):
    """A 400-prompt test list and an uneven benchmark folder (real layouts, the ci world's prompts) through the
    evaluation of the ci base model; every headline and form recomputed by hand from the per-image scores."""
    from jagg_core.evaluation.evaluate import evaluate_run
    from jagg_core.setup.params_io import load_params
    from jagg_core.setup.paths import Layout
    from jagg_core.pipeline.report import build_report
    from tasks.evaluate import evaluate

    root = ci_project
    monkeypatch.setenv("JAGG_ROOT", str(root))
    split = json.loads((root / "data/ci/prompts/test.json").read_text())  # the toy's own test list, style by style
    styles = sorted(p.stem for p in (root / "data/ci/prompts/benchmark").glob("*.json"))
    assert [it["prompt"] for it in split] == [p for s in styles for p in
                                              json.loads((root / f"data/ci/prompts/benchmark/{s}.json").read_text())]
    prompts = [it["prompt"] for it in split]
    hpd = root / "hpd"
    write_test_list(hpd, [prompts[i % len(prompts)] for i in range(400)])
    (hpd / "benchmark").mkdir()
    for style, n in (("anime", 3), ("photo", 2)):
        (hpd / "benchmark" / f"{style}.json").write_text(json.dumps(prompts[:n] if style == "anime" else prompts[-n:]))
    common = {"eval.benchmark": str(hpd), "eval.metrics": ["toy_fidelity"], "eval.block_size": 2,
              "eval.num_steps": 2}  # 2 ODE steps: 400 images in a few seconds

    params = load_params(root / "params.yaml", "ci", {**common, "eval.protocol": "hpdv2-test"})
    lay = Layout(root, "ci")
    s = evaluate_run(params, lay, "base")["metrics"]["toy_fidelity"]
    by_hand = _scores(lay.eval_dir("base") / "steps/000000")
    assert list(by_hand) == ["test"] and len(by_hand["test"]) == 400
    mean = math.fsum(by_hand["test"]) / 400
    assert s["protocol"] == "hpdv2-test" and s["benchmark"] == pytest.approx(mean, abs=1e-12)
    assert s["forms"] == {"hpdv2-test": {"raw": pytest.approx(mean, abs=1e-12), "n_images": 400}}

    # The benchmark protocol through the evaluate stage itself: MLflow (a real store) gets the conventions as tags.
    shutil.rmtree(lay.eval_dir("base"))
    params = load_params(root / "params.yaml", "ci", {**common, "eval.protocol": "hpdv2-benchmark"})
    s = evaluate(params, lay, "base")["metrics"]["toy_fidelity"]
    v = _scores(lay.eval_dir("base") / "steps/000000")
    a, p = v["anime"], v["photo"]
    bench = ((a[0] + a[1]) / 2 + a[2]) / 2 / 2 + (p[0] + p[1]) / 2 / 2  # style block means, averaged over styles
    assert s["benchmark"] == pytest.approx(bench, abs=1e-12)
    assert s["forms"]["hpdv2-benchmark"]["x100"] == pytest.approx(100 * bench, abs=1e-10)
    assert s["forms"]["hpdv2-test"]["raw"] == pytest.approx(math.fsum(a + p) / 5, abs=1e-12)  # the toy: both forms

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("jagg-ci").experiment_id], "tags.`jagg.run` = 'base'")
    tags, logged = run.data.tags, run.data.metrics
    assert tags["eval.protocol"] == "hpdv2-benchmark" and tags["eval.resolution"] == "24x24"
    assert tags["eval.steps"] == "2 (ODE)" and tags["eval.guidance"] == "3.0"
    assert tags["eval.seed_rule"].startswith("image i of a prompt group: derive_seed(0, group, i)")
    assert tags["eval.scorer.toy_fidelity"] == "the toy world's toy_fidelity; the reward's value"
    assert logged["eval/toy_fidelity/form/hpdv2-benchmark-x100"] == pytest.approx(100 * bench, abs=1e-8)
    assert logged["eval/toy_fidelity/form/hpdv2-test"] == pytest.approx(math.fsum(a + p) / 5, abs=1e-10)

    build_report(params, lay)
    readme = (root / "reports/ci/README.md").read_text()
    index = (root / "reports/ci/index.html").read_text()
    for text in (readme, index):
        assert "protocol hpdv2-benchmark" in text.replace("`", "")
        assert "hpdv2-benchmark ×100 (hpsv2 leaderboard)" in text and "hpdv2-test (plain mean, raw" in text
        assert "derive_seed(0, group, i)" in text and "24x24" in text
    assert f"{100 * bench:.2f}" in readme and f"{math.fsum(a + p) / 5:.4f}" in readme


def test_a_bad_test_list_stops_the_evaluate_stage_with_one_sentence(ci_project):
    from conftest import run_module

    (ci_project / "bad").mkdir()
    (ci_project / "bad" / "test.json").write_text('[{"prompt": "a small red circle"}, {"rank": [1]}]')
    out = run_module("tasks.evaluate", "--profile", "ci", "--run", "base", "--set", "eval.protocol=hpdv2-test",
                     "--set", f"eval.benchmark={ci_project / 'bad'}", root=ci_project, timeout=300)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].endswith(f"{ci_project / 'bad' / 'test.json'} must hold a non-empty JSON list of objects with a "
                             f"\"prompt\" string, as HPDv2's test.json (entry 1 has none).")
    assert not (ci_project / "eval/ci/base").exists()  # nothing half-written


@pytest.mark.parametrize("profile, protocol", [("flux", "hpdv2-test"), ("sd3", "hpdv2-benchmark")])
def test_a_real_profile_prepares_the_test_set_of_its_protocol(tmp_path, profile, protocol):
    from jagg_core.setup.params_io import load_params
    from jagg_core.setup.paths import Layout
    from tasks.prepare import prepare

    hpd = tmp_path / "hpd"
    write_test_list(hpd, [f"test prompt {i}" for i in range(400)])
    (hpd / "benchmark").mkdir()
    for style in ("anime", "concept-art", "paintings", "photo"):
        (hpd / "benchmark" / f"{style}.json").write_text(json.dumps([f"{style} {i}" for i in range(3)]))
    (tmp_path / "train.txt").write_text("a cat\na dog\n")
    params = load_params(REPO / "params.yaml", profile, {"data.train_prompts": str(tmp_path / "train.txt"),
                                                         "eval.benchmark": str(hpd)})
    assert params.eval.protocol == protocol  # the paper's profiles evaluate as its tables report
    lay = Layout(tmp_path, profile)
    summary = prepare(params, lay)
    if protocol == "hpdv2-test":
        assert summary["test"] == {"test": 400} and not lay.benchmark.exists()
        assert load_hpdv2_test(lay.prompts) == {"test": [f"test prompt {i}" for i in range(400)]}
    else:
        assert summary["test"] == {s: 3 for s in ("anime", "concept-art", "paintings", "photo")}
        assert not (lay.prompts / "test.json").exists()


# --- test prompts outside the toy grammar, before any image is generated -------------------------------------------


@pytest.mark.parametrize("prompt", ["a cat riding a bicycle", "x" * 10_000_000])
def test_a_test_prompt_outside_the_toy_grammar_is_one_short_sentence(prompt, tmp_path):
    import json

    from jagg_core.evaluation.evaluate import EvalError, test_prompts
    from jagg_core.setup.paths import Layout

    params = load_params(PARAMS, "ci")
    lay = Layout(tmp_path, "ci")
    bench = lay.prompts / "benchmark"
    bench.mkdir(parents=True)
    (bench / "anime.json").write_text(json.dumps([prompt]))
    with pytest.raises(EvalError) as e:
        test_prompts(params, lay)
    text = _one_sentence(e.value)
    assert "toy world's grammar" in text and "anime.json: prompt 0" in text


def test_a_test_list_prompt_outside_the_toy_grammar_names_the_test_list(tmp_path):
    """eval.protocol hpdv2-test reads test.json: its sentence names that file, not a benchmark style's."""
    import json

    from jagg_core.evaluation.evaluate import EvalError, test_prompts
    from jagg_core.setup.paths import Layout

    params = load_params(PARAMS, "ci", {"eval.protocol": "hpdv2-test"})
    lay = Layout(tmp_path, "ci")
    lay.prompts.mkdir(parents=True)
    (lay.prompts / "test.json").write_text(json.dumps([{"prompt": "a red circle"}, {"prompt": "a cat on a mat"}]))
    with pytest.raises(EvalError) as e:
        test_prompts(params, lay)
    text = _one_sentence(e.value)
    assert f"{lay.prompts / 'test.json'}: prompt 1 'a cat on a mat'" in text and "benchmark" not in text
