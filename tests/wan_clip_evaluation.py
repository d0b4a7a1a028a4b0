"""The evaluation of a ci-sized wan run's clips and its report, checked by hand (tests/test_wan.py's ci-sized run ends
here): frame means on the saved frames, the evaluate stage's strips in MLflow, the report's grid of saved strips."""

from __future__ import annotations

import pytest
import torch

STYLES = ("anime", "concept-art", "paintings", "photo")


def benchmark_folder(root, prompts):
    """An HPDv2-like benchmark folder: one prompt per style (of ``prompts``, in turn)."""
    import json

    folder = root / "hpdv2" / "benchmark"
    folder.mkdir(parents=True)
    for k, style in enumerate(STYLES):
        (folder / f"{style}.json").write_text(json.dumps([prompts[k % len(prompts)] + f" ({style})"]))
    return folder.parent


def check_clip_evaluation_and_report(params, root, overrides):
    """The evaluation of the run's clips (base and its 2 checkpoints): frames 0, 2, 4 (reward.frames = 3) saved as
    JPEGs with a strip per clip, each clip's score the mean of the metric over its saved frames (by hand), the
    benchmark the mean of the styles; the report's grid stacks the saved strips; another reward.frames regenerates."""
    import json
    import statistics

    from PIL import Image

    from conftest import REPO
    from jagg_core.evaluation.benchmark import load_image
    from jagg_core.evaluation.clips import frame_path, strip_path
    from jagg_core.evaluation.evaluate import evaluate_run
    from jagg_core.setup.params_io import load_params
    from jagg_core.setup.paths import Layout
    from jagg_core.pipeline.report import build_report
    from jagg_core.pipeline.tracking import Tracker
    from jagg_core.rewards import make_reward
    from tasks.evaluate import evaluate

    lay = Layout.of(params, root)
    score = make_reward("jpeg_compressibility")

    def check_step(run, res, step, frames):
        step_dir = lay.eval_dir(run) / "steps" / f"{step:06d}"
        assert json.loads((step_dir / "generation.json").read_text())["frames"] == frames
        rows = [json.loads(x) for x in (step_dir / "scores.jsonl").read_text().splitlines()]
        assert [(r["style"], r["index"]) for r in rows] == [(s, 0) for s in STYLES]
        means = []
        for r in rows:
            clip = torch.stack([load_image(frame_path(step_dir / "images", r["style"], 0, f)) for f in frames])
            per_frame = score(clip, [r["prompt"]] * len(frames), [{}] * len(frames))[0].tolist()
            means.append(statistics.fmean(per_frame))
            assert r["jpeg_compressibility"] == pytest.approx(means[-1], rel=1e-6)
            assert strip_path(step_dir / "images", r["style"], 0).is_file()
        saved = sorted(p.name for p in (step_dir / "images" / "anime" / "00000").iterdir())
        assert saved == [f"{f:03d}.jpg" for f in frames] + ["strip.jpg"]
        assert res["metrics"]["jpeg_compressibility"]["benchmark"] == pytest.approx(statistics.fmean(means), rel=1e-6)
        return step_dir

    base = evaluate(params, lay, "base")  # the evaluate stage: a real MLflow store gets each step's strips
    base_dir = check_step("base", base, 0, [0, 2, 4])
    run = evaluate(params, lay, "jagg-s0")
    assert [p["step"] for p in run["curve"]] == [1, 2] and run["images"].endswith("steps/000002/images")
    check_step("jagg-s0", run, 2, [0, 2, 4])
    client = Tracker(params, root).client
    runs = client.search_runs([client.get_experiment_by_name("jagg-wan").experiment_id])
    logged = sorted(a.path.split("+")[:3] for r in runs for a in client.list_artifacts(r.info.run_id, "images")
                    if a.path.startswith("images/eval") and a.path.endswith(".png"))
    assert logged == [["images/eval", "step", s] for s in ("0", "1", "2")]

    summary = build_report(params, lay)
    html = (lay.report_dir / "index.html").read_text()
    assert summary["grid_columns"] == ["base", "jagg @2"] and 'src="grid.png"' in html
    grid = Image.open(lay.report_dir / "grid.png").convert("RGB")
    strip = Image.open(strip_path(base_dir / "images", "anime", 0)).convert("RGB")
    assert grid.width == strip.width + 12 and max(grid.size) <= 2048  # one strip per row, 8 rows, unscaled
    assert grid.crop((6, 6, 6 + strip.width, 6 + strip.height)).tobytes() == strip.tobytes()  # row 1: base, anime

    two = load_params(REPO / "params.yaml", "wan", {**overrides, "reward.frames": 2})  # frames 0 and 4: regenerated
    check_step("base", evaluate_run(two, Layout.of(two, root), "base"), 0, [0, 4])
