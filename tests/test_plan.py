"""`jagg plan`: the cost arithmetic by hand, every real profile's table, and its one-sentence errors."""

from __future__ import annotations

import pytest

from conftest import REPO
from jagg_core.setup.params_io import load_params
from jagg_core.pipeline.plan import GPUS, format_plan, forward_flops, plan
from jagg_core.setup.registry import backbone_spec

REAL = ("flux", "flux-fast", "qwenimage-dance", "qwenimage", "sd3", "wan")


def test_forward_flops_by_hand():
    """2·N·S + 4·L·S²·d per image and step; S = (H/16)·(W/16) + text tokens; ×2 under CFG."""
    a = backbone_spec("flux").cost
    s = 32 * 32 + 512  # 512 px: 1024 image tokens + 512 T5 tokens
    assert forward_flops(a, 512, 512, 1) == pytest.approx(2 * 11.9e9 * s + 4 * 57 * s * s * 3072)
    assert forward_flops(a, 512, 512, 2) == pytest.approx(2 * forward_flops(a, 512, 512, 1))


def test_video_forward_flops_by_hand():
    """Wan: S = latent frames × patches (49 frames → 13; 512 px → 32 × 32), text by cross-attention."""
    a = backbone_spec("wan").cost
    s = 13 * 32 * 32
    want = 2 * 1.42e9 * s + 4 * 30 * s * s * 1536 + 4 * 30 * s * 512 * 1536
    assert forward_flops(a, 512, 512, 1, frames=49) == pytest.approx(want)
    p = plan(load_params(REPO / "params.yaml", "wan"))
    assert p["tokens"] == s and p["frames"] == 49 and p["cfg_forwards"] == 2
    rows = {r["method"]: r for r in p["methods"]}
    assert rows["jagg"]["update_speedup"] > 1 and rows["jagg"]["iteration_speedup"] > 1


def test_update_counts_follow_the_trainers_routing():
    """flux (DanceGRPO): 16 steps in 4 groups of W = 4, the first round(0.6·4) = 2 JAGG (2 graphs + 2 no-grad
    forwards each), 2 exact (4 graphs each); timestep_fraction 0.6 keeps round(0.6·4) = 2 of the 4 groups."""
    p = plan(load_params(REPO / "params.yaml", "flux"))
    rows = {r["method"]: r for r in p["methods"]}
    assert (rows["baseline"]["grad_forwards_per_image"], rows["baseline"]["nograd_forwards_per_image"]) == (8, 0)
    assert (rows["jagg"]["grad_forwards_per_image"], rows["jagg"]["nograd_forwards_per_image"]) == (6, 2)
    # Update FLOPs: images · (graphs · (f + b) + no-grad · f), b = 3 f with gradient checkpointing.
    f = p["forward_tflop_per_image_step"] * 1e12
    images = 16 * 12
    assert rows["baseline"]["update_pflop"] * 1e15 == pytest.approx(images * 8 * 4 * f)
    assert rows["jagg"]["update_pflop"] * 1e15 == pytest.approx(images * (6 * 4 * f + 2 * f))
    assert rows["jagg"]["update_speedup"] == pytest.approx(32 / 26)
    # Time = FLOPs / (GPUs · peak · utilisation).
    rate = 8 * GPUS["H100"]["peak_tflops"] * 1e12 * p["utilisation"]
    assert rows["jagg"]["H100_iteration_s"] == pytest.approx(rows["jagg"]["iteration_pflop"] * 1e15 / rate)


def test_one_window_of_four_is_the_textbook_ratio_with_lora_and_checkpointing():
    """Flow-GRPO-Fast with a 4-step window as one JAGG group, LoRA with gradient checkpointing (b = 1 + 1 = 2):
    exact 4·(f + 2f) = 12 f, JAGG 2·3f + 2f = 8 f; `jagg plan` prints the backward's cost and why."""
    p = plan(load_params(REPO / "params.yaml", "qwenimage"))
    jagg = next(r for r in p["methods"] if r["method"] == "jagg")
    assert p["lora_rank"] and p["gradient_checkpointing"] and p["backward_forwards"] == 2
    assert jagg["update_speedup"] == pytest.approx(1.5)
    assert ("backward = 2 forwards (LoRA: the frozen base's weight gradients are skipped, only the activations' are "
            "computed; gradient checkpointing recomputes the forward)") in format_plan(p)
    assert p["paper"] == {"update": (393.0, 275.0), "iteration": (674.0, 556.0)}


def test_reference_forwards_and_the_monitor_are_counted():
    """qwenimage (β = 0, one group of W = 4): train/kl_ref's two endpoint forwards per image at 25 of 200 iterations
    (iterations 1, 9, 17, …) beside the update, the fidelity monitor not run under FSDP. sd3 (β = 0.04): one
    reference forward per trained step in every update, and the monitor (DDP) at 10 of 200 iterations."""
    p = plan(load_params(REPO / "params.yaml", "qwenimage"))
    f, images = p["forward_tflop_per_image_step"] * 1e12, 256
    for r in p["methods"]:
        assert r["reference_forwards_per_image"] == pytest.approx(2 * 25 / 200)
        assert r["forwards"]["monitor_grad"] == r["forwards"]["monitor_runs"] == 0
        assert r["diagnostics_pflop"] * 1e15 == pytest.approx(images * 0.25 * f)
        assert r["iteration_pflop"] == pytest.approx(r["update_pflop"] + r["diagnostics_pflop"]
                                                     + images * 10 * f / 1e15)
    every = plan(load_params(REPO / "params.yaml", "qwenimage", {"train.kl_ref_every": 1}))
    assert every["methods"][0]["reference_forwards_per_image"] == 2
    off = plan(load_params(REPO / "params.yaml", "qwenimage", {"train.kl_ref": False}))
    assert off["methods"][0]["diagnostics_pflop"] == 0
    text = format_plan(p)
    assert "ref fwd/img" in text and "at 25 of 200 iterations (iterations 1, 9, 17, …)" in text
    assert "not run under FSDP on 8 GPUs" in text

    s = plan(load_params(REPO / "params.yaml", "sd3"))  # LoRA without checkpointing: b = 1 forward
    f, b, images = s["forward_tflop_per_image_step"] * 1e12, s["forward_tflop_per_image_step"] * 1e12, 384
    assert "backward = 1 forward (LoRA: the frozen base's weight gradients are skipped" in format_plan(s)
    rows = {r["method"]: r for r in s["methods"]}
    assert rows["baseline"]["update_pflop"] * 1e15 == pytest.approx(images * (4 * (f + b) + 4 * f))
    assert rows["jagg"]["update_pflop"] * 1e15 == pytest.approx(images * (2 * (f + b) + 2 * f + 4 * f))
    u = rows["jagg"]["forwards"]
    assert u["kl_ref"] == 0 and u["monitor_runs"] == 10  # iterations 0, 20, …, 180
    # 4 images per process on 8 processes, one full group of 4: exact 4 graphs, JAGG and ablate 2 + 2 no-grad each,
    # and at β > 0 a reference forward per step loss (3 × 4)
    share = 4 * 8 / images * 10 / 200
    assert (u["monitor_grad"], u["monitor_nograd"], u["monitor_reference"]) == pytest.approx(
        (8 * share, 4 * share, 12 * share))
    assert "β = 0.04: the loss's KL, one per trained step, every iteration (in the update)" in format_plan(s)


@pytest.mark.parametrize("profile", REAL)
def test_every_real_profile_prints_its_table(profile, capsys):
    from tasks.plan import main

    assert main(["--profile", profile]) == 0
    out = capsys.readouterr().out
    assert f"jagg plan — profile {profile}:" in out and "H100 it s" in out and "evaluation per checkpoint" in out
    for method in load_params(REPO / "params.yaml", profile).run.methods:
        assert f"\n  {method} " in out


@pytest.mark.parametrize("argv, needle", [
    (["--profile", "toy"], "jagg plan needs a real backbone (flux, qwenimage, sd3, wan); profile 'toy' uses 'toy-flux'"),
    (["--profile", "flux", "--utilisation", "0"], "--utilisation 0.0 must be in (0, 1]"),
])
def test_errors_are_one_sentence(argv, needle, capsys):
    from tasks.plan import main

    assert main(argv) == 1
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_the_printed_commands_carry_the_params_file_and_sets_that_were_planned(tmp_path):
    """``jagg plan --params mine.yaml`` printed ``jagg run --profile flux-mine`` without ``--params``: as printed it
    failed (no such profile in params.yaml) or ran another plan; now every command repeats --params and --set."""
    from conftest import run_module

    (tmp_path / "params.yaml").write_bytes((REPO / "params.yaml").read_bytes())
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "params.yaml").write_text(
        "extends: ../params.yaml\nprofile: flux-mine\nprofiles:\n  flux-mine:\n    extends: flux\n"
        "    train: {iterations: 7}\n")
    out = run_module("tasks.plan", "--params", "mine/params.yaml", "--set", "train.lr=1e-5", root=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    given = "--profile flux-mine --params mine/params.yaml --set train.lr=1e-5"
    assert f"jagg run {given}\n" in out.stdout and f"jagg train {given} --method <method>" in out.stdout, out.stdout


def test_the_text_tokens_follow_max_sequence_length():
    """The plan counted FLUX's 512 T5 tokens whatever model.options.max_sequence_length said; now the profile's (else
    the policy's default: SD3's 128 T5 tokens beside CLIP's 77, not 256)."""
    flux = load_params(REPO / "params.yaml", "flux", {"model.options.max_sequence_length": 128})
    assert plan(flux)["tokens"] == 45 * 45 + 128  # 720 px: 45 × 45 image tokens
    assert plan(load_params(REPO / "params.yaml", "flux"))["tokens"] == 45 * 45 + 512
    assert plan(load_params(REPO / "params.yaml", "sd3"))["tokens"] == 32 * 32 + 77 + 128


def test_the_evaluation_counts_the_test_prompts_it_would_read(tmp_path, capsys):
    """An 8-prompt benchmark (4 styles × 2) was planned as 3,200 images; now the prompts as read (or the published
    size with eval.subset where the benchmark cannot be read here)."""
    import json

    from tasks.plan import main

    (tmp_path / "benchmark").mkdir()
    for style in ("anime", "concept-art", "paintings", "photo"):
        (tmp_path / "benchmark" / f"{style}.json").write_text(json.dumps([f"a {style} cat", f"a {style} dog"]))
    assert main(["--profile", "sd3", "--set", f"eval.benchmark={tmp_path}", "--json"]) == 0
    ev = __import__("json").loads(capsys.readouterr().out)["evaluation"]
    assert (ev["images"], ev["images_source"]) == (8, "as read")
    assert plan(load_params(REPO / "params.yaml", "sd3", {"eval.subset": 5}))["evaluation"]["images"] == 20
