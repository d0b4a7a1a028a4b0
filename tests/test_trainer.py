"""The GRPO trainer on the ci profile: every method trains, counts are right, kill/resume and 1-vs-2 processes; a
non-finite reward or gradient skips its update, a reward no group varies in is said once, the same seed gives the same
bits."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO, WORKER_ARGS, run_module
from fault_helpers import _ckpts
from jagg_core.setup.params_io import load_params
from jagg_core.setup.paths import Layout
from jagg_core.trainer import TrainingError, latest_checkpoint, list_checkpoints, train
from jagg_core.trainer.checkpoint import load_tensors
from tasks.common import free_port

# A reward with variation even for a barely trained model (toy_fidelity of noise is 0 for every image).
JPEG = {"reward.weights": {"jpeg_compressibility": 1.0}}


def ci(root, **overrides):
    return load_params(root / "params.yaml", "ci", {**JPEG, **overrides})


def base_weights(root):
    from safetensors.torch import load_file

    return load_file(root / "models/ci/base/transformer/diffusion_pytorch_model.safetensors")


@pytest.mark.parametrize("method,backwards,grad_fwd,nograd_fwd", [
    # ci: T = 6 steps, W = 3, jagg_frac = 0.5 → group 0 routed, group 1 exact; one micro-batch per iteration
    ("baseline", 6, 6, 0),
    ("jagg", 1 + 3, 2 + 3, 1),
    ("ablate", 1 + 3, 2 + 3, 1),
])
def test_methods_train_and_count_their_passes(ci_project, method, backwards, grad_fwd, nograd_fwd):
    params = ci(ci_project)
    res = train(params, method, 0, root=ci_project, progress=False)
    assert len(res.history) == params.train.iterations
    for h in res.history:
        assert h["train/backward_calls"] == backwards
        assert h["train/grad_forwards"] == grad_fwd
        assert h["train/nograd_forwards"] == nograd_fwd
        for key in ("time/rollout", "time/reward", "time/update", "time/backward", "time/sync", "time/optimizer",
                    "time/logging", "time/checkpoint", "time/iteration", "train/loss", "train/approx_kl",
                    "train/clipfrac", "train/grad_norm", "reward/mean", "reward/std",
                    "reward/jpeg_compressibility/mean", "train/kl_ref", "time/kl_ref",
                    "reward/jpeg_compressibility/group_std", "reward/jpeg_compressibility/zero_std_frac"):
            assert key in h and h[key] == h[key], key
        assert h["time/backward"] < h["time/update"] < h["time/iteration"]
        # The phases are disjoint parts of the iteration (checkpointed every iteration in ci).
        phases = ("rollout", "reward", "update", "sync", "optimizer", "fidelity", "kl_ref", "logging", "checkpoint")
        assert sum(h.get(f"time/{k}", 0.0) for k in phases) <= h["time/iteration"]
        assert h["time/checkpoint"] > 0
    assert any(k.startswith("jagg/cos_jagg/g") for k in res.history[0])  # fidelity monitor (every iteration in ci)
    ckpt = latest_checkpoint(Layout(ci_project, "ci").checkpoints(f"{method}-s0"))
    assert ckpt is not None and ckpt.iteration == params.train.iterations
    trained, base = ckpt.tensors(), base_weights(ci_project)
    assert set(trained) == set(base)
    changed = sum(not torch.equal(trained[k], base[k]) for k in base)
    assert changed > len(base) // 2  # the update really moved the transformer
    curve = (ci_project / "runs/ci" / f"{method}-s0" / "curve.tsv").read_text().splitlines()
    assert len(curve) == 1 + params.train.iterations and curve[0].startswith("iteration\t")


def test_a_method_at_its_own_learning_rate_and_the_update_size_it_logs(ci_project):
    """Issue 72's machinery: a method's ``lr_scale`` is its AdamW rate over train.lr, and ``train.update_size_every``
    logs the update's size (‖Δθ‖, ‖Δθ‖/‖θ‖, cos(Δθ, −gradient)) and keeps Δθ in the run's updates/ folder. AdamW's
    first step is Δθ = −lr (m̂/(√v̂ + ε) + wd θ), proportional to the rate: at the same seed (same weights, same
    rollout) the method at 2.25 × the rate makes 2.25 × the baseline's update, in the same direction."""
    from safetensors.torch import load_file

    params = ci(ci_project, **{"methods.baseline-x2_25": {"mode": "exact", "lr_scale": 2.25},
                               "train.update_size_every": 1, "train.iterations": 1})
    runs = {m: train(params, m, 0, root=ci_project, progress=False).history[0] for m in ("baseline", "baseline-x2_25")}
    for h in runs.values():
        assert h["train/update_norm"] > 0 and 0 < h["train/update_rel"] < 1 and 0 < h["train/update_cos_grad"] <= 1
    assert runs["baseline-x2_25"]["train/update_norm"] / runs["baseline"]["train/update_norm"] == \
        pytest.approx(2.25, rel=1e-3)
    flat = {m: torch.cat([v.flatten().double() for _, v in sorted(load_file(
        ci_project / "runs/ci" / f"{m}-s0" / "updates" / "update-000001.safetensors").items())]) for m in runs}
    a, b = flat["baseline"], flat["baseline-x2_25"]
    assert float(a @ b / (a.norm() * b.norm())) > 0.9999 and float(b.norm() / a.norm()) == pytest.approx(2.25, rel=1e-3)
    optimizer = torch.load(ci_project / "checkpoints/ci/baseline-x2_25-s0/checkpoint-000001/optimizer.pt",
                           weights_only=True)
    assert optimizer["param_groups"][0]["lr"] == pytest.approx(2.25 * params.train.lr, rel=1e-12)
    assert params.method("baseline").lr_scale == 1.0  # and the fingerprint of a method without one is unchanged


def test_mix_grpo_slides_one_jagg_group_along_the_trajectory(ci_project):
    """MixGRPO: the SDE window (= one JAGG group of W = 3) moves one step every iteration here; JAGG trains it with
    two graphs and one no-grad middle forward."""
    params = ci(ci_project, **{"sample.recipe": "mix_grpo", "sample.sde_window_size": 3,
                               "sample.sde_window_range": [0, 4], "sample.window_shift_every": 1,
                               "jagg.jagg_frac": 1.0, "train.iterations": 2})
    res = train(params, "jagg", 0, root=ci_project, progress=False)
    assert [h["sample/window_start"] for h in res.history] == [0, 1]
    for h in res.history:
        assert (h["train/grad_forwards"], h["train/nograd_forwards"], h["train/backward_calls"]) == (2, 1, 1)


def test_reuse_drops_the_middle_forwards(ci_project):
    params = ci(ci_project)
    res = train(params, "jagg-reuse", 0, root=ci_project, progress=False)
    for h in res.history:
        assert h["train/nograd_forwards"] == 0 and h["jagg/reused_velocities"] == 1


def test_auto_jagg_frac_is_read_off_the_fidelity_curve(ci_project):
    params = ci(ci_project, **{"jagg.jagg_frac": "auto", "jagg.auto_threshold": -1.0})
    res = train(params, "jagg", 0, root=ci_project, progress=False)
    assert res.history[0]["jagg/jagg_frac"] == 1.0  # every cosine ≥ −1
    params = ci(ci_project, **{"jagg.jagg_frac": "auto", "jagg.auto_threshold": 1.0})
    res = train(params, "jagg", 1, root=ci_project, progress=False)
    assert res.history[0]["jagg/jagg_frac"] == 0.0 and res.history[0]["train/nograd_forwards"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["rollout@3:kill", "update@2:kill", "checkpoint@3:kill"])
def test_killed_training_resumes_to_the_same_parameters(ci_project, uninterrupted, fault):
    args = [*WORKER_ARGS, "--method", "jagg"]
    killed = run_module("tasks.train", *args, root=ci_project, env={"JAGG_FAULT": fault})
    assert killed.returncode == -signal.SIGKILL
    done = latest_checkpoint(Layout(ci_project, "ci").checkpoints("jagg-s0"))
    assert done is None or done.iteration < 4  # it really died before the end
    resumed = run_module("tasks.train", *args, root=ci_project)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = uninterrupted("jagg")
    b = load_tensors(Layout(ci_project, "ci").checkpoints("jagg-s0") / "checkpoint-000004/trainable.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    rows = (Layout(ci_project, "ci").curve("jagg-s0")).read_text().splitlines()
    assert [r.split("\t")[0] for r in rows[1:]] == ["1", "2", "3", "4"]  # the curve stays complete, no duplicates


@pytest.mark.slow
def test_two_processes_update_like_one(ci_base, tmp_path):
    """gloo, 2 processes × 1 prompt vs 1 process × 2 prompts: the same global batch, the same update."""
    import shutil

    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(ci_base, one)
    shutil.copytree(ci_base, two)
    args = ["--profile", "ci", "--method", "jagg", "--seed", "0", "--set", "reward.weights={jpeg_compressibility: 1.0}",
            "--set", "train.adam_eps=1.0", "--set", "train.lr=1.0",  # an update linear in the gradient
            "--set", "train.iterations=1", "--set", "sample.batch_size=4", "--set", "train.micro_batch=4"]
    env = {"JAGG_ROOT": str(one), "PYTHONPATH": str(REPO)}
    r1 = subprocess.run([sys.executable, "-m", "tasks.train", "--worker", *args], cwd=one,
                        env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert r1.returncode == 0, r1.stderr[-2000:]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
              str(free_port()), "-m", "tasks.train", "--worker", *args]
    r2 = subprocess.run(launch, cwd=two, env={**os.environ, **env, "JAGG_ROOT": str(two)}, capture_output=True,
                        text=True, timeout=600)
    assert r2.returncode == 0, r2.stderr[-3000:]
    a = load_tensors(Layout(one, "ci").checkpoints("jagg-s0") / "checkpoint-000001/trainable.safetensors")
    b = load_tensors(Layout(two, "ci").checkpoints("jagg-s0") / "checkpoint-000001/trainable.safetensors")
    base = base_weights(one)
    moved = max(float((a[k] - base[k]).abs().max()) for k in a)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert moved > 1e-4  # the step did something
    assert diff <= 1e-3 * moved, (diff, moved)  # float32 reduction order only
    curve = (Layout(two, "ci").curve("jagg-s0")).read_text().splitlines()
    head, row = curve[0].split("\t"), curve[1].split("\t")
    assert float(row[head.index("train/all_reduces")]) == 1  # one gradient all-reduce per optimizer step


def test_jagg_export_turns_a_checkpoint_into_a_transformer_folder(uninterrupted, tmp_path):
    """`jagg export` on a trained ci run: the checkpoint at step 2 becomes exports/ci/jagg-s0-step2/transformer/, which
    diffusers loads with exactly the checkpoint's weights; a missing run or step is one sentence."""
    from diffusers import FluxTransformer2DModel

    uninterrupted("jagg")
    root = tmp_path / "project"  # the reference run's folder is shared by the suite's workers: export in a copy
    shutil.copytree(uninterrupted.roots["jagg"], root)
    out = run_module("tasks.export", "--profile", "ci", "--run", "jagg-s0", "--step", "2", root=root)
    assert out.returncode == 0, out.stderr[-2000:]
    folder = root / "exports/ci/jagg-s0-step2"
    assert out.stdout.strip().endswith("exports/ci/jagg-s0-step2")
    got = FluxTransformer2DModel.from_pretrained(folder / "transformer").state_dict()
    want = load_tensors(root / "checkpoints/ci/jagg-s0/checkpoint-000002/trainable.safetensors")
    assert want and all(torch.equal(got[k], v) for k, v in want.items())
    for args, needle in ((["--run", "nope-s0"], "run 'nope-s0' of profile 'ci' has no complete checkpoint"),
                         (["--run", "jagg-s0", "--step", "99"], "run 'jagg-s0' has no checkpoint at step 99")):
        bad = run_module("tasks.export", "--profile", "ci", *args, root=root)
        assert bad.returncode == 1 and needle in bad.stderr and "Traceback" not in bad.stderr


# --- non-finite rewards and gradients, a reward no group varies in, determinism ------------------------------------


def test_non_finite_rewards_skip_updates_then_stop_the_run(ci_project, monkeypatch):
    params = ci(ci_project, **{"train.iterations": 5, "train.checkpoint_every": 1, "train.max_consecutive_skips": 2})
    monkeypatch.setenv("JAGG_FAULT", "reward@2:nan,reward@4:nan,reward@5:nan")
    with pytest.raises(TrainingError, match="2 consecutive updates were skipped"):
        train(params, "jagg", 0, root=ci_project, progress=False)
    curve = (Layout(ci_project, "ci").curve("jagg-s0")).read_text().splitlines()
    head = curve[0].split("\t")
    skipped = [float(r.split("\t")[head.index("train/skipped_updates")]) for r in curve[1:]]
    assert skipped == [0, 1, 0, 1, 1]
    # iteration 2's update was skipped: its weights equal iteration 1's; no NaN was ever saved
    a = load_tensors(_ckpts(ci_project) / "checkpoint-000001/trainable.safetensors")
    b = load_tensors(_ckpts(ci_project) / "checkpoint-000002/trainable.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    for c in list_checkpoints(_ckpts(ci_project)):
        assert all(torch.isfinite(t).all() for t in c.tensors().values())


def test_a_non_finite_gradient_skips_the_update(ci_project, monkeypatch):
    params = ci(ci_project, **{"train.iterations": 2, "train.checkpoint_every": 1})
    monkeypatch.setenv("JAGG_FAULT", "update@2:nan")  # a NaN in one gradient entry after iteration 2's backward
    res = train(params, "jagg", 0, root=ci_project, progress=False)
    assert [h["train/skipped_updates"] for h in res.history] == [0, 1]  # found by the real isfinite(grad norm)
    one, two = (load_tensors(_ckpts(ci_project) / f"checkpoint-00000{i}/trainable.safetensors") for i in (1, 2))
    assert all(torch.equal(one[k], two[k]) for k in one)  # the step was not taken: no NaN reached the weights


def test_a_reward_no_group_varies_in_says_so_once_and_updates_nothing(ci_project, caplog):
    """ci's base never draws what a prompt asks for: toy_fidelity alone is 0 for every image, so no group varies.
    The trainer says so once, in a sentence naming the reward's mean, and no image is kept for the update."""
    import csv
    import logging

    params = load_params(ci_project / "params.yaml", "ci",
                         {"reward.weights": {"toy_fidelity": 1.0}, "train.iterations": 2})
    with caplog.at_level(logging.WARNING, logger="jagg_core.trainer.loop"):
        train(params, "jagg", 0, root=ci_project, progress=False)
    said = [r.getMessage() for r in caplog.records if "earned equal rewards" in r.getMessage()]
    assert len(said) == 1 and "toy_fidelity 0.0000" in said[0] and "reward.weights" in said[0], said
    rows = list(csv.DictReader(Layout(ci_project, "ci").curve("jagg-s0").open(), delimiter="\t"))
    assert [float(r["train/kept_fraction"]) for r in rows] == [0.0, 0.0]


def test_same_seed_same_profile_is_bit_identical_on_cpu(ci_base, tmp_path):
    runs = []
    for name in ("a", "b"):
        root = tmp_path / name
        shutil.copytree(ci_base, root)
        train(ci(root), "jagg", 0, root=root, progress=False)
        runs.append(latest_checkpoint(_ckpts(root)).tensors())
    a, b = runs
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
