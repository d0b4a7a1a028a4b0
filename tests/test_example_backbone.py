"""The example backbone plugin (examples/plugins/tiny_sana.py): a tiny random Sana that jagg does not ship.

The file is imported by its path, as a plugin is, and its policy checked on the CPU: shapes, determinism, gradients,
agreement with diffusers' own SanaPipeline, its folder, its options and its declared facts. Then jagg's trainer runs
on it unchanged: the update stage of the exact baseline and of JAGG (at W = 2 JAGG's two anchors are the whole group,
so its gradient is the exact one), and `train` itself for two iterations of each. model.backbone is still checked
against a fixed list by the configuration, so the training's params are the ci profile's with the model section
swapped in after validation.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from jagg_core.policies import PolicyError, available_backbones, load_policy
from jagg_core.setup.registry import remove

from conftest import REPO

PLUGIN = REPO / "examples/plugins/tiny_sana.py"
PROMPTS = ["a red cat", "Two blue dogs on green grass"]
MODULE = "jagg_example_tiny_sana"  # the name the file is imported under


@pytest.fixture(scope="module")
def plugin():
    """The plugin module, imported by path (which registers "tiny-sana") for this file's tests, then unregistered:
    other tests see the built-in backbones only (tests/test_config.py compares them with the configuration's list)."""
    spec = importlib.util.spec_from_file_location(MODULE, PLUGIN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    spec.loader.exec_module(module)
    yield module
    remove("backbone", module.NAME)
    del sys.modules[MODULE]


def build(plugin, dtype=torch.float32, path=None, **options):
    assert plugin.NAME in available_backbones()
    return load_policy(plugin.NAME, path, device="cpu", dtype=dtype, options=options)


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# The policy:


def test_policy_shapes_schedule_and_images(plugin):
    policy = build(plugin)
    embeds = policy.encode_prompts(PROMPTS)
    assert len(embeds) == 2 and set(embeds.tensors) == {"prompt_embeds", "prompt_attention_mask",
                                                         "negative_prompt_embeds", "negative_prompt_attention_mask"}
    assert embeds.tensors["prompt_embeds"].shape == (2, 32, 32)  # max_sequence_length × the text encoder's width
    assert embeds.tensors["prompt_attention_mask"].sum(1).tolist() == [1 + 9, 1 + 28]  # <bos> + one token per byte
    assert policy.latent_shape() == (4, 8, 8)  # 32 px through the 4× VAE
    sched = policy.schedule(4)
    assert sched.sigmas[0] == 1 and sched.sigmas[-1] == 0 and bool((sched.sigmas.diff() < 0).all())
    torch.testing.assert_close(sched.timesteps, sched.sigmas[:-1] * 1000)  # jagg's convention: t = σ·1000
    z = policy.initial_noise(2, torch.Generator().manual_seed(0))
    v = policy.velocity(z, sched.timesteps[1].expand(2), embeds)
    assert v.shape == z.shape == (2, 4, 8, 8) and v.dtype == torch.float32 and torch.isfinite(v).all()
    images = policy.decode(z)
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1 and images.std() > 0.01

    wide = build(plugin, height=16, width=48, guidance_scale=1.0)  # no CFG: no negative prompt
    assert wide.latent_shape() == (4, 4, 12) and "negative_prompt_embeds" not in wide.encode_prompts(PROMPTS).tensors
    assert wide.decode(wide.initial_noise(1)).shape == (1, 3, 16, 48)


def test_two_builds_are_bit_identical_and_leave_the_random_state_alone(plugin):
    rng = torch.random.get_rng_state()
    a, b = build(plugin), build(plugin)
    assert torch.equal(torch.random.get_rng_state(), rng)  # the build draws from its own seed only
    for part in ("transformer", "text_encoder", "vae"):
        assert same_weights(state(getattr(a, part)), state(getattr(b, part))), part
    assert not same_weights(state(a.transformer), state(build(plugin, seed=1).transformer))
    embeds, z = a.encode_prompts(PROMPTS), a.initial_noise(2, torch.Generator().manual_seed(0))
    t = a.schedule(4).timesteps[0].expand(2)
    assert torch.equal(a.velocity(z, t, embeds), b.velocity(z, t, b.encode_prompts(PROMPTS)))


def test_velocity_is_differentiable_in_the_transformer_only(plugin):
    policy = build(plugin)
    embeds, z = policy.encode_prompts(PROMPTS), policy.initial_noise(2, torch.Generator().manual_seed(0))
    policy.velocity(z, policy.schedule(4).timesteps[1].expand(2), embeds).square().mean().backward()
    trainable = dict(policy.transformer.named_parameters())
    assert all(p.requires_grad and p.grad is not None for p in trainable.values())
    assert sum(p.grad.abs().sum() > 0 for p in trainable.values()) > 0.9 * len(trainable)
    for frozen in (policy.text_encoder, policy.vae):
        assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())

    lora = build(plugin, lora={"rank": 4, "alpha": 4})  # the shared LoRA helper fits Sana's attention too
    names = [n for n, p in lora.transformer.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    with torch.no_grad(), lora.reference():  # the base with the adapters off: the KL reference
        lora.velocity(z, policy.schedule(4).timesteps[1].expand(2), embeds)


def test_policy_samples_as_diffusers_sana_pipeline_does(plugin):
    """A few Euler steps of the policy from the same latents: SanaPipeline's own sigmas, latents and images."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaPipeline

    policy = build(plugin)
    pipe = SanaPipeline(tokenizer=policy.tokenizer, text_encoder=policy.text_encoder, vae=policy.vae,
                        transformer=policy.transformer,
                        scheduler=FlowMatchEulerDiscreteScheduler(**plugin.SCHEDULER_CONFIG))
    pipe.set_progress_bar_config(disable=True)
    z0, steps = policy.initial_noise(2, torch.Generator().manual_seed(1)), 3
    kwargs = dict(prompt=PROMPTS, latents=z0.clone(), num_inference_steps=steps, height=32, width=32,
                  guidance_scale=4.5, max_sequence_length=32, complex_human_instruction=None,
                  use_resolution_binning=False)
    theirs = pipe(output_type="latent", **kwargs)[0]
    sched, embeds, z = policy.schedule(steps), policy.encode_prompts(PROMPTS), z0
    torch.testing.assert_close(sched.sigmas, pipe.scheduler.sigmas.double(), rtol=0, atol=1e-6)
    with torch.no_grad():
        for j in range(steps):
            z = z + (sched.sigmas[j + 1] - sched.sigmas[j]).float() * policy.velocity(z, sched.timesteps[j].expand(2),
                                                                                     embeds)
    assert not torch.allclose(z, z0, atol=1e-2)
    torch.testing.assert_close(z, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(policy.decode(z), pipe(output_type="pt", **kwargs)[0], rtol=1e-4, atol=1e-4)


def test_saved_folder_loads_the_same_model(plugin, tmp_path):
    from diffusers import SanaPipeline

    folder = plugin.save_tiny_sana(tmp_path / "tiny-sana", seed=3)
    assert type(SanaPipeline.from_pretrained(folder)).__name__ == plugin.PIPELINE_CLASS  # diffusers loads it as is
    loaded, seeded = build(plugin, path=str(folder)), build(plugin, seed=3)
    for part in ("transformer", "text_encoder", "vae"):
        assert same_weights(state(getattr(loaded, part)), state(getattr(seeded, part))), part
    assert loaded.tokenizer(PROMPTS).input_ids == seeded.tokenizer(PROMPTS).input_ids
    with pytest.raises(PolicyError, match=r"is not a tiny-sana folder \(model_index.json is missing\)"):
        build(plugin, path=str(tmp_path))


def test_options_are_checked_in_one_sentence(plugin):
    for options, needle in (({"heigth": 32}, r"unknown model option\(s\) heigth for backbone 'tiny-sana'"),
                            ({"height": 30}, r"model.options.height = 30 is invalid: .*multiple of 4"),
                            ({"height": 2048}, r"model.options.height = 2048 is out of range \[4, 1024\]"),
                            ({"guidance_scale": "high"}, r"model.options.guidance_scale = 'high' is invalid"),
                            ({"gradient_checkpointing": 1}, r"model.options.gradient_checkpointing = 1 is invalid"),
                            ({"width": True}, r"model.options.width = True is invalid")):
        with pytest.raises(PolicyError, match=needle):
            plugin.check_options(options)
    assert plugin.check_options({}) == plugin.DEFAULTS


def test_declared_facts_agree_with_the_model(plugin):
    """The module-level facts a spec will carry (cost, export) are those of the model the code builds."""
    import diffusers

    policy = build(plugin)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    arch = plugin.ARCHITECTURE
    assert arch["params"] == count(policy.transformer)
    assert arch["frozen_params"] == count(policy.text_encoder) + count(policy.vae)
    assert arch["layers"] == len(policy.transformer.transformer_blocks)
    config = policy.transformer.config
    assert arch["hidden"] == config.num_attention_heads * config.attention_head_dim
    assert arch["pixels_per_token"] * policy.latent_shape()[1] == policy.height
    assert type(policy.transformer).__name__ == plugin.TRANSFORMER_CLASS
    assert hasattr(diffusers, plugin.PIPELINE_CLASS)
    assert set(plugin.DEFAULTS) == set(plugin.OPTIONS) and plugin.check_options(plugin.DEFAULTS) == plugin.DEFAULTS


def test_full_finetune_exports_as_a_sana_transformer_folder(plugin, tmp_path):
    from diffusers import SanaTransformer2DModel

    from jagg_core.pipeline.export import export_transformer

    policy = build(plugin)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.01)
    out = export_transformer(policy.transformer, tmp_path / "exp", backbone=plugin.NAME, card={})
    got = SanaTransformer2DModel.from_pretrained(out / "transformer").state_dict()
    assert same_weights(got, state(policy.transformer))


# jagg's trainer on it:


def _update_gradients(policy, traj, sample, mode: str, window: int) -> list[torch.Tensor]:
    """The trainer's update stage (accumulate_gradients) over every trained step of ``traj``; returns the gradients."""
    from jagg_core.jagg import plan_groups
    from jagg_core.setup.config import ResolvedMethod, TrainConfig
    from jagg_core.trainer.update import UpdateContext, accumulate_gradients

    method = ResolvedMethod(name=mode, mode=mode, window=window, jagg_frac=1.0, variant="joint", anchors=2)
    groups = plan_groups(traj.train_steps, window, 1.0, mode=mode)
    ctx = UpdateContext(policy, method, sample, TrainConfig(micro_batch=4))
    stats = accumulate_gradients(ctx, traj, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.arange(4), groups,
                                 reuse=False)
    assert stats.backward_calls == (len(traj.train_steps) if mode == "exact" else len(groups))
    grads = [p.grad.clone() for p in policy.trainable_parameters()]
    for p in policy.trainable_parameters():
        p.grad = None
    return grads


def test_jagg_at_window_2_gives_the_exact_gradient(plugin):
    """In float64, the update stage of the exact baseline and of JAGG with W = 2 (anchors t_0 and t_1: Eq. 7 then has
    no interpolated middle) on the same rollout of the trainer's own sampler give the same gradient."""
    from jagg_core.setup.config import SampleConfig
    from jagg_core.trainer.rollout import rollout

    sample = SampleConfig(recipe="dance_grpo", num_steps=4, noise_level=0.7, group_size=2, prompts_per_iteration=2,
                          batch_size=4)
    policy = build(plugin, dtype=torch.float64)
    traj = rollout(policy, PROMPTS, [0, 1], sample, seed=0, iteration=0)
    assert traj.train_steps == [0, 1, 2, 3] and traj.images.shape == (4, 3, 32, 32)
    exact = _update_gradients(policy, traj, sample, "exact", window=2)
    jagg = _update_gradients(policy, traj, sample, "jagg", window=2)
    flat_exact, flat_jagg = torch.cat([g.flatten() for g in exact]), torch.cat([g.flatten() for g in jagg])
    assert flat_exact.norm() > 0
    assert (flat_jagg - flat_exact).norm() <= 1e-12 * flat_exact.norm()  # measured: 2e-15
    # At W = 4 JAGG interpolates the middle steps' Jacobians: another gradient (measured: 19% off, cosine 0.98).
    jagg4 = torch.cat([g.flatten() for g in _update_gradients(policy, traj, sample, "jagg", window=4)])
    assert (jagg4 - flat_exact).norm() > 1e-2 * flat_exact.norm()
    assert torch.nn.functional.cosine_similarity(jagg4, flat_exact, dim=0) > 0.9


def sana_project(root):
    """A project root with training prompts for the ci profile (the toy's base model is not needed)."""
    from jagg_core.setup.storage import write_prompts_jsonl

    write_prompts_jsonl(root / "data/ci/prompts/train.jsonl",
                        ["a red cat", "two blue dogs", "a green tree by a lake", "an orange sunset"])
    return root


def sana_params(plugin, **overrides):
    """The ci profile with a trivial reward and a linear first update, its model section swapped for the plugin's
    after validation."""
    from jagg_core.setup.params_io import load_params

    params = load_params(REPO / "params.yaml", "ci", {
        "reward.weights": {"jpeg_compressibility": 1.0}, "sample.num_steps": 4, "sample.group_size": 4,
        "sample.prompts_per_iteration": 2, "train.iterations": 2, "train.adam_eps": 1.0, "train.lr": 1.0,
        **overrides})
    model = params.model.model_copy(update={"backbone": plugin.NAME, "path": None,
                                            "options": {"height": 32, "width": 32, "guidance_scale": 4.5}})
    return params.model_copy(update={"model": model})


def test_trainer_trains_the_plugin_backbone(plugin, tmp_path):
    """`train` (the whole recipe: rollout, reward, advantages, fidelity monitor, KL to the reference, update,
    checkpoint, curve) for two iterations of the baseline and of JAGG at W = 2 (exact by Eq. 7), then of JAGG at
    W = 3 (ci's). AdamW with eps 1 and lr 1 makes the first steps about linear in the gradient (as in
    tests/test_trainer.py's two-process test), so the trained weights compare the gradients."""
    from jagg_core.setup.paths import Layout
    from jagg_core.trainer import latest_checkpoint, train

    base = state(build(plugin).transformer)
    trained = {}
    # (method, W) -> the passes of one iteration's update over the 4 trained steps: (grad forwards, no-grad
    # forwards, backwards). JAGG at W = 3: the group [0, 1, 2] by its two anchors and a no-grad middle, [3] exact.
    passes = {("baseline", None): (4, 0, 4), ("jagg", 2): (4, 0, 2), ("jagg", 3): (3, 1, 2)}
    for name, window in passes:
        overrides = {} if window is None else {"jagg.window": window, "jagg.jagg_frac": 1.0}
        root = sana_project(tmp_path / f"{name}-w{window}")
        res = train(sana_params(plugin, **overrides), name, 0, root=root, progress=False)
        assert len(res.history) == 2
        for h in res.history:
            assert h["reward/jpeg_compressibility/group_std"] > 0 and h["train/grad_norm"] > 0
            assert (h["train/grad_forwards"], h["train/nograd_forwards"], h["train/backward_calls"]) == \
                passes[(name, window)]
        assert "jagg/cos_jagg/g0" in res.history[0]  # the fidelity monitor ran on it too
        ckpt = latest_checkpoint(Layout(root, "ci").checkpoints(f"{name}-s0"))
        assert ckpt is not None and ckpt.iteration == 2
        weights = ckpt.tensors()
        assert set(weights) == set(base)
        assert sum(not torch.equal(weights[k], base[k]) for k in base) > len(base) // 2  # the transformer moved
        trained[(name, window)] = weights
    # JAGG at W = 2 trains like the baseline (their gradients agree to rounding: the same two Adam steps).
    a, b, c = trained[("baseline", None)], trained[("jagg", 2)], trained[("jagg", 3)]
    moved = max(float((a[k] - base[k]).abs().max()) for k in a)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-4 * moved  # measured: 1e-6
    assert max(float((a[k] - c[k]).abs().max()) for k in a) > 1e-2 * moved  # W = 3 interpolates: not exact
