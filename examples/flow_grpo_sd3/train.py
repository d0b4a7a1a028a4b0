"""A GRPO trainer in Flow-GRPO's shape, whose per-timestep backward becomes JAGG with a handful of changed lines.

The training step of Flow-GRPO's scripts/train_sd3.py (github.com/yifan123/flow_grpo): its SDE step with
log-probabilities, classifier-free guidance with the unconditional branch detached, LoRA through peft, accelerate's
``accumulate`` and ``backward`` (a GradScaler under fp16, DDP's gradient sync), a β KL to the reference (the adapter
disabled) with Flow-GRPO's own KL, per-prompt advantages, ``timestep_fraction`` as a prefix of the steps. It runs on
a tiny random ``SD3Transformer2DModel`` on CPU, with a toy reward, so a newcomer can run it in seconds; on a real SD3
the model, the prompts' embeddings and the reward are the only parts to swap.

Every line that JAGG changes is marked ``# JAGG:``. The per-step loop (``--per-step``) is Flow-GRPO's, unchanged.

    python examples/flow_grpo_sd3/train.py --window 4            # JAGG, W = 4 (2 backward passes per group)
    python examples/flow_grpo_sd3/train.py --window 1            # JAGG off: the per-step loop, bit for bit
    python examples/flow_grpo_sd3/train.py --per-step            # Flow-GRPO's own loop
    accelerate launch --num_processes 2 --multi_gpu examples/flow_grpo_sd3/train.py --cpu   # DDP (gloo on CPU)

docs/trainers.md explains each change; tests/test_example_trainer.py holds the example to its claims.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections import defaultdict
from dataclasses import dataclass, field, fields

import torch
from accelerate import Accelerator
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from peft import LoraConfig, get_peft_model

from jagg_core import group_advantages, group_surrogate, plan_groups, ppo_step_loss, sde_step_with_logprob


@dataclass
class Config:
    """Flow-GRPO's names where it has one (its config/base.py)."""

    seed: int = 0
    num_steps: int = 10  # sample.num_steps
    timestep_fraction: float = 0.99  # train.timestep_fraction: the first int(T · fraction) steps are trained
    noise_level: float = 0.7  # sample.noise_level: the Flow-SDE's a
    guidance_scale: float = 4.5  # sample.guidance_scale
    cfg: bool = True  # train.cfg
    num_prompts: int = 2  # prompts per epoch (all processes)
    group_size: int = 4  # images per prompt
    train_batch_size: int = 2  # images per micro-batch, per process
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step (Flow-GRPO's meaning)
    epochs: int = 1
    lr: float = 3e-4
    beta: float = 0.04  # train.beta, on Flow-GRPO's KL
    clip_range: float = 1e-4  # train.clip_range
    adv_clip_max: float = 5.0  # train.adv_clip_max
    max_grad_norm: float = 1.0
    lora_rank: int = 4
    num_layers: int = 2  # the transformer's size: tiny by default, larger for timing (scripts/trainer_costs.py)
    head_dim: int = 8
    latent_size: int = 8  # latents (B, 4, latent_size, latent_size)
    mixed_precision: str = "no"  # "no", "bf16" or "fp16" (accelerate's)
    grad_scaler: bool = False  # a GradScaler where accelerate makes none (on CPU): its GPU fp16 path, on CPU
    cpu: bool = False
    per_step: bool = False  # Flow-GRPO's own loop instead of the groups
    window: int = 4  # JAGG: W (1: off, every step its own exact group)
    jagg_frac: float = 1.0  # JAGG: the share of full groups, high noise first, through JAGG (the rest exact)
    log: dict = field(default_factory=lambda: defaultdict(list))


# --- the model, the prompts and the rollout (Flow-GRPO's pipeline_with_logprob, in miniature) ----------------------


def build_transformer(config: Config) -> torch.nn.Module:
    """A tiny random SD3 transformer with Flow-GRPO's LoRA targets."""
    torch.manual_seed(config.seed)
    transformer = SD3Transformer2DModel(sample_size=config.latent_size, patch_size=2, in_channels=4,
                                        num_layers=config.num_layers, attention_head_dim=config.head_dim,
                                        num_attention_heads=2, joint_attention_dim=32,
                                        caption_projection_dim=2 * config.head_dim, pooled_projection_dim=32,
                                        out_channels=4, pos_embed_max_size=16)
    transformer.requires_grad_(False)
    targets = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
               "attn.to_out.0", "attn.to_q", "attn.to_v"]
    # init_lora_weights=False: random A and B, so the policy starts away from the reference and the KL is not 0
    return get_peft_model(transformer, LoraConfig(r=config.lora_rank, lora_alpha=2 * config.lora_rank,
                                                  init_lora_weights=False, target_modules=targets))


def prompt_embeddings(config: Config) -> dict[str, torch.Tensor]:
    """Stand-ins for the text encoders' output: one (6, 32) embedding and one pooled (32,) per prompt, and the
    negative prompt's."""
    g = torch.Generator().manual_seed(1000 + config.seed)
    return {"embeds": torch.randn(config.num_prompts, 6, 32, generator=g),
            "pooled": torch.randn(config.num_prompts, 32, generator=g),
            "neg_embeds": torch.randn(1, 6, 32, generator=g), "neg_pooled": torch.randn(1, 32, generator=g)}


def noise_pred(transformer, latents, timesteps, embeds, pooled, neg_embeds, neg_pooled, config):
    """Flow-GRPO's compute_log_prob up to the SDE step: the guided velocity, its unconditional branch detached."""
    if not config.cfg:
        return transformer(hidden_states=latents, timestep=timesteps, encoder_hidden_states=embeds,
                           pooled_projections=pooled, return_dict=False)[0]
    n = len(latents)
    out = transformer(hidden_states=torch.cat([latents] * 2), timestep=torch.cat([timesteps] * 2),
                      encoder_hidden_states=torch.cat([neg_embeds.expand(n, -1, -1), embeds]),
                      pooled_projections=torch.cat([neg_pooled.expand(n, -1), pooled]), return_dict=False)[0]
    uncond, text = out.chunk(2)
    uncond = uncond.detach()
    return uncond + config.guidance_scale * (text - uncond)


@torch.no_grad()
def rollout(transformer, emb, config: Config, device) -> dict[str, torch.Tensor]:
    """Every process's images of the epoch (B, …), seeded by the epoch alone, so one process and several shard the
    same samples: latents (B, T + 1, 4, h, w), log_probs (B, T), timesteps (B, T), sigmas (T + 1,), rewards."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(config.num_steps)
    sigmas = scheduler.sigmas.to(torch.float32)
    g = torch.Generator().manual_seed(config.seed)
    prompt = torch.arange(config.num_prompts).repeat_interleave(config.group_size)
    b = len(prompt)
    z = torch.randn(b, 4, config.latent_size, config.latent_size, generator=g).to(device)
    latents, log_probs = [z], []
    for j in range(config.num_steps):
        t = (sigmas[j] * 1000).expand(b).to(device)
        v = noise_pred(transformer, z, t, emb["embeds"][prompt].to(device), emb["pooled"][prompt].to(device),
                       emb["neg_embeds"].to(device), emb["neg_pooled"].to(device), config)
        step = sde_step_with_logprob(z, v.float(), float(sigmas[j]), float(sigmas[j + 1]),
                                     noise_level=config.noise_level, kind="flow_grpo", generator=g)
        z = step.prev_sample
        latents.append(z)
        log_probs.append(step.log_prob)
    rewards = -((z.mean(dim=(1, 2, 3)) - 0.3) ** 2)  # a toy reward: the image's mean near 0.3
    return {"prompt": prompt, "latents": torch.stack(latents, dim=1), "log_probs": torch.stack(log_probs, dim=1),
            "timesteps": (sigmas[:-1] * 1000).expand(b, -1).to(device), "sigmas": sigmas, "rewards": rewards}


# --- the training step -----------------------------------------------------------------------------------------------


def step_loss(transformer, accelerator, sample, j, prediction, config: Config):
    """Flow-GRPO's loss of trained step j given the policy's guided velocity: the SDE step's log-prob, the clipped
    ratio, and β times Flow-GRPO's KL to the reference (the adapter disabled), whose forward runs here."""
    sigmas = sample["sigmas"]
    latents, nxt = sample["latents"][:, j].float(), sample["latents"][:, j + 1].float()
    step = sde_step_with_logprob(latents, prediction.float(), float(sigmas[j]), float(sigmas[j + 1]),
                                 noise_level=config.noise_level, kind="flow_grpo", prev_sample=nxt)
    ref_mean = None
    if config.beta > 0:
        with torch.no_grad(), accelerator.unwrap_model(transformer).disable_adapter():
            ref = noise_pred(transformer, sample["latents"][:, j], sample["timesteps"][:, j], *sample["emb"], config)
            ref_mean = sde_step_with_logprob(latents, ref.float(), float(sigmas[j]), float(sigmas[j + 1]),
                                             noise_level=config.noise_level, kind="flow_grpo", prev_sample=nxt).mean
    advantages = torch.clamp(sample["advantages"], -config.adv_clip_max, config.adv_clip_max)
    out = ppo_step_loss(step.log_prob, sample["log_probs"][:, j], advantages, clip_range=config.clip_range,
                        mean=step.mean, ref_mean=ref_mean, std=step.std, beta=config.beta,
                        kl_convention="flow_grpo", dt=float(sigmas[j + 1] - sigmas[j]))
    return out.loss, {"policy_loss": out.policy_loss, "kl_loss": out.kl, "approx_kl": out.approx_kl,
                      "clipfrac": out.clipfrac}


def backward_passes(config: Config) -> int:
    """Backward calls per micro-batch: Flow-GRPO's one per trained step, or one per group."""
    trained = int(config.num_steps * config.timestep_fraction)  # Flow-GRPO's num_train_timesteps
    if config.per_step:
        return trained
    return len(plan_groups(config.num_steps, config.window, config.jagg_frac, fraction=config.timestep_fraction,  # JAGG:
                           subset="prefix"))


def train_micro_batch(accelerator, transformer, optimizer, params, sample, config: Config) -> None:
    """One micro-batch: Flow-GRPO's loop over the trained timesteps, or (the changed lines) over the groups."""

    def velocity(j):
        return noise_pred(transformer, sample["latents"][:, j], sample["timesteps"][:, j], *sample["emb"], config)

    def loss_of(j, prediction):
        return step_loss(transformer, accelerator, sample, j, prediction, config)

    if config.per_step:
        units = [(j,) for j in range(int(config.num_steps * config.timestep_fraction))]
    else:
        units = plan_groups(config.num_steps, config.window, config.jagg_frac,  # JAGG: the groups, not the steps
                            fraction=config.timestep_fraction, subset="prefix")
        scale = len(units) / int(config.num_steps * config.timestep_fraction)  # JAGG: Flow-GRPO's loss weight
    for unit in units:
        with accelerator.accumulate(transformer):
            if config.per_step:
                (j,) = unit
                loss, info = loss_of(j, velocity(j))
            else:
                out = group_surrogate(lambda i: velocity(unit.steps[i]),  # JAGG: one group, one scalar
                                      lambda i, v: loss_of(unit.steps[i], v),
                                      sample["timesteps"][:, list(unit.steps)], unit.mode)
                loss, info = out.loss * scale, out.stats.extras  # JAGG
            for k, x in info.items():
                config.log[k].append(float(x))
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                config.log["grads"].append(torch.cat([p.grad.detach().flatten().float().cpu() for p in params]))
                if config.grad_scaler and not accelerator.native_amp:  # accelerate unscales here under native fp16
                    accelerator.scaler.unscale_(optimizer.optimizer)
                accelerator.clip_grad_norm_(params, config.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()


def train(config: Config) -> dict:
    """Set up as Flow-GRPO does, roll out, train; returns what the tests and a reader check (the log)."""
    accelerator = Accelerator(cpu=config.cpu, mixed_precision=config.mixed_precision,
                              # Flow-GRPO: GA × num_train_timesteps; with JAGG, GA × the groups (backward_passes)
                              gradient_accumulation_steps=config.gradient_accumulation_steps * backward_passes(config))
    if config.grad_scaler and accelerator.scaler is None:  # accelerate makes one for fp16 on a GPU only
        accelerator.scaler = torch.amp.GradScaler(accelerator.device.type, init_scale=2.0**10)
    transformer = build_transformer(config)
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    _count_allreduces(transformer, config)
    emb = prompt_embeddings(config)
    world, rank = accelerator.num_processes, accelerator.process_index
    for epoch in range(config.epochs):
        transformer.eval()
        samples = rollout(transformer, emb, config, accelerator.device)
        samples["advantages"] = group_advantages(samples["rewards"], samples["prompt"], eps=1e-4,
                                                 clip=config.adv_clip_max, global_std=False)  # per prompt
        # this process's images: every world-th, so k processes' first micro-batches are one process's first k
        mine = torch.arange(rank, len(samples["prompt"]), world)
        transformer.train()
        for i, rows in enumerate(mine.split(config.train_batch_size)):
            prompt = samples["prompt"][rows]
            sample = {k: samples[k][rows] for k in ("latents", "log_probs", "timesteps", "advantages")}
            sample["sigmas"] = samples["sigmas"]
            sample["emb"] = (emb["embeds"][prompt].to(accelerator.device),
                                                 emb["pooled"][prompt].to(accelerator.device),
                                                 emb["neg_embeds"].to(accelerator.device),
                                                 emb["neg_pooled"].to(accelerator.device))
            train_micro_batch(accelerator, transformer, optimizer, params, sample, config)
            if accelerator.sync_gradients:
                config.log["optimizer_steps_after"].append(i)
                config.log["skipped"].append(bool(accelerator.optimizer_step_was_skipped))
                if accelerator.scaler is not None:
                    config.log["scale"].append(float(accelerator.scaler.get_scale()))
    config.log["rank"] = rank
    config.log["weights"] = torch.cat([p.detach().flatten().float().cpu() for p in params])
    return config.log


def _count_allreduces(model, config: Config) -> None:
    """Under DDP, count the gradient synchronisations: one per backward outside ``no_sync`` (bucket 0 of each)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def counting(state, bucket):
        if bucket.index() == 0:
            config.log["allreduces"].append(1)
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in fields(Config):
        if f.name == "log":
            continue
        name, default = f.name, f.default
        kind = type(default)
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action="store_true", default=default)
        else:
            parser.add_argument(flag, type=kind, default=default)
    parser.add_argument("--out", help="write the log (counts, losses; gradients and weights as lists) to this JSON file")
    args = vars(parser.parse_args())
    out = args.pop("out")
    log = train(Config(**args))
    summary = {k: (v.tolist() if isinstance(v, torch.Tensor) else [x.tolist() for x in v] if k == "grads" else v)
               for k, v in log.items()}
    if out:
        with open(f"{out}.rank{summary['rank']}", "w") as f:
            json.dump(summary, f)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("grads", "weights")
                      and not isinstance(v, list)} | {"optimizer_steps_after": summary["optimizer_steps_after"],
                                                     "allreduces": len(summary.get("allreduces", []))}))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
