"""scripts/jagg_fidelity_study.py's arithmetic on small float64 models (docs/jagg_fidelity.md): the Gram readings
agree with gradient_fidelity, the per-step error split sums to the total, and Theorem 1's premise gives a zero
velocity residual and a zero error. Its command line refuses what it cannot use in one sentence."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from fault_helpers import _one_sentence
from jagg_core import interpolation_weights
from jagg_core.fidelity import gradient_fidelity
from velocity_models import AffineVelocity, NonlinearVelocity, ppo_problem, segment_group

T = [1000.0, 916.7, 833.3, 750.0]  # the toy's first group of W = 4 (12 steps, SDE on 0–3)


@pytest.fixture(scope="module")
def study():
    path = Path(__file__).resolve().parents[1] / "scripts" / "jagg_fidelity_study.py"
    spec = importlib.util.spec_from_file_location("jagg_fidelity_study", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _per_image(study, model, t, zs, batch):
    """Components and velocity Grams image by image, as the study computes them on the toy."""
    velocity, step_loss = ppo_problem(model, t, zs, clip_range=10.0)  # no clipping: the loss separates per image
    comps, vgs = [], []
    for i in range(batch):
        def vel(j, i=i):
            return velocity(j)[i : i + 1]

        def loss(j, v, i=i):  # image i's own term of the batch mean (the other rows' v held at their values)
            full = velocity(j).detach().clone()
            full = torch.cat([full[:i], v, full[i + 1 :]])
            return step_loss(j, full)

        c, vg = study.image_components(list(model.parameters()), vel, loss, len(t), dtype=torch.float64)
        comps.append(c)
        vgs.append(vg)
    return study.block_gram(comps), np.stack(vgs), velocity, step_loss


@pytest.mark.parametrize("model_cls", [AffineVelocity, NonlinearVelocity])
def test_reading_matches_gradient_fidelity_and_split_sums(study, model_cls):
    torch.manual_seed(0)
    model = model_cls(seed=3)
    batch = 4
    t, zs = segment_group(T, batch=batch, off_segment=0.3)
    gram, vgram, velocity, step_loss = _per_image(study, model, t, zs, batch)
    alpha = [float(a) for a in interpolation_weights(t)]
    rd = study.Reading(gram, vgram, range(batch), len(t))
    rec = study.measure_reading(rd, alpha)
    ref = gradient_fidelity(model.parameters(), velocity, step_loss, t, len(t))
    assert rec["cos_t"] == pytest.approx(ref.cos_jagg[0], abs=1e-9)
    assert rec["cos_ablate"] == pytest.approx(ref.cos_ablate[0], abs=1e-9)
    assert rec["norm_ratio_jagg"] == pytest.approx(ref.norm_ratio_jagg[0], abs=1e-9)
    # the shares ⟨e_j, e⟩/‖e‖² of the middle steps sum to 1, and Σ_j e_j is the whole error
    assert sum(s["share"] for s in rec["split"].values()) == pytest.approx(1.0, abs=1e-9)
    e = rd.jagg({j: alpha[j] for j in rd.mids}) - rd.exact()
    parts = sum(rd.step_error(j, alpha[j]) for j in rd.mids)
    assert np.allclose(parts, e)
    # the oracle α is at least as close to the exact gradient as the paper's α
    assert rec["cos_oracle"] >= rec["cos_t"] - 1e-9


def test_affine_velocity_on_the_segment_is_linear_and_exact(study):
    """Theorem 1's premise: v affine in (z, t), inputs on the endpoints' segment with the t-weighted α. Then v_j is
    the endpoints' interpolation (zero residual, fitted α = t-weighted α) and JAGG's error is zero."""
    model = AffineVelocity(seed=5)
    batch = 3
    t, zs = segment_group(T, batch=batch, off_segment=0.0)
    gram, vgram, *_ = _per_image(study, model, t, zs, batch)
    alpha = [float(a) for a in interpolation_weights(t)]
    rd = study.Reading(gram, vgram, range(batch), len(t))
    rec = study.measure_reading(rd, alpha)
    for j in rd.mids:
        assert rec["residual_t"][str(j)] < 1e-6
        assert rec["alpha_fit"][str(j)] == pytest.approx(alpha[j], abs=1e-6)
    assert rec["rel_err"] < 1e-6
    assert rec["cos_t"] == pytest.approx(1.0, abs=1e-9)
    # off the segment the residual is not zero, and neither is the error
    t, zs = segment_group(T, batch=batch, off_segment=0.5)
    gram, vgram, *_ = _per_image(study, model, t, zs, batch)
    rec = study.measure_reading(study.Reading(gram, vgram, range(batch), len(t)), alpha)
    assert min(rec["residual_t"].values()) > 1e-3 and rec["rel_err"] > 1e-3


def test_t_interval_and_residual_formula(study):
    m, lo, hi, n = study.t_interval([1.0, 2.0, 3.0])
    assert (m, n) == (2.0, 3) and lo < 2.0 < hi and math.isclose(hi - 2.0, 4.302652729911275 / math.sqrt(3))
    rng = np.random.default_rng(0)
    v = rng.normal(size=(2, 4, 7))
    vg = np.einsum("bid,bjd->bij", v, v)
    a = 0.4
    direct = ((v[:, 1] - (1 - a) * v[:, 0] - a * v[:, 3]) ** 2).sum(-1)
    assert np.allclose(study.residual_sq(vg, 1, a), direct)


# --- the script's command line: one sentence for what it cannot use ------------------------------------------------


def _study():
    """scripts/jagg_fidelity_study.py as a module (in this process: torch is imported once)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("jagg_fidelity_study", REPO / "scripts" / "jagg_fidelity_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _refused_by_study(capsys, *args: str) -> str:
    assert _study().main(list(args)) == 1
    return _one_sentence(capsys.readouterr().err)


def test_estimator_stats_projection_and_orthogonal_share_by_their_definitions(study):
    """Issue 72's readings of an estimator, in float64 against their definitions written out: the projection
    coefficient ⟨E g_d, g⟩/‖g‖² and the orthogonal share of the squared error, for a deterministic estimator (a
    scaled exact gradient: projection = the scale, no orthogonal error; a rotated one: all of the error's
    component off g) and for a two-draw law."""
    torch.manual_seed(0)
    g = torch.randn(50, dtype=torch.float64)
    half = study.estimator_stats([(1.0, 0.5 * g)], g)
    assert half["proj"] == pytest.approx(0.5, abs=1e-15) and half["orth_share"] == pytest.approx(0.0, abs=1e-15)
    u = torch.randn(50, dtype=torch.float64)
    u -= (u @ g) / (g @ g) * g  # orthogonal to g
    side = study.estimator_stats([(1.0, g + u)], g)
    assert side["proj"] == pytest.approx(1.0, abs=1e-12) and side["orth_share"] == pytest.approx(1.0, abs=1e-12)
    draws = [(0.25, torch.randn(50, dtype=torch.float64)), (0.75, torch.randn(50, dtype=torch.float64))]
    got = study.estimator_stats(draws, g)
    mean = sum(w * d for w, d in draws)
    assert got["proj"] == pytest.approx(float(mean @ g / (g @ g)), rel=1e-12)
    orth = sum(w * float(((d - (d @ g) / (g @ g) * g) ** 2).sum()) for w, d in draws)
    err = sum(w * float(((d - g) ** 2).sum()) for w, d in draws)
    assert got["orth_share"] == pytest.approx(orth / err, rel=1e-12)
    assert 0 < got["orth_share"] and got["mse"] == pytest.approx(err / float(g @ g), rel=1e-12)
    # a reading stored before the two existed: derived from its cosine, norm ratio and MSE where it is deterministic
    one = study.estimator_stats([(1.0, draws[0][1])], g)
    old = {k: v for k, v in one.items() if k not in ("proj", "orth_share")}
    derived = study.derived_projection(old)
    assert derived["proj"] == pytest.approx(one["proj"], rel=1e-9)
    assert derived["orth_share"] == pytest.approx(one["orth_share"], rel=1e-9)
    two = {k: v for k, v in got.items() if k not in ("proj", "orth_share")}
    assert study.derived_projection(two) == two  # a two-draw law's: not determined by what was kept


def test_m6_fidelity_study_summarise_only_on_an_empty_folder_is_one_sentence(tmp_path, capsys):
    """`scripts/jagg_fidelity_study.py --summarise-only` on an empty folder was "ValueError: min() arg is an empty
    sequence" (a traceback). Now one sentence, exit 1, nothing written."""
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no readings to summarise" in _refused_by_study(capsys, "--summarise-only", "--out", str(empty))
    assert list(empty.iterdir()) == []


def test_m6_fidelity_study_a_cut_readings_file_is_one_sentence(tmp_path, capsys):
    """A readings.jsonl cut in its second line was a JSONDecodeError traceback. Now one sentence naming the line, exit
    1, the file as it was and no summary written."""
    cut = tmp_path / "cut"
    cut.mkdir()
    readings = (REPO / "docs" / "jagg_fidelity" / "readings.jsonl").read_text()
    text = readings[: len(readings.splitlines()[0]) * 3 // 2]
    (cut / "readings.jsonl").write_text(text)
    said = _refused_by_study(capsys, "--summarise-only", "--out", str(cut))
    assert "readings.jsonl line 2 is not a whole reading" in said
    assert sorted(p.name for p in cut.iterdir()) == ["readings.jsonl"] and (cut / "readings.jsonl").read_text() == text


def test_m6_fidelity_study_a_model_name_with_dot_dot_is_one_sentence(tmp_path, capsys):
    """`--models 'jagg-s0/../x'` loaded the toy model, then ended in FileNotFoundError (a traceback) for the folder
    the name led to. Now the name is refused as a run name before anything is loaded or written."""
    fresh, work = tmp_path / "fresh", tmp_path / "work"
    said = _refused_by_study(capsys, "--models", "base,jagg-s0/../x", "--out", str(fresh), "--work", str(work))
    assert "'jagg-s0/../x' is not a run name" in said
    assert not fresh.exists() and not work.exists()
