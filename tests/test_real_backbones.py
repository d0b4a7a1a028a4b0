"""The real backbones (flux, sd3, qwenimage) on tiny random pipelines saved as diffusers folders.

Each policy is loaded by ``load_policy`` from a folder, exactly as released weights would be, and checked against the
diffusers pipeline itself: same schedule, same latents after a few Euler steps, same decoded images. Then one
gradient step, full fine-tune and LoRA; checkpoints of the trainable state; and the errors a user can run into.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from jagg_core.policies import tiny as tiny_pipelines
from jagg_core.setup.registry import backbone_spec
from jagg_core import sde_step_with_logprob
from jagg_core.policies import PolicyError, load_policy
from jagg_core.policies.diffusers_common import check_tokenizer
from jagg_core.policies.lora import load_trainable_state_dict, trainable_state_dict

BACKBONES = ["flux", "sd3", "qwenimage"]
PROMPTS = ["a red cat", "two blue dogs on green grass"]
SIZE = {"height": tiny_pipelines.IMAGE_SIZE, "width": tiny_pipelines.IMAGE_SIZE}
# Qwen-Image keeps its default max_sequence_length: the tiny byte-level tokenizer spells the template out letter by
# letter, so a short limit would cut every prompt off.
OPTIONS = {
    "flux": {**SIZE, "max_sequence_length": 24},
    "sd3": {**SIZE, "max_sequence_length": 24},
    "qwenimage": {**SIZE},
}
LORA = {"rank": 4, "alpha": 8}


def empty_clip_tokenizer():
    """What offline transformers returns for a CLIP tokenizer it could not find: two tokens, every word unknown."""
    from transformers import CLIPTokenizer

    return CLIPTokenizer(vocab={"<|startoftext|>": 0, "<|endoftext|>": 1}, merges=[])


def empty_t5_tokenizer():
    """What offline transformers returns for a T5 tokenizer it could not find: only "▁" and the 100 extra ids."""
    from transformers import T5TokenizerFast

    return T5TokenizerFast(vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)], extra_ids=100)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """backbone -> folder of its tiny pipeline, built once per session on first use."""
    folders = {}

    def get(backbone):
        if backbone not in folders:
            folders[backbone] = backbone_spec(backbone).stand_in(tmp_path_factory.mktemp(backbone))
        return folders[backbone]

    return get


def load(tiny_dir, backbone, **extra):
    return load_policy(backbone, str(tiny_dir(backbone)), options={**OPTIONS[backbone], **extra})


def euler(policy, embeds, z, num_steps):
    """The deterministic sampler (noise_level 0) the diffusers pipelines run."""
    sched = policy.schedule(num_steps)
    with torch.no_grad():
        for j in range(num_steps):
            v = policy.velocity(z, sched.timesteps[j].expand(z.shape[0]), embeds)
            z = z + (sched.sigmas[j + 1] - sched.sigmas[j]).float() * v
    return z


def pipeline_call(backbone, folder, z0, num_steps, output_type):
    """The diffusers pipeline's own sampling from the same initial latents."""
    from diffusers import FluxPipeline, QwenImagePipeline, StableDiffusion3Pipeline

    kwargs = dict(prompt=PROMPTS, latents=z0, num_inference_steps=num_steps, output_type=output_type, **SIZE)
    if backbone == "flux":
        pipe = FluxPipeline.from_pretrained(folder)
        kwargs |= dict(guidance_scale=3.5, max_sequence_length=24)
    elif backbone == "sd3":
        pipe = StableDiffusion3Pipeline.from_pretrained(folder)
        kwargs |= dict(guidance_scale=4.5, max_sequence_length=24)
    else:
        pipe = QwenImagePipeline.from_pretrained(folder)
        kwargs |= dict(negative_prompt=[" "] * len(PROMPTS), true_cfg_scale=4.0)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(**kwargs)[0]
    return out, pipe.scheduler.sigmas.double()


# Sampling and agreement with diffusers:


@pytest.mark.parametrize("backbone", BACKBONES)
def test_sde_sampling_decodes_to_images(tiny_dir, backbone):
    policy = load(tiny_dir, backbone)
    embeds = policy.encode_prompts(PROMPTS)
    assert len(embeds) == 2 and all(v.shape[0] == 2 for v in embeds.tensors.values())
    generator = torch.Generator().manual_seed(0)
    z = policy.initial_noise(2, generator)
    assert z.shape == (2, *policy.latent_shape()) and z.dtype == torch.float32
    sched = policy.schedule(4)
    with torch.no_grad():
        for j in range(sched.num_steps):
            v = policy.velocity(z, sched.timesteps[j].expand(2), embeds)
            assert v.shape == z.shape and v.dtype == torch.float32
            sigma, sigma_next = sched.sigmas[j], sched.sigmas[j + 1]
            step = sde_step_with_logprob(z, v, sigma, sigma_next, noise_level=0.7, generator=generator)
            assert torch.isfinite(step.log_prob).all()
            z = step.prev_sample
    images = policy.decode(z)
    assert images.shape == (2, 3, tiny_pipelines.IMAGE_SIZE, tiny_pipelines.IMAGE_SIZE)
    assert images.dtype == torch.float32 and images.min() >= 0 and images.max() <= 1
    assert not torch.equal(images[0], images[1])


@pytest.mark.parametrize("backbone", BACKBONES)
def test_policy_reproduces_the_diffusers_pipeline(tiny_dir, backbone):
    policy = load(tiny_dir, backbone)
    z0 = policy.initial_noise(2, torch.Generator().manual_seed(1))
    ours = euler(policy, policy.encode_prompts(PROMPTS), z0, num_steps=3)

    theirs, pipe_sigmas = pipeline_call(backbone, tiny_dir(backbone), z0.clone(), 3, "latent")
    torch.testing.assert_close(policy.schedule(3).sigmas, pipe_sigmas, rtol=0, atol=1e-6)
    assert not torch.allclose(ours, z0, atol=1e-2)  # the steps moved the latents
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)

    images, _ = pipeline_call(backbone, tiny_dir(backbone), z0.clone(), 3, "pt")
    torch.testing.assert_close(policy.decode(ours), images, rtol=1e-4, atol=1e-4)


# The released scheduler configs (scheduler/scheduler_config.json) of the three models.
RELEASED_SCHEDULERS = {
    "flux": {"shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
             "base_image_seq_len": 256, "max_image_seq_len": 4096},
    "sd3": {"shift": 3.0},
    "qwenimage": {"shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9,
                  "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
                  "time_shift_type": "exponential"},
}


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("steps", [2, 10, 28])
def test_released_schedules_match_diffusers_at_full_resolution(backbone, steps):
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    from jagg_core.policies.diffusers_common import pipeline_schedule

    config = dict(FlowMatchEulerDiscreteScheduler(**RELEASED_SCHEDULERS[backbone]).config)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    seq_len = {"flux": 4096, "sd3": 4096, "qwenimage": 6889}[backbone]  # 1024², 1024², 1328² pixels
    spacing = "sd3" if backbone == "sd3" else "flux"
    ours = pipeline_schedule(config, steps, image_seq_len=seq_len, spacing=spacing)
    if spacing == "sd3":
        scheduler.set_timesteps(steps)
    else:  # what FluxPipeline and QwenImagePipeline pass: their sigmas and the resolution's mu
        mu = (seq_len - 256) * (config["max_shift"] - 0.5) / (config["max_image_seq_len"] - 256) + 0.5
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    torch.testing.assert_close(ours.sigmas, scheduler.sigmas.double(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.timesteps, scheduler.timesteps.double(), rtol=0, atol=1e-3)


# One gradient step:


def velocity_loss(policy, embeds, z, t):
    return policy.velocity(z, t, embeds).square().mean()


def fixed_inputs(policy):
    embeds = policy.encode_prompts(PROMPTS)
    z = policy.initial_noise(2, torch.Generator().manual_seed(2))
    t = policy.schedule(4).timesteps[1].expand(2)
    return embeds, z, t


def last_block_text_stream(policy, name):
    """The last block's text stream, which no later layer reads: its weights get no or zero gradient."""
    last = f"transformer_blocks.{len(policy.transformer.transformer_blocks) - 1}."
    return last in name and any(u in name for u in ("add_q_proj", "norm_added_q", "to_add_out", "txt_mlp"))


@pytest.mark.parametrize("backbone", BACKBONES)
def test_full_finetune_step_changes_the_transformer(tiny_dir, backbone):
    policy = load(tiny_dir, backbone)
    params = dict(policy.transformer.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert all(last_block_text_stream(policy, n) for n in set(params) - trainable)  # all else trains
    for frozen in (policy.vae, *[m for m in policy.encoders.components.values() if isinstance(m, torch.nn.Module)]):
        assert not any(p.requires_grad for p in frozen.parameters()) and not frozen.training

    embeds, z, t = fixed_inputs(policy)
    before = {n: p.detach().clone() for n, p in params.items()}
    v_before = policy.velocity(z, t, embeds).detach()
    velocity_loss(policy, embeds, z, t).backward()
    assert all(params[n].grad is not None for n in trainable)  # DDP needs no find_unused_parameters
    with_grad = {n for n in trainable if params[n].grad.abs().sum() > 0}
    assert all(last_block_text_stream(policy, n) for n in trainable - with_grad)
    torch.optim.Adam(policy.trainable_parameters(), lr=1e-3).step()
    assert all(not torch.equal(params[n], before[n]) for n in with_grad)
    assert all(torch.equal(params[n], before[n]) for n in set(params) - trainable)
    assert not torch.allclose(policy.velocity(z, t, embeds), v_before)
    with pytest.raises(PolicyError, match="needs LoRA"):
        with policy.reference():
            pass


@pytest.mark.parametrize("backbone", BACKBONES)
def test_lora_step_trains_adapters_and_keeps_the_reference(tiny_dir, backbone):
    policy = load(tiny_dir, backbone, lora=LORA)
    named = dict(policy.transformer.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any("lora_" not in n for n in named)  # the frozen base is there too

    embeds, z, t = fixed_inputs(policy)
    with torch.no_grad():
        v0 = policy.velocity(z, t, embeds)
        with policy.reference():
            ref0 = policy.velocity(z, t, embeds)
    torch.testing.assert_close(v0, ref0, rtol=0, atol=0)  # LoRA B starts at zero

    velocity_loss(policy, embeds, z, t).backward()
    assert all(named[n].grad is not None for n in trainable)  # DDP needs no find_unused_parameters
    lora_b = [n for n in trainable if "lora_B" in n]
    assert all(named[n].grad.abs().sum() > 0 for n in lora_b if not last_block_text_stream(policy, n))
    assert all(p.grad is None for n, p in named.items() if n not in trainable)
    torch.optim.Adam(policy.trainable_parameters(), lr=1e-2).step()

    with torch.no_grad():
        v1 = policy.velocity(z, t, embeds)
        with policy.reference():
            ref1 = policy.velocity(z, t, embeds)
    assert not torch.allclose(v1, ref1, atol=1e-6)  # the adapters moved the policy ...
    torch.testing.assert_close(ref1, ref0, rtol=0, atol=0)  # ... and not its frozen base


def test_gradient_checkpointing_gives_the_same_gradients(tiny_dir):
    grads = []
    for checkpointing in (False, True):
        policy = load(tiny_dir, "qwenimage", lora=LORA, gradient_checkpointing=checkpointing)
        torch.manual_seed(0)  # the same Gaussian LoRA A in both
        for name, p in policy.transformer.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(p)
        velocity_loss(policy, *fixed_inputs(policy)).backward()
        grads.append([p.grad for p in policy.trainable_parameters()])
    assert all(g is not None and g.abs().sum() > 0 for g in grads[1][:4])
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain)


# Checkpoints of the trainable state:


def test_trainable_state_round_trips_bit_identically(tiny_dir, tmp_path):
    trained = load(tiny_dir, "flux", lora=LORA)
    embeds, z, t = fixed_inputs(trained)
    velocity_loss(trained, embeds, z, t).backward()
    torch.optim.Adam(trained.trainable_parameters(), lr=1e-2).step()
    state = trainable_state_dict(trained.transformer)
    assert state and all("lora_" in k for k in state)
    torch.save(state, tmp_path / "trainable.pt")

    fresh = load(tiny_dir, "flux", lora=LORA)
    loaded = torch.load(tmp_path / "trainable.pt")
    load_trainable_state_dict(fresh.transformer, loaded)
    again = trainable_state_dict(fresh.transformer)
    assert again.keys() == state.keys() and all(torch.equal(again[k], state[k]) for k in state)
    with torch.no_grad():
        torch.testing.assert_close(fresh.velocity(z, t, embeds), trained.velocity(z, t, embeds), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_ddp_and_fsdp2_wrapped_transformers(tiny_dir, tmp_path):
    """What the trainer does to ``policy.transformer``: velocity, reference and checkpoints still work."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = load(tiny_dir, "flux", lora=LORA)
        embeds, z, t = fixed_inputs(ddp)
        keys = trainable_state_dict(ddp.transformer).keys()
        ddp.transformer = torch.nn.parallel.DistributedDataParallel(ddp.transformer)
        velocity_loss(ddp, embeds, z, t).backward()
        with torch.no_grad(), ddp.reference():
            ddp.velocity(z, t, embeds)
        assert trainable_state_dict(ddp.transformer).keys() == keys  # no "module." prefix

        sharded = load(tiny_dir, "flux", lora=LORA)
        state = trainable_state_dict(sharded.transformer)
        fully_shard(sharded.transformer)
        velocity_loss(sharded, embeds, z, t).backward()
        gathered = trainable_state_dict(sharded.transformer)  # DTensors gathered to full tensors
        assert gathered.keys() == keys and all(torch.equal(gathered[k], state[k]) for k in keys)
        shifted = {k: v + 1 for k, v in state.items()}
        load_trainable_state_dict(sharded.transformer, shifted)
        assert all(torch.equal(v, shifted[k]) for k, v in trainable_state_dict(sharded.transformer).items())
    finally:
        dist.destroy_process_group()


def test_trainable_state_mismatches_are_refused(tiny_dir):
    policy = load(tiny_dir, "flux", lora=LORA)
    state = trainable_state_dict(policy.transformer)
    key = next(iter(state))
    with pytest.raises(PolicyError, match=r"1 missing \(e\.g\. "):
        load_trainable_state_dict(policy.transformer, {k: v for k, v in state.items() if k != key})
    with pytest.raises(PolicyError, match=r"1 unexpected \(e\.g\. 'extra'\)"):
        load_trainable_state_dict(policy.transformer, {**state, "extra": torch.zeros(1)})
    with pytest.raises(PolicyError, match="1 of another shape"):
        load_trainable_state_dict(policy.transformer, {**state, key: torch.zeros(3, 3)})
    full = load(tiny_dir, "flux")  # a LoRA checkpoint does not fit a full fine-tune
    with pytest.raises(PolicyError, match="model.lora settings it was saved with"):
        load_trainable_state_dict(full.transformer, state)


# Errors a user can make:


def test_missing_folder_names_the_download(tmp_path):
    with pytest.raises(PolicyError, match=r"model.path .* does not exist; download black-forest-labs/FLUX.1-dev"):
        load_policy("flux", str(tmp_path / "nowhere"))
    with pytest.raises(PolicyError, match=r"neither a folder nor in the Hugging Face cache .* download acme/no-such"):
        load_policy("sd3", "acme/no-such-model")


@pytest.fixture
def flux_copy(tiny_dir, tmp_path):
    return shutil.copytree(tiny_dir("flux"), tmp_path / "flux")


def test_missing_transformer_weights_are_named(flux_copy):
    for weights in (flux_copy / "transformer").glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(PolicyError) as err:
        load_policy("flux", str(flux_copy), options=OPTIONS["flux"])
    message = str(err.value)
    assert "is missing the transformer weights (transformer/*.safetensors)" in message
    assert "download black-forest-labs/FLUX.1-dev" in message and "model.path" in message
    assert message.count(". ") == 0 and message.endswith(".")  # one sentence


def test_missing_weight_shard_is_named(tiny_dir, tmp_path):
    folder = shutil.copytree(tiny_dir("qwenimage"), tmp_path / "qwen")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "text_encoder" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PolicyError, match=r"missing 2 of 2 text_encoder weight shards .* download Qwen/Qwen-Image"):
        load_policy("qwenimage", str(folder))


def test_missing_component_and_model_index_are_named(flux_copy):
    shutil.rmtree(flux_copy / "vae")
    with pytest.raises(PolicyError, match=r"is missing the vae component \(vae/\)"):
        load_policy("flux", str(flux_copy))
    (flux_copy / "model_index.json").unlink()
    with pytest.raises(PolicyError, match="is missing model_index.json"):
        load_policy("flux", str(flux_copy))


def test_empty_tokenizer_is_refused(flux_copy):
    shutil.rmtree(flux_copy / "tokenizer")
    empty_clip_tokenizer().save_pretrained(flux_copy / "tokenizer")
    expected = r"tokenizer' is empty \(vocabulary of 2, every word unknown\); download black-forest-labs/FLUX.1-dev"
    with pytest.raises(PolicyError, match=expected):
        load_policy("flux", str(flux_copy), options=OPTIONS["flux"])


@pytest.mark.parametrize("empty", [empty_clip_tokenizer, empty_t5_tokenizer])
def test_check_tokenizer_catches_what_offline_transformers_returns(empty, tmp_path):
    with pytest.raises(PolicyError, match="is empty"):
        check_tokenizer(empty(), "tokenizer_2", folder=tmp_path, hub_id="black-forest-labs/FLUX.1-dev")
    for built in (tiny_pipelines.clip_tokenizer, tiny_pipelines.t5_tokenizer, tiny_pipelines.qwen_tokenizer):
        check_tokenizer(built(), "tokenizer", folder=tmp_path, hub_id="black-forest-labs/FLUX.1-dev")


def test_bad_options_are_refused(tiny_dir):
    with pytest.raises(PolicyError, match=r"unknown model option\(s\) guidance for backbone 'flux'"):
        load(tiny_dir, "flux", guidance=2.0)
    with pytest.raises(PolicyError, match="model.height must be a positive multiple of 4 pixels, got 30"):
        load(tiny_dir, "flux", height=30)  # the tiny VAE downsamples 2x, Flux packs 2x2
    with pytest.raises(PolicyError, match=r"unknown model.lora key\(s\) ranks; known: alpha, dropout, rank"):
        load(tiny_dir, "sd3", lora={"ranks": 2})
    with pytest.raises(PolicyError, match=r"model.lora.target_modules \['to_qkv'\] match no module"):
        load(tiny_dir, "sd3", lora={"rank": 2, "target_modules": ["to_qkv"]})


def _bf16_update(policy, traj, method_name: str, reuse: bool = False):
    """The trainer's update (accumulate_gradients) of every trained step under CPU bf16 autocast, at the first
    optimizer step (policy = rollout policy); returns its stats."""
    from jagg_core.setup.config import ResolvedMethod, SampleConfig, TrainConfig
    from jagg_core.jagg import plan_groups
    from jagg_core.trainer.distributed import NoSync
    from jagg_core.trainer.update import UpdateContext, accumulate_gradients

    mode = "exact" if method_name == "exact" else "jagg"
    method = ResolvedMethod(name=method_name, mode=mode, window=4, jagg_frac=1.0, variant="joint", anchors=2,
                            reuse_rollout_velocity=reuse)
    groups = plan_groups(traj.train_steps, 4, 1.0, mode=mode)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    ctx = UpdateContext(policy, method,
                        SampleConfig(recipe="dance_grpo", num_steps=4, noise_level=0.7, group_size=2, batch_size=4),
                        TrainConfig(micro_batch=4, clip_range=1e-4), NoSync(),
                        lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    stats = accumulate_gradients(ctx, traj, advantages, torch.arange(4), groups, reuse=reuse)
    for p in policy.trainable_parameters():
        p.grad = None
    return stats


def test_bf16_rollout_and_update_agree_exactly_at_the_first_step(tiny_dir):
    """Under bf16 mixed precision the rollout runs the policy under the update's own autocast: at the first optimizer
    step the PPO ratio is exactly 1 (approx_kl 0, clipfrac 0 at clip_range 1e-4) for exact, JAGG and JAGG-reuse,
    and the velocities the rollout kept are bit-identical to the ones the update recomputes. Without the autocast in
    the rollout the ratio is not 1 (the test can fail)."""
    from jagg_core.setup.config import ResolvedMethod, SampleConfig, TrainConfig
    from jagg_core.trainer.rollout import rollout
    from jagg_core.trainer.update import ImageSteps, UpdateContext

    policy = load(tiny_dir, "flux")
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    cfg = SampleConfig(recipe="dance_grpo", num_steps=4, noise_level=0.7, group_size=2, prompts_per_iteration=2,
                       batch_size=4)
    traj = rollout(policy, PROMPTS, [0, 1], cfg, seed=0, iteration=0, keep_velocities=True, autocast=bf16)
    for name, reuse in (("exact", False), ("jagg", False), ("jagg", True)):
        stats = _bf16_update(policy, traj, name, reuse)
        assert stats.extras["approx_kl"] and all(x == 0.0 for x in stats.extras["approx_kl"]), (name, reuse)
        assert all(x == 0.0 for x in stats.extras["clipfrac"]), (name, reuse)
    ctx = UpdateContext(policy, ResolvedMethod(name="exact", mode="exact"), cfg, TrainConfig(), autocast=bf16)
    fns = ImageSteps(ctx, traj, torch.arange(4), torch.ones(4), traj.train_steps, scale=1.0)
    with torch.no_grad():
        for j, step in enumerate(traj.train_steps):
            assert torch.equal(fns.velocity(j), traj.velocities[step]), step
    # The rollout in float32 and the update in bf16: the first ratio is off (what the autocast in the rollout fixes).
    traj32 = rollout(policy, PROMPTS, [0, 1], cfg, seed=0, iteration=0)
    assert any(x > 0 for x in _bf16_update(policy, traj32, "exact").extras["approx_kl"])


def test_flux_fixed_shift_option_replaces_the_dynamic_shift(tiny_dir):
    """model.options.shift (DanceGRPO's --shift 3) gives its fixed schedule whatever the resolution; 0 is refused."""
    from jagg_core.schedules import fixed_shift_schedule

    dynamic = load(tiny_dir, "flux").schedule(8)
    fixed = load(tiny_dir, "flux", shift=3.0).schedule(8)
    assert torch.equal(fixed.sigmas, fixed_shift_schedule(8, 3.0).sigmas)
    assert not torch.allclose(fixed.sigmas, dynamic.sigmas)
    with pytest.raises(PolicyError, match="model.options.shift must be a positive number"):
        load(tiny_dir, "flux", shift=0)


@pytest.mark.parametrize("profile", ["flux", "flux-fast", "qwenimage-dance", "qwenimage", "sd3"])
def test_real_profiles_dry_run_on_tiny_stand_ins(tiny_dir, tmp_path, profile):
    """Each real profile, its weights swapped for the tiny pipeline of its backbone (32 px, float32, CPU): the policy
    builds with the profile's own options (LoRA, fixed shift, CFG), a rollout follows its recipe and one update of
    its JAGG method runs through its routing."""
    from jagg_core.build import policy_from_params
    from jagg_core.setup.params_io import load_params
    from jagg_core.setup.paths import Layout
    from jagg_core.trainer.distributed import NoSync
    from jagg_core.trainer.rollout import rollout
    from jagg_core.jagg import plan_groups
    from jagg_core.trainer.update import UpdateContext, accumulate_gradients

    from conftest import REPO

    real = load_params(REPO / "params.yaml", profile)
    backbone = real.model.backbone
    overrides = {"model.path": str(tiny_dir(backbone)), "model.dtype": "float32", "resources.device": "cpu",
                 "resources.num_processes": 1, "resources.mixed_precision": "no", "resources.distributed": "ddp",
                 "model.options.gradient_checkpointing": False, "sample.group_size": 2,
                 "sample.prompts_per_iteration": 1, "train.micro_batch": 2,
                 **{f"model.options.{k}": v for k, v in OPTIONS[backbone].items()}}
    params = load_params(REPO / "params.yaml", profile, overrides)
    assert params.sample.recipe == real.sample.recipe and params.jagg == real.jagg  # the recipe is untouched
    policy = policy_from_params(params, Layout(tmp_path, profile), torch.device("cpu"))
    traj = rollout(policy, PROMPTS[:1], [0], params.sample, seed=0, iteration=0)
    method = params.method("jagg")
    fraction = params.sample.timestep_fraction if params.sample.recipe == "dance_grpo" else 1.0  # as the trainer
    groups = plan_groups(traj.train_steps, method.window, float(method.jagg_frac), mode=method.mode, fraction=fraction,
                         subset="random", generator=torch.Generator().manual_seed(0))
    assert groups and all(len(g.steps) <= method.window for g in groups)
    ctx = UpdateContext(policy, method, params.sample, params.train, NoSync(),
                        lambda: torch.autocast("cpu", enabled=False))
    stats = accumulate_gradients(ctx, traj, torch.tensor([1.0, -1.0]), torch.arange(2), groups, reuse=False)
    assert stats.backward_calls >= 1 and stats.extras["approx_kl"] and max(stats.extras["approx_kl"]) < 1e-6
    assert any(p.grad is not None for p in policy.trainable_parameters())


def _perturb(params, scale: float) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def test_export_full_finetune_is_a_diffusers_transformer_folder(tiny_dir, tmp_path):
    """A full fine-tune exports as transformer/ that FluxTransformer2DModel.from_pretrained loads bit for bit; an
    existing, non-empty destination is refused and left as it was."""
    from diffusers import FluxTransformer2DModel

    from jagg_core.pipeline.export import ExportError, export_transformer

    policy = load(tiny_dir, "flux")
    _perturb(policy.trainable_parameters(), 0.01)
    out = export_transformer(policy.transformer, tmp_path / "exp", backbone="flux", card={"run": "jagg-s0"})
    loaded = FluxTransformer2DModel.from_pretrained(out / "transformer")
    want = policy.transformer.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((out / "export.json").read_text())["kind"] == "full"
    with pytest.raises(ExportError, match="already exists and is not empty"):
        export_transformer(policy.transformer, out, backbone="flux", card={})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # no temporary folder left behind


def test_export_lora_loads_with_load_lora_weights(tiny_dir, tmp_path):
    """A LoRA run exports as pytorch_lora_weights.safetensors: FluxPipeline.load_lora_weights gives the trained
    policy's velocities (alpha / rank scaling included)."""
    from diffusers import FluxPipeline

    from jagg_core.pipeline.export import export_transformer

    policy = load(tiny_dir, "flux", lora=LORA)
    _perturb(policy.trainable_parameters(), 0.1)  # B ≠ 0: the adapters change the output
    embeds, z, t = fixed_inputs(policy)
    with torch.no_grad():
        want = policy.velocity(z, t, embeds)
    out = export_transformer(policy.transformer, tmp_path / "lora", backbone="flux", card={})
    assert (out / "pytorch_lora_weights.safetensors").exists()
    pipe = FluxPipeline.from_pretrained(tiny_dir("flux"))
    pipe.load_lora_weights(out)
    plain = load(tiny_dir, "flux")
    with torch.no_grad():
        before = plain.velocity(z, t, embeds)
        plain.transformer = pipe.transformer
        got = plain.velocity(z, t, embeds)
    assert not torch.allclose(before, want, atol=1e-4)  # the adapters matter
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
