"""The report's statistics and summary.json, from evaluation files and curves written by hand (no training), and its
one sentence on a damaged, missing or non-finite input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fault_helpers import PARAMS, _one_sentence
from jagg_core.pipeline.report import build_report, paired_interval
from jagg_core.setup.params_io import load_params

REPO = Path(__file__).resolve().parents[1]


def test_paired_interval_matches_a_hand_computed_t_interval():
    diffs = [0.01, 0.03, 0.02]  # mean 0.02, sd 0.01, t(0.975, 2) = 4.302653
    got = paired_interval(diffs)
    half = 4.302653 * 0.01 / math.sqrt(3)
    assert got["n"] == 3 and got["mean"] == pytest.approx(0.02) and got["sd"] == pytest.approx(0.01)
    assert got["lo"] == pytest.approx(0.02 - half, rel=1e-6) and got["hi"] == pytest.approx(0.02 + half, rel=1e-6)
    assert math.isnan(paired_interval([0.5])["lo"])


def _write_eval(root: Path, run: str, value: float) -> None:
    from PIL import Image

    step_dir = root / "eval" / "rep" / run / "steps" / "000004"
    rows = []
    for style in ("count", "single"):
        (step_dir / "images" / style).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (24, 24), (200, 10 * i, 0)).save(step_dir / "images" / style / f"{i:05d}.jpg")
            rows.append({"style": style, "index": i, "prompt": f"a red {style} {i}", "toy_fidelity": value})
    (step_dir / "scores.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = {"toy_fidelity": {"benchmark": value, "styles": {}}}
    card = {"run": run, "step": 0 if run == "base" else 4, "metrics": metrics,
            "curve": [{"step": 4, "eval/toy_fidelity": value}],
            "images": str((step_dir / "images").relative_to(root))}
    (root / "eval" / "rep" / run / "metrics.json").write_text(json.dumps(card))


def test_summary_holds_every_run_and_the_paired_differences(tmp_path):
    from jagg_core.setup.params_io import load_params
    from jagg_core.setup.paths import Layout

    params = load_params(REPO / "params.yaml", "toy", {
        "profile": "rep", "run.methods": ["baseline", "jagg", "ablate"], "run.seeds": [0, 1, 2],
        "eval.metrics": ["toy_fidelity"]})
    finals = {("baseline", 0): 0.30, ("baseline", 1): 0.28, ("baseline", 2): 0.32,
              ("jagg", 0): 0.31, ("jagg", 1): 0.30, ("jagg", 2): 0.34,
              ("ablate", 0): 0.25, ("ablate", 1): 0.27}  # ablate seed 2 not evaluated: left out of its pairs
    _write_eval(tmp_path, "base", 0.2)
    for (method, seed), value in finals.items():
        run = f"{method}-s{seed}"
        _write_eval(tmp_path, run, value)
        curve = tmp_path / "runs" / "rep" / run / "curve.tsv"
        curve.parent.mkdir(parents=True)
        update = 2.0 if method == "baseline" else 1.5
        diag = "\ttrain/kl_ref\treward/toy_fidelity/group_std\treward/toy_fidelity/zero_std_frac"
        curve.write_text("iteration\ttime/update\ttime/iteration\treward/mean" + diag + "\n" +
                         "".join(f"{i}\t{update + (i == 1)}\t3.0\t0.{i}\t{0.001 * i}\t0.05\t0.25\n"
                                 for i in range(1, 5)))
    summary = build_report(params, Layout(tmp_path, "rep"))

    written = json.loads((tmp_path / "reports" / "rep" / "summary.json").read_text())
    assert written["profile"] == "rep" and written["base"] == {"toy_fidelity": 0.2}
    got = {(r["method"], r["seed"]): r for r in written["runs"]}
    assert set(got) == set(finals)
    assert got[("jagg", 1)]["final"]["toy_fidelity"] == 0.30
    assert got[("baseline", 0)]["update_s_per_iteration"] == pytest.approx(2.0)  # the warm-up iteration left out
    pairs = {(p["a"], p["b"]): p for p in summary["paired"]}
    jb = pairs[("jagg", "baseline")]
    assert jb["seeds"] == [0, 1, 2] and jb["mean"] == pytest.approx(0.05 / 3) and jb["lo"] < jb["mean"] < jb["hi"]
    assert pairs[("ablate", "jagg")]["diffs"] == pytest.approx([-0.06, -0.03])
    readme = (tmp_path / "reports" / "rep" / "README.md").read_text()
    assert "jagg − baseline" in readme and "(+0.1000)" in readme  # per-seed gain of baseline seed 0 over the base
    # The diagnostics practitioners watch: one curve each, in the report (the reward without a column has none).
    shown = {"train/kl_ref": "kl_ref.png", "reward/toy_fidelity/group_std": "group_std-toy_fidelity.png",
             "reward/toy_fidelity/zero_std_frac": "zero_std_frac-toy_fidelity.png"}
    assert {k: v for k, v in summary["figures"].items() if k in shown or "toy_preference" in k} == shown
    # The first figure: the held-out score by iteration for every method (base model at iteration 0).
    assert next(iter(summary["figures"].items())) == ("test split by iteration", "learning.png")
    assert (tmp_path / "reports" / "rep" / "learning.png").read_bytes()[:4] == b"\x89PNG"
    for key, name in shown.items():
        assert f"![{key}]({name})" in readme
        assert (tmp_path / "reports" / "rep" / name).read_bytes()[:4] == b"\x89PNG"


def test_logged_image_grids_stay_small_for_large_images_and_readable_for_tiny_ones():
    import numpy as np

    from jagg_core.media import image_grid

    toy = image_grid(np.zeros((8, 24, 24, 3), np.uint8), ["a small red circle"] * 8, ncols=4)
    assert toy.size[0] == 4 * 96 + 5 * 6  # 24 px upscaled 4x (as before), 6 px padding
    flux = image_grid(np.zeros((8, 720, 720, 3), np.uint8), ["a prompt"] * 8, ncols=4)
    assert flux.size[0] == 4 * 256 + 5 * 6 and flux.size[1] < 700  # not 11.5k x 5.8k: 256 px cells
    many = image_grid(np.zeros((64, 720, 720, 3), np.uint8), ["a prompt"] * 64, ncols=4)  # 16 rows
    assert max(many.size) == 2048 and many.size[0] > 400  # shrunk as a whole, aspect kept
    explicit = image_grid(np.zeros((2, 24, 24, 3), np.uint8), ncols=2, scale=6)
    assert explicit.size[0] == 2 * 144 + 3 * 6


def test_the_kl_ref_phase_says_at_which_cadence_it_was_measured():
    """train/kl_ref's reference forwards at β = 0 run every train.kl_ref_every iterations: the phase's label says so,
    and its mean counts the iterations without it as 0 (its share of the run, in the overhead)."""
    from jagg_core.setup.params_io import load_params
    from jagg_core.pipeline.report import _Run, breakdown_rows, iteration_breakdown, kl_ref_phase

    toy = load_params(REPO / "params.yaml", "toy")
    assert kl_ref_phase(toy.train) == "kl_ref reference (every 8 it.)"
    assert kl_ref_phase(toy.train.model_copy(update={"kl_ref_every": 1})) == "kl_ref reference (every it.)"
    assert kl_ref_phase(toy.train.model_copy(update={"beta": 0.04})) == "kl_ref reference (β > 0: in the update)"
    assert kl_ref_phase(toy.train.model_copy(update={"kl_ref": False})) == "kl_ref reference (off)"
    curve = [{"iteration": float(i), "time/update": 1.0, "time/iteration": 2.0,
              **({"time/kl_ref": 0.4} if i % 8 == 1 else {})} for i in range(1, 18)]  # measured at 1, 9 and 17
    (b,) = iteration_breakdown([_Run("baseline", 0, curve, None)], toy.train)
    label = "kl_ref reference (every 8 it.)"
    assert b["phases"][label] == pytest.approx(0.8 / 16) and "kl_ref reference" not in b["phases"]
    assert b["overhead_s"] == pytest.approx(0.8 / 16 + b["phases"]["other"])
    assert label in breakdown_rows([b])[0]


def test_iteration_breakdown_by_hand(tmp_path):
    """Each phase's mean over the iterations after the warm-up (absent = 0), "other" the rest, overhead's share."""
    from jagg_core.pipeline.report import _Run, iteration_breakdown

    cols = ["iteration", "time/rollout", "time/reward", "time/update", "time/backward", "time/sync", "time/optimizer",
            "time/fidelity", "time/logging", "time/checkpoint", "time/iteration"]
    rows = [
        [1, 9, 9, 9, 9, 0, 0, 9, 0, 0, 99],  # warm-up: left out
        [2, 1.0, 0.1, 1.5, 1.0, 0.05, 0.05, 0.4, 0.02, 0.0, 3.2],
        [3, 1.0, 0.1, 1.5, 1.0, 0.05, 0.05, None, 0.02, 0.08, 2.9],  # no fidelity this iteration
    ]
    curve = [{c: float(v) for c, v in zip(cols, r) if v is not None} for r in rows]
    (b,) = iteration_breakdown([_Run("jagg", 0, curve, None)])
    p = b["phases"]
    assert b["iteration_s"] == pytest.approx(3.05) and b["iterations"] == 2
    assert p["update forward"] == pytest.approx(0.5) and p["update backward"] == pytest.approx(1.0)
    assert p["fidelity monitor"] == pytest.approx(0.2) and p["checkpoint"] == pytest.approx(0.04)
    assert p["other"] == pytest.approx(3.05 - (1.0 + 0.1 + 0.5 + 1.0 + 0.05 + 0.05 + 0.2 + 0.02 + 0.04))
    assert b["overhead_s"] == pytest.approx(0.2 + 0.02 + 0.04 + p["other"])
    assert b["overhead_share"] == pytest.approx(b["overhead_s"] / 3.05)


# --- the report on damaged, missing or non-finite inputs -----------------------------------------------------------


@pytest.mark.parametrize("damage, says", [
    ("metrics-garbage", "cannot be read as JSON"),
    ("metrics-list", "does not hold an evaluation's metrics"),
    ("metrics-nan", "does not hold an evaluation's metrics"),
    ("curve-garbage", "is not a row of numbers"),
    ("curve-binary", "cannot be read as a curve"),
    ("nothing", "nothing to report"),
])
def test_the_report_on_damaged_or_missing_files_is_one_sentence(damage, says, tmp_path):
    import json

    from jagg_core.setup.paths import Layout
    from jagg_core.pipeline.report import build_report

    params = load_params(PARAMS, "toy", {"profile": "rep", "run.methods": ["jagg"], "eval.metrics": ["toy_fidelity"]})
    lay = Layout(tmp_path, "rep")
    mf = lay.eval_dir("jagg-s0") / "metrics.json"
    curve = lay.curve("jagg-s0")
    mf.parent.mkdir(parents=True)
    curve.parent.mkdir(parents=True)
    mf.write_text(json.dumps({"metrics": {"toy_fidelity": {"benchmark": 0.5}}}))
    curve.write_text("iteration\treward/mean\n1\t0.5\n")
    if damage == "metrics-garbage":
        mf.write_bytes(b"\xff{not json")
    elif damage == "metrics-list":
        mf.write_text("[]")
    elif damage == "metrics-nan":
        mf.write_text('{"metrics": {"toy_fidelity": {"benchmark": NaN}}}')
    elif damage == "curve-garbage":
        curve.write_text("iteration\treward/mean\n1\tgarbage\n")
    elif damage == "curve-binary":
        curve.write_bytes(b"\xff\xfe\x00")
    elif damage == "nothing":
        mf.unlink()
    from jagg_core.pipeline.report import ReportError

    with pytest.raises(ReportError) as e:
        build_report(params, lay)
    assert says in _one_sentence(e.value)


def test_c5_a_curve_with_nan_or_inf_rows_is_reported_not_a_crash(tmp_path):
    """`nan` / `inf` rows (a skipped update's reward, a damaged time) made `jagg report` crash in its statistics
    (statistics.pstdev: AttributeError); a value that is not finite is not a measurement: the speed table and the
    iteration breakdown are built without it."""
    import math

    from jagg_core.pipeline.report import _Run, iteration_breakdown, read_curve, speed_table

    curve = tmp_path / "curve.tsv"
    curve.write_text("iteration\treward/mean\ttime/iteration\ttime/update\ttime/rollout\n1\t0.5\t1.0\t0.5\t0.3\n"
                     "2\tnan\tinf\t0.4\t0.3\n3\t0.6\t1.1\t-inf\t0.3\n4\tinf\tnan\tnan\tnan\n")
    params = load_params(PARAMS, "toy", {"run.methods": ["jagg"]})
    runs = [_Run("jagg", 0, read_curve(curve), None)]
    (speed,) = speed_table(params, runs)
    assert speed["time/update"] == pytest.approx(0.4)  # iterations 2-4 (the first is warm-up): only 0.4 is finite
    (phases,) = iteration_breakdown(runs, params.train)
    assert phases["iteration_s"] == pytest.approx(1.1) and math.isfinite(phases["overhead_share"])


def test_c5_a_refused_report_leaves_no_empty_folder(tmp_path):
    """`jagg report --set outputs=ghost` (nothing evaluated there) is one sentence and leaves no empty report
    folder behind."""
    from jagg_core.pipeline.report import ReportError, build_report
    from jagg_core.setup.paths import Layout

    params = load_params(PARAMS, "toy", {"profile": "rep", "outputs": "ghost"})
    lay = Layout.of(params, tmp_path)
    with pytest.raises(ReportError, match="nothing to report"):
        build_report(params, lay)
    assert not lay.report_dir.exists() and not any(tmp_path.iterdir())
