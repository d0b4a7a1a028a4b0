"""The wan backbone (Wan2.1 text-to-video) on a tiny random pipeline saved as a diffusers folder (5 frames of 16×16
px, 3 latent frames, 2 blocks), loaded by ``load_policy`` exactly as the released weights would be.

Checked against diffusers' WanPipeline itself (same latents after a few Euler steps, same decoded clips); the SDE on
5-D latents; rollouts of clips and exact / JAGG / ablate / reuse updates through the trainer's own update; joint =
sequential and W = 2 = exact in float64; the bf16 first-step ratio exactly 1; LoRA, gradient checkpointing, FSDP2
block wrapping; the LoRA export loaded by ``WanPipeline.load_lora_weights``; rewards on clips; a ci-sized run through
``train`` that logs frame strips and a GIF to a real MLflow store, then the evaluation of its clips (frame means, by
hand on the saved frames) and the report's frame strips; the errors a user can make.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from jagg_core.policies import tiny as tiny_pipelines
from wan_clip_evaluation import benchmark_folder, check_clip_evaluation_and_report
from jagg_core import sde_step_with_logprob
from jagg_core.setup.config import ResolvedMethod, SampleConfig, TrainConfig
from jagg_core.policies import PolicyError, load_policy

PROMPTS = ["a red cat", "two blue dogs on green grass"]
OPTIONS = {"height": tiny_pipelines.WAN_SIZE, "width": tiny_pipelines.WAN_SIZE, "num_frames": tiny_pipelines.WAN_FRAMES,
           "max_sequence_length": 24}
LORA = {"rank": 4, "alpha": 8}
SAMPLE = SampleConfig(recipe="dance_grpo", num_steps=4, noise_level=0.7, sde_kind="flow_grpo", group_size=2,
                      prompts_per_iteration=2, batch_size=4)
NO_AUTOCAST = contextlib.nullcontext


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    return tiny_pipelines.build_wan(tmp_path_factory.mktemp("wan"))


def load(folder, dtype=torch.float32, **extra):
    return load_policy("wan", str(folder), dtype=dtype, options={**OPTIONS, **extra})


def method(name: str, mode: str, window: int = 4, variant: str = "joint", reuse: bool = False) -> ResolvedMethod:
    return ResolvedMethod(name=name, mode=mode, window=window, jagg_frac=1.0, variant=variant, anchors=2,
                          reuse_rollout_velocity=reuse)


def update(policy, traj, m: ResolvedMethod, *, autocast=NO_AUTOCAST, clip_range=1e-4):
    """The trainer's update (accumulate_gradients) of every trained step; returns (stats, the gradients)."""
    from jagg_core.jagg import plan_groups
    from jagg_core.trainer.distributed import NoSync
    from jagg_core.trainer.update import UpdateContext, accumulate_gradients

    groups = plan_groups(traj.train_steps, m.window, 1.0, mode=m.mode)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    ctx = UpdateContext(policy, m, SAMPLE, TrainConfig(micro_batch=4, clip_range=clip_range), NoSync(), autocast)
    stats = accumulate_gradients(ctx, traj, advantages, torch.arange(4), groups, reuse=m.reuse_rollout_velocity)
    grads = [p.grad.clone() for p in policy.trainable_parameters()]
    for p in policy.trainable_parameters():
        p.grad = None
    return stats, grads


def rollout(policy, *, autocast=NO_AUTOCAST, keep=False):
    from jagg_core.trainer.rollout import rollout as run

    return run(policy, PROMPTS, [0, 1], SAMPLE, seed=0, iteration=0, keep_velocities=keep, autocast=autocast)


def test_policy_reproduces_the_wan_pipeline(wan_dir):
    """Our encoding, CFG, Euler steps and decoding = WanPipeline's, on its sigmas swapped for our fixed-shift grid."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    policy = load(wan_dir)
    assert policy.latent_shape() == (4, 3, 8, 8)
    embeds = policy.encode_prompts(PROMPTS)
    z0 = policy.initial_noise(2, torch.Generator().manual_seed(1))
    sched = policy.schedule(3)
    z = z0
    with torch.no_grad():
        for j in range(3):
            z = z + (sched.sigmas[j + 1] - sched.sigmas[j]).float() * policy.velocity(z, sched.timesteps[j].expand(2),
                                                                                      embeds)
    pipe = WanPipeline.from_pretrained(wan_dir)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    set_timesteps = pipe.scheduler.set_timesteps
    pipe.scheduler.set_timesteps = lambda n, device=None: set_timesteps(  # our sigmas, unshifted again
        sigmas=np.asarray(sched.sigmas[:-1], dtype=np.float32), device=device)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt=PROMPTS, height=16, width=16, num_frames=5, num_inference_steps=3, guidance_scale=5.0,
                  max_sequence_length=24)
    theirs = pipe(latents=z0.clone(), output_type="latent", **kwargs).frames
    assert not torch.allclose(z, z0, atol=1e-2)
    torch.testing.assert_close(z, theirs, rtol=1e-4, atol=1e-5)
    clips = pipe(latents=z0.clone(), output_type="pt", **kwargs).frames  # (B, F, 3, H, W) in [0, 1]
    ours = policy.decode(z)
    assert ours.shape == (2, 5, 3, 16, 16) and ours.min() >= 0 and ours.max() <= 1
    torch.testing.assert_close(ours, clips, rtol=1e-4, atol=1e-4)


def test_the_sde_on_clips_reduces_over_every_non_batch_dim():
    """The log-prob of a 5-D latent is the mean over C, F, h, w: the same as on the latent flattened (float64)."""
    g = torch.Generator().manual_seed(0)
    z, v, prev = (torch.randn(3, 4, 3, 2, 2, generator=g, dtype=torch.float64) for _ in range(3))
    for kind in ("flow_grpo", "dance_grpo"):
        clip = sde_step_with_logprob(z, v, 0.8, 0.6, noise_level=0.7, kind=kind, prev_sample=prev)
        flat = sde_step_with_logprob(z.flatten(1), v.flatten(1), 0.8, 0.6, noise_level=0.7, kind=kind,
                                     prev_sample=prev.flatten(1))
        assert clip.log_prob.shape == (3,)
        torch.testing.assert_close(clip.log_prob, flat.log_prob, rtol=0, atol=1e-12)
        torch.testing.assert_close(clip.mean.flatten(1), flat.mean, rtol=0, atol=1e-12)


def test_rollout_of_clips_and_every_update_through_the_trainer(wan_dir):
    """A rollout of clips, then exact, JAGG, ablate and JAGG-reuse updates: finite non-zero gradients, the first
    PPO ratio 1 (policy = rollout policy), the forwards and backwards each method's cost model counts."""
    policy = load(wan_dir, lora=LORA)
    traj = rollout(policy, keep=True)
    assert traj.latents.shape == (4, 5, 4, 3, 8, 8) and traj.images.shape == (4, 5, 3, 16, 16)
    assert traj.train_steps == [0, 1, 2, 3] and torch.isfinite(traj.log_probs).all()
    counts = {}
    for m in (method("exact", "exact"), method("jagg", "jagg"), method("ablate", "ablate"),
              method("reuse", "jagg", reuse=True)):
        stats, grads = update(policy, traj, m)
        assert all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads), m.name
        assert max(stats.extras["approx_kl"]) < 1e-9, m.name
        counts[m.name] = (stats.grad_forwards, stats.nograd_forwards, stats.reused_velocities)
    assert counts == {"exact": (4, 0, 0), "jagg": (2, 2, 0), "ablate": (2, 2, 0), "reuse": (2, 0, 2)}  # cost.py
    from jagg_core.trainer.update import UpdateContext, trajectory_fidelity  # what jagg_frac: auto reads, on clips

    ctx = UpdateContext(policy, method("jagg", "jagg", window=2), SAMPLE, TrainConfig(micro_batch=4, clip_range=1e-4))
    rep = trajectory_fidelity(ctx, traj, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.arange(4))
    assert rep.positions == [0, 1] and all(abs(c - 1) < 1e-5 for c in rep.cos_jagg)  # W = 2: JAGG is exact


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    flat_a, flat_b = torch.cat([x.flatten() for x in a]), torch.cat([x.flatten() for x in b])
    return float((flat_a - flat_b).norm() / flat_b.norm())


def test_joint_equals_sequential_and_w2_equals_exact_in_float64(wan_dir):
    """In float64, to float32 rounding: Wan keeps its norms, modulation tables and time embedder in float32
    (``_keep_in_fp32_modules``) and its blocks cast the residual stream to float32 (``hidden_states.float()``), so a
    different batching of the same forwards differs at ~1e-7; JAGG's approximation at W = 4 is far larger."""
    policy = load(wan_dir, dtype=torch.float64)
    traj = rollout(policy)
    _, joint = update(policy, traj, method("joint", "jagg"))
    _, sequential = update(policy, traj, method("sequential", "jagg", variant="sequential"))
    _, exact4 = update(policy, traj, method("exact", "exact"))
    _, exact2 = update(policy, traj, method("exact", "exact", window=2))
    _, jagg2 = update(policy, traj, method("jagg2", "jagg", window=2))
    assert any(g.abs().max() > 1e-6 for g in joint)
    assert _rel(joint, sequential) < 1e-6 and _rel(jagg2, exact2) < 1e-6
    assert _rel(joint, exact4) > 1e-3  # W = 4 is an approximation


def test_bf16_first_step_ratio_is_exactly_one(wan_dir):
    """The rollout runs under the update's own bf16 autocast: approx_kl and clipfrac exactly 0 at the first step for
    exact, JAGG and JAGG-reuse; without it the ratio is off (the test can fail)."""
    policy = load(wan_dir)
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    traj = rollout(policy, autocast=bf16, keep=True)
    for m in (method("exact", "exact"), method("jagg", "jagg"), method("reuse", "jagg", reuse=True)):
        stats, _ = update(policy, traj, m, autocast=bf16)
        assert stats.extras["approx_kl"] and all(x == 0.0 for x in stats.extras["approx_kl"]), m.name
        assert all(x == 0.0 for x in stats.extras["clipfrac"]), m.name
    stats, _ = update(policy, rollout(policy), method("exact", "exact"), autocast=bf16)  # float32 rollout
    assert any(x > 0 for x in stats.extras["approx_kl"])


def test_lora_checkpointing_and_fsdp2_blocks(wan_dir, tmp_path):
    """LoRA trains only adapters on the attention projections and starts equal to the base; gradient checkpointing
    gives the same gradients; FSDP2 wraps each WanTransformerBlock (in ``blocks``) and the root."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from jagg_core.trainer.distributed import shard_transformer

    grads = []
    for checkpointing in (False, True):
        policy = load(wan_dir, lora=LORA, gradient_checkpointing=checkpointing)
        named = dict(policy.transformer.named_parameters())
        assert all("lora_" in n for n, p in named.items() if p.requires_grad)
        torch.manual_seed(0)
        for name, p in named.items():
            if "lora_" in name:
                torch.nn.init.normal_(p, std=0.1)
        embeds = policy.encode_prompts(PROMPTS)
        z = policy.initial_noise(2, torch.Generator().manual_seed(2))
        policy.velocity(z, policy.schedule(4).timesteps[1].expand(2), embeds).square().mean().backward()
        grads.append([p.grad for p in policy.trainable_parameters()])
    assert all(g.abs().sum() > 0 for g in grads[0])
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sharded = load(wan_dir, lora=LORA)
        shard_transformer(sharded.transformer)
        wrapped = [type(m).__name__ for m in sharded.transformer.modules() if isinstance(m, FSDPModule)]
        assert wrapped.count("FSDPWanTransformerBlock") == 2 and len(wrapped) == 3
        shard_transformer(load(wan_dir).transformer, ["WanTransformerBlock"])  # the accelerate config's class name
    finally:
        dist.destroy_process_group()


def test_lora_export_loads_with_wan_pipeline(wan_dir, tmp_path):
    """`jagg export` of a LoRA run: WanPipeline.load_lora_weights gives the trained policy's velocities."""
    from diffusers import WanPipeline

    from jagg_core.pipeline.export import export_transformer

    policy = load(wan_dir, lora=LORA)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    embeds = policy.encode_prompts(PROMPTS)
    z = policy.initial_noise(2, torch.Generator().manual_seed(2))
    t = policy.schedule(4).timesteps[1].expand(2)
    with torch.no_grad():
        want = policy.velocity(z, t, embeds)
    out = export_transformer(policy.transformer, tmp_path / "lora", backbone="wan", card={})
    pipe = WanPipeline.from_pretrained(wan_dir)
    pipe.load_lora_weights(out)
    plain = load(wan_dir)
    with torch.no_grad():
        before = plain.velocity(z, t, embeds)
        plain.transformer = pipe.transformer
        got = plain.velocity(z, t, embeds)
    assert not torch.allclose(before, want, atol=1e-4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_image_rewards_score_chosen_frames_of_clips():
    from jagg_core.rewards import RewardError
    from jagg_core.rewards.clips import frame_indices, on_frames

    assert frame_indices(49, "first") == [0] and frame_indices(49, "last") == [48]
    assert frame_indices(49, 8) == [0, 6, 13, 20, 27, 34, 41, 48] and frame_indices(5, "all") == [0, 1, 2, 3, 4]
    assert frame_indices(5, [0, -1, 4]) == [0, 4]
    for bad, message in ((9, "asks for 9 frames of a clip of 5"), ([7], "outside a clip of 5"), ("middle", "one of")):
        with pytest.raises(RewardError, match=message):
            frame_indices(5, bad)

    def brightness(images, prompts, metadata):  # an image reward: mean pixel, and a per-image extra
        assert images.ndim == 4 and len(prompts) == images.shape[0] == len(metadata)
        return images.mean(dim=(1, 2, 3)), {"len": torch.tensor([float(len(p)) for p in prompts]), "n": 3}

    clips = torch.rand(2, 5, 3, 4, 4, dtype=torch.float64)
    rewards, info = on_frames(brightness, 2)(clips, ["ab", "abc"], [{}, {}])
    torch.testing.assert_close(rewards, clips[:, [0, 4]].mean(dim=(1, 2, 3, 4)).float())
    assert info["len"].tolist() == [2.0, 3.0] and info["n"] == 3
    images = clips[:, 0]  # images pass through unchanged
    torch.testing.assert_close(on_frames(brightness, 2)(images, ["a", "b"], [{}, {}])[0], images.mean(dim=(1, 2, 3)))


def test_bad_options_and_missing_weights_are_one_sentence(wan_dir, tmp_path):
    with pytest.raises(PolicyError, match=r"model.num_frames must be 2·k \+ 1 frames .* got 6"):
        load(wan_dir, num_frames=6)
    with pytest.raises(PolicyError, match="model.height must be a positive multiple of 4 pixels, got 18"):
        load(wan_dir, height=18)
    with pytest.raises(PolicyError, match=r"unknown model option\(s\) frames for backbone 'wan'"):
        load(wan_dir, frames=5)
    with pytest.raises(PolicyError, match=r"does not exist; download Wan-AI/Wan2.1-T2V-1.3B-Diffusers"):
        load_policy("wan", str(tmp_path / "nowhere"))


def test_ci_sized_wan_run_logs_frame_strips_and_its_export_reproduces_it(wan_dir, tmp_path):
    """The wan profile on its tiny stand-in (16 px, 5 frames, 4 steps, 2 iterations, LoRA, a pixel reward on 3
    frames): `train` logs frame strips and a GIF to a real MLflow store, and `jagg export` of its last checkpoint,
    loaded by WanPipeline.load_lora_weights, gives the trained policy's velocities."""
    from diffusers import WanPipeline

    from conftest import REPO
    from jagg_core.build import policy_from_params
    from jagg_core.setup.params_io import load_params
    from jagg_core.setup.paths import Layout
    from jagg_core.setup.storage import write_prompts_jsonl
    from jagg_core.pipeline.tracking import Tracker
    from jagg_core.policies.lora import load_trainable_state_dict
    from jagg_core.trainer.checkpoint import list_checkpoints
    from jagg_core.trainer.loop import train
    from tasks.export import export

    overrides = {"model.path": str(wan_dir), "model.dtype": "float32", "model.options": {**OPTIONS, "shift": 3.0},
                 "model.lora.rank": 4, "model.lora.alpha": 8, "resources.device": "cpu", "resources.num_processes": 1,
                 "resources.mixed_precision": "no", "sample.num_steps": 4, "sample.group_size": 2,
                 "sample.prompts_per_iteration": 2, "sample.batch_size": 4, "train.micro_batch": 4,
                 "train.iterations": 2, "train.lr": 1e-2, "train.checkpoint_every": 1, "train.log_images_every": 1,
                 "train.optimizer_steps_per_epoch": 1, "jagg.jagg_frac": 1.0, "reward.frames": 3,
                 "reward.weights": {"jpeg_compressibility": 1.0}, "reward.options": {},
                 "run.methods": ["jagg"], "run.seeds": [0], "eval.benchmark": str(benchmark_folder(tmp_path, PROMPTS)),
                 "eval.subset": 1, "eval.num_steps": 4, "eval.batch_size": 4, "eval.metrics": ["jpeg_compressibility"]}
    params = load_params(REPO / "params.yaml", "wan", overrides)
    assert params.sample.recipe == "dance_grpo" and params.model.options["num_frames"] == 5
    write_prompts_jsonl(Layout.of(params, tmp_path).train_prompts, PROMPTS)
    tracker = Tracker(params, tmp_path)
    run_id = tracker.child_run("ci-wan", "jagg-s0", method="jagg", seed=0, key="k")
    result = train(params, "jagg", 0, root=tmp_path, progress=False, logger=tracker.logger(run_id))
    assert result.iterations == 2 and all(h["train/grad_forwards"] > 0 for h in result.history)

    client = Tracker(params, tmp_path).client
    strips = sorted(a.path for a in client.list_artifacts(run_id, "images") if a.path.endswith(".png"))
    assert [p.split("+")[:3] for p in strips] == [["images/rollout", "step", "1"], ["images/rollout", "step", "2"]]
    from PIL import Image

    from jagg_core.media import frame_strips

    strip = Image.open(client.download_artifacts(run_id, strips[0], str(tmp_path / "dl")))
    captions = [p for p in PROMPTS for _ in range(2)]  # 4 clips, one row of its 5 frames each
    assert strip.size == frame_strips(torch.zeros(4, 5, 3, 16, 16), captions).size
    gifs = [a.path for a in client.list_artifacts(run_id, "rollout")]
    assert gifs == ["rollout/step_000001.gif", "rollout/step_000002.gif"]
    gif = Image.open(client.download_artifacts(run_id, gifs[0], str(tmp_path / "dl")))
    assert gif.format == "GIF" and gif.n_frames == 5 and max(gif.size) <= 4 * 130

    out = export(params, "jagg-s0", root=tmp_path)
    trained = policy_from_params(params, Layout.of(params, tmp_path), torch.device("cpu"))
    load_trainable_state_dict(trained.transformer, list_checkpoints(Layout.of(params, tmp_path).checkpoints(
        "jagg-s0"))[-1].tensors())
    embeds = trained.encode_prompts(PROMPTS)
    z = trained.initial_noise(2, torch.Generator().manual_seed(3))
    t = trained.schedule(4).timesteps[1].expand(2)
    pipe = WanPipeline.from_pretrained(wan_dir)
    pipe.load_lora_weights(out)
    with torch.no_grad():
        want = trained.velocity(z, t, embeds)
        with trained.reference():  # the base: adapters off
            base = trained.velocity(z, t, embeds)
        trained.transformer = pipe.transformer
        got = trained.velocity(z, t, embeds)
    assert not torch.allclose(base, want, atol=1e-5)  # two iterations moved the adapters
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    check_clip_evaluation_and_report(params, tmp_path, overrides)


def test_samples_are_logged_as_grids_or_frame_strips_and_bad_eval_frames_are_one_sentence(tmp_path):
    """Images: one grid, no artifact; clips: a frame strip and a bounded GIF. A reward.frames that the profile's clips
    do not have stops the evaluation in one sentence before any model loads."""
    from PIL import Image

    from conftest import REPO
    from jagg_core.evaluation.evaluate import evaluate_run
    from jagg_core.media import clips_gif, log_samples
    from jagg_core.setup.params_io import load_params
    from jagg_core.setup.paths import Layout

    class Sink:
        def __init__(self):
            self.images, self.artifacts = [], []

        def log_image(self, image, key, step):
            self.images.append((image.size, key, step))

        def log_artifact_bytes(self, data, name):
            self.artifacts.append((len(data), name))

    sink = Sink()
    log_samples(sink, torch.rand(4, 3, 16, 16), ["a"] * 4, "rollout", 1)
    log_samples(sink, torch.rand(2, 49, 3, 64, 64), ["a", "b"], "rollout", 2)
    assert [k for _, k, _ in sink.images] == ["rollout", "rollout"] and len(sink.artifacts) == 1
    assert sink.artifacts[0][1] == "rollout/step_000002.gif"
    fade = torch.linspace(0, 1, 49).view(1, 49, 1, 1, 1).expand(6, 49, 3, 160, 160)  # 6 clips fading to white
    gif = Image.open(__import__("io").BytesIO(clips_gif(fade)))
    assert gif.n_frames == 25 and gif.size == (4 * 130 + 2, 132)  # 4 clips of 128 px, every second frame
    from jagg_core.rewards import RewardError

    params = load_params(REPO / "params.yaml", "wan", {"reward.frames": 99})
    with pytest.raises(RewardError, match="reward.frames asks for 99 frames of a clip of 49"):
        evaluate_run(params, Layout.of(params, tmp_path), "base")
