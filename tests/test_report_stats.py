"""The report's statistics beyond the seeds (jagg_core/pipeline/report_stats.py) and the side-by-side speed table
(jagg_core/bench/side_by_side.py:speed_rows), on small hand-made inputs with answers worked out by hand."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from jagg_core.bench.side_by_side import speed_rows
from jagg_core.pipeline.report_stats import (NONINFERIORITY_MARGIN, prompt_intervals, seconds_per_iteration,
                                             t_interval, time_to_target, verdict)
from jagg_core.setup.paths import Layout


@dataclass
class Run:
    method: str
    seed: int
    curve: list = field(default_factory=list)
    eval: dict | None = None


def _scores(lay: Layout, run: str, step: int, values: dict[str, list[float]]) -> None:
    d = lay.eval_dir(run) / "steps" / f"{step:06d}"
    d.mkdir(parents=True)
    rows = [{"style": s, "index": i, "prompt": f"{s} {i}", "toy_fidelity": v} for s, vs in values.items()
            for i, v in enumerate(vs)]
    (d / "scores.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_prompt_intervals_cover_the_point_and_resample_runs_together(tmp_path):
    lay = Layout(tmp_path, "toy")
    rng = np.random.default_rng(1)
    base = {s: list(rng.uniform(0, 1, 40)) for s in ("a", "b")}
    _scores(lay, "base", 0, base)
    runs = []
    for seed in (0, 1, 2):
        for method, shift in (("baseline", 0.05), ("jagg", 0.04)):
            vals = {s: [min(1.0, v + shift) for v in vs] for s, vs in base.items()}
            _scores(lay, f"{method}-s{seed}", 8, vals)
            runs.append(Run(method, seed, eval={"step": 8}))
    out = prompt_intervals(lay, runs, ["toy_fidelity"], "hpdv2-benchmark", [("jagg", "baseline")])
    point = np.mean([np.mean(v) for v in base.values()])
    lo, hi = out["base"]["toy_fidelity"]
    assert lo < point < hi and hi - lo > 0.01  # 80 prompts of U(0, 1): an interval of several hundredths
    g_lo, g_hi = out["methods"]["baseline"]["toy_fidelity"]["gain"]
    # every prompt moved by the same +0.05 (but where clipped at 1): the gain's interval is narrow around +0.05,
    # far narrower than the score's own, because final and base are resampled prompt by prompt together
    assert 0.03 < g_lo <= g_hi <= 0.05 + 1e-12 and g_hi - g_lo < 0.25 * (hi - lo)
    (pair,) = out["pairs"]
    assert pair["seeds"] == [0, 1, 2] and -0.0101 < pair["prompts"][0] <= pair["prompts"][1] < 0.0


def test_t_interval_is_students():
    iv = t_interval([1.0, 2.0, 3.0])
    assert iv["mean"] == 2.0 and iv["sd"] == 1.0
    assert iv["hi"] - 2.0 == pytest.approx(4.302652729911275 / 3 ** 0.5)  # t(0.975, 2) / sqrt(3)
    assert np.isnan(t_interval([1.0])["lo"])


def test_time_to_target_interpolates_counts_misses_and_pairs_by_seed():
    def run(method, seed, gains):
        curve = [{"step": 8 * (k + 1), "eval/toy_fidelity": 0.3 + g} for k, g in enumerate(gains)]
        return Run(method, seed, eval={"step": 8 * len(gains), "curve": curve})

    runs = [run("baseline", 0, [0.01, 0.02, 0.03, 0.04]), run("baseline", 1, [0.02, 0.03, 0.04, 0.04]),
            run("jagg", 0, [0.02, 0.04, 0.05, 0.05]), run("jagg", 1, [0.01, 0.02, 0.03, 0.035])]
    spi = {"baseline": {"seconds": 2.0, "source": "side by side"}, "jagg": {"seconds": 1.5, "source": "side by side"}}
    out = time_to_target(runs, "toy_fidelity", 0.3, spi, images_per_iteration=128)
    assert out["target_gain"] == pytest.approx(0.04)
    b, j = out["methods"]["baseline"], out["methods"]["jagg"]
    # baseline seed 0 reaches +0.04 at iteration 32 (64 s), seed 1 at 24 (48 s); jagg seed 0 at 16 (24 s), seed 1 never
    assert b["reached"] == 2 and b["seconds"] == pytest.approx([64.0, 48.0])
    assert j["reached"] == 1 and j["iterations"] == pytest.approx([16.0]) and j["images"] == [16 * 128]
    assert j["paired_seconds_vs_baseline"]["seeds"] == [0] and j["paired_seconds_vs_baseline"]["mean"] == -40.0
    # final gain per 1000 s: jagg seed 0 +0.05 over 48 s, baseline seed 0 +0.04 over 64 s
    assert j["paired_gain_per_1000s_vs_baseline"]["n"] == 2
    half = run("jagg", 2, [0.0, 0.06])  # crosses +0.04 two thirds of the way from iteration 8 to 16
    assert time_to_target([*runs, half], "toy_fidelity", 0.3, spi, 128)["methods"]["jagg"]["iterations"][-1] == \
        pytest.approx(8 + 8 * 2 / 3)


def test_seconds_per_iteration_prefers_one_machine_state():
    runs = [Run("baseline", 0, curve=[{"time/iteration": 9.0}, {"time/iteration": 3.0, "time/rollout": 1.0,
                                                                  "time/update": 1.5}]),
            Run("jagg", 0, curve=[{"time/iteration": 9.0}, {"time/iteration": 5.0, "time/rollout": 3.0,
                                                              "time/update": 1.5}])]
    own = seconds_per_iteration(runs, None)
    assert own == {"baseline": {"seconds": 3.0, "source": "the runs' own"},
                   "jagg": {"seconds": 5.0, "source": "the runs' own"}}  # the loaded jagg run looks slower
    side = {"rollout": {"median": 1.0}, "methods": {"baseline": {"update": {"median": 1.5}},
                                                   "jagg": {"update": {"median": 1.0}}}}
    got = seconds_per_iteration(runs, side)
    assert got["baseline"]["seconds"] == pytest.approx(1.0 + 1.5 + 0.5) and got["jagg"]["seconds"] == \
        pytest.approx(1.0 + 1.0 + 0.5)  # the rest (0.5 s in both runs) pooled


@pytest.mark.parametrize("lo, words", [(-0.009, "is non-inferior"), (-0.011, "is not shown non-inferior")])
def test_verdict_says_what_the_intervals_say(lo, words):
    paired = [{"a": "jagg", "b": "baseline", "n": 10, "mean": -0.001, "lo": lo, "hi": 0.007},
              {"a": "ablate", "b": "jagg", "n": 10, "mean": -0.006, "lo": -0.012, "hi": -0.001},
              {"a": "ablate", "b": "baseline", "n": 10, "mean": -0.005, "lo": -0.011, "hi": 0.002}]
    text = verdict(paired, "toy_fidelity")
    assert f"JAGG {words} to the exact baseline at a margin of {NONINFERIORITY_MARGIN:g}" in text
    assert "ablation learns less than JAGG" in text and "no difference between the endpoint-only ablation and " \
                                                         "the baseline is shown" in text
    assert verdict([], "toy_fidelity") == ""


def test_speed_rows_flag_a_speedup_beyond_the_cost_model():
    def m(mode, median, grad, nograd, reused=0.0):
        return {"mode": mode, "update": {"median": median, "q1": median, "q3": median},
                "counts": {"grad_forwards": grad, "nograd_forwards": nograd, "reused_velocities": reused,
                           "backward_calls": 1.0}}

    rows = {r["method"]: r for r in speed_rows({"methods": {
        "baseline": m("exact", 1.2, 4, 0), "exact-batched": m("exact_batched", 1.0, 4, 0),
        "jagg": m("jagg", 0.85, 2, 2), "jagg-reuse": m("jagg", 0.3, 2, 0, 2)}})}
    assert rows["jagg"]["ideal"] == pytest.approx(1.5) and not rows["jagg"]["above_ideal"]
    assert rows["jagg"]["speedup_vs_best_exact"] == pytest.approx(1.0 / 0.85)
    assert rows["jagg-reuse"]["ideal"] == pytest.approx(2.0) and rows["jagg-reuse"]["above_ideal"]  # 4x: flagged
    assert rows["exact-batched"]["above_ideal"]  # 1.2x on forwards the cost model counts the same: flagged


def test_side_by_side_times_every_method_on_the_profiles_own_model_and_batch(toy_base):
    """The `speed` stage's measurement on the shipped base with toy's real batch shape (cut to 2 prompts x 4 images to
    stay quick): every method timed once per round, the counts that fix the ideal, and a table the report reads."""
    import torch

    from jagg_core.bench.side_by_side import side_by_side
    from jagg_core.build import policy_from_params
    from jagg_core.setup.params_io import load_params

    params = load_params(Path(__file__).parents[1] / "params.yaml", "toy",
                         {"sample.group_size": 4, "sample.prompts_per_iteration": 2, "train.micro_batch": 8})
    lay = Layout.of(params, toy_base)
    torch.set_num_threads(1)
    policy = policy_from_params(params, lay, torch.device("cpu"))
    res = side_by_side(params, lay, ["baseline", "jagg", "jagg-reuse"], policy=policy, rounds=3)
    assert res["images"] == 8 and res["trained_steps"] == [0, 1, 2, 3] and res["rollout"]["n"] == 3
    assert all(m["update"]["n"] == 3 and len(m["update"]["samples"]) == 3 for m in res["methods"].values())
    counts = {k: v["counts"] for k, v in res["methods"].items()}
    assert counts["baseline"]["grad_forwards"] == 4 and counts["jagg"]["grad_forwards"] == 2
    assert counts["jagg"]["nograd_forwards"] == 2 and counts["jagg-reuse"]["reused_velocities"] == 2
    ideal = {r["method"]: r["ideal"] for r in res["table"]}
    assert ideal == pytest.approx({"baseline": 1.0, "jagg": 1.5, "jagg-reuse": 2.0})
    assert all(p.grad is None for p in policy.trainable_parameters())  # nothing left behind for a trainer
    with pytest.raises(ValueError, match="at least 3"):
        side_by_side(params, lay, ["baseline"], policy=policy, rounds=2)
