"""The GRPO training recipe: rollout → rewards → advantages → update (exact / JAGG / ablate) → checkpoint.

One code path for every method; methods differ only in the backward mode of their groups. Runs in one process, or
in several launched by ``accelerate launch`` (gloo on CPU, NCCL on GPUs): each process samples its share of the
iteration's prompts, and gradients are synchronised once per optimizer step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..advantages import group_advantages
from ..config import Params, ResolvedMethod
from ..faults import fault
from ..fidelity import gradient_fidelity
from ..paths import Layout, run_name
from ..build import pick_device, policy_from_params, reward_from_params
from ..policies.lora import load_trainable_state_dict, trainable_state_dict
from ..sampling import image_grid
from .checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, save_checkpoint
from .distributed import Fsdp2Sync, make_grad_sync, shard_transformer
from .fingerprint import run_fingerprint
from .logging import MetricLogger, MultiLogger, NullLogger, TsvCurve, atomic_write_text
from .rollout import Trajectory, derive_seed, rollout
from .update import UpdateStats, accumulate_gradients, make_step_fns, plan_update

__all__ = ["TrainingError", "TrainResult", "train", "read_prompts"]

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot continue; the message is for the user."""


@dataclass
class TrainResult:
    run: str
    iterations: int
    checkpoint: Path | None
    curve: Path
    history: list[dict[str, float]] = field(default_factory=list)


def read_prompts(path: str | Path) -> list[str]:
    """Prompts of a ``.jsonl`` file of ``{"prompt": ...}`` lines (or a ``.txt`` file, one per line)."""
    path = Path(path)
    if not path.exists():
        raise TrainingError(f"the training prompts {path} do not exist; run the prepare stage (`jagg prepare`).")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                obj = json.loads(line)
                prompts.append(obj["prompt"] if isinstance(obj, dict) else None)
            except (json.JSONDecodeError, KeyError):
                prompts.append(None)
            if not isinstance(prompts[-1], str):
                raise TrainingError(f"{path}:{n} is not a JSON object with a string 'prompt'; fix or regenerate it.")
        else:
            prompts.append(line.strip())
    if not prompts:
        raise TrainingError(f"{path} has no prompts; regenerate it with `jagg prepare`.")
    return prompts


def _optimizer_state(optimizer, module, *, sharded: bool) -> dict:
    """The optimizer state to save; under FSDP2 gathered to full tensors (a collective: every rank calls it)."""
    if not sharded:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _load_optimizer(optimizer, module, state: dict, *, sharded: bool) -> None:
    if not sharded:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))


def _iteration_prompts(train_prompts: Sequence[str], n: int, seed: int, iteration: int) -> list[int]:
    g = torch.Generator().manual_seed(derive_seed(seed, iteration, -2))
    return torch.randint(len(train_prompts), (n,), generator=g).tolist()


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def train(
    params: Params,
    method_name: str,
    seed: int,
    *,
    root: str | Path = ".",
    logger: MetricLogger | None = None,
    resume: bool = True,
    accelerator: Any = None,
    progress: bool = True,
    run_key: str | None = None,
) -> TrainResult:
    """Train ``method_name`` with ``seed`` for ``params.train.iterations`` iterations.

    Resumes from the latest complete checkpoint whose run fingerprint (``run_key``, default: computed from the params)
    matches; checkpoints of another configuration are moved aside to ``<run>.superseded-<key>`` and training starts
    over.
    """
    from accelerate import Accelerator

    # Setup: processes, device, layout.
    method: ResolvedMethod = params.method(method_name)
    layout = Layout(Path(root).resolve(), params.profile)
    run = run_name(method_name, seed)
    res = params.resources
    if res.num_threads:
        torch.set_num_threads(res.num_threads)
    use_cpu = pick_device(params).type == "cpu"
    if accelerator is None:
        # cpu=True is what makes several CPU processes a real gloo group (else each rank silently trains alone).
        accelerator = Accelerator(cpu=use_cpu, mixed_precision=res.mixed_precision)
    rank, world = accelerator.process_index, accelerator.num_processes
    main = accelerator.is_main_process
    sample, tcfg = params.sample, params.train
    if sample.prompts_per_iteration % world:
        raise TrainingError(
            f"sample.prompts_per_iteration ({sample.prompts_per_iteration}) must be a multiple of the number of "
            f"processes ({world}) so every process holds whole prompt groups."
        )
    torch.manual_seed(derive_seed(seed, rank))

    # Policy, data parallelism, optimizer, reward.
    policy = policy_from_params(params, layout, accelerator.device)
    if tcfg.beta > 0:  # the KL reference is the base model, frozen before any update or resume
        policy.keep_reference()
    if res.distributed == "fsdp" and world > 1:
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        shard_transformer(policy.transformer, getattr(plugin, "transformer_cls_names_to_wrap", None))
    sync = make_grad_sync(res.distributed, world, policy.transformer)
    trainable = policy.trainable_parameters()
    if not trainable:
        raise TrainingError("the policy has no trainable parameters; check model.lora.")
    optimizer = torch.optim.AdamW(trainable, lr=tcfg.lr, betas=tcfg.adam_betas, eps=tcfg.adam_eps,
                                  weight_decay=tcfg.weight_decay)
    named = [(n, p) for n, p in policy.transformer.named_parameters() if p.requires_grad]
    ema = {n: p.detach().float().clone() for n, p in named} if tcfg.ema_decay > 0 else None
    reward_fn = reward_from_params(params)
    train_prompts = read_prompts(layout.train_prompts)

    # Resume from the latest complete checkpoint of the same configuration.
    ckpt_root = layout.checkpoints(run)
    run_key = run_key or run_fingerprint(params, layout, method_name, seed)
    start, policy_version, jagg_frac = 0, 0, method.jagg_frac
    ckpt = latest_checkpoint(ckpt_root) if resume else None
    if resume and ckpt is None and list_checkpoints(ckpt_root, check=False):
        raise CheckpointError(
            f"{ckpt_root} holds checkpoints but no complete checkpoint (every one is damaged); move the folder aside "
            f"to start over."
        )
    if ckpt is not None and ckpt.state().get("run_key") != run_key:
        old = ckpt.state().get("run_key", "unknown")
        if main:
            aside = ckpt_root.with_name(f"{ckpt_root.name}.superseded-{old}")
            log.warning("%s: checkpoints under %s were written with other params; moved to %s, starting over",
                        run, ckpt_root, aside)
            shutil.rmtree(aside, ignore_errors=True)
            ckpt_root.rename(aside)
        accelerator.wait_for_everyone()
        ckpt = None
    if ckpt is not None:
        state = ckpt.state()
        load_trainable_state_dict(policy.transformer, ckpt.tensors())
        _load_optimizer(optimizer, policy.transformer, ckpt.optimizer_state(), sharded=isinstance(sync, Fsdp2Sync))
        if ema is not None and (ckpt.path / "ema.safetensors").exists():
            ema = {k: v.float() for k, v in ckpt.tensors("ema").items()}
        start, policy_version = int(state["iteration"]), int(state["policy_version"])
        jagg_frac = state.get("jagg_frac", jagg_frac)
        if main:
            log.info("resuming %s from %s (iteration %d)", run, ckpt.path, start)
    curve = TsvCurve(layout.curve(run), resume_from=start)
    sink = MultiLogger([curve, logger or NullLogger()]) if main else NullLogger()
    if main:
        atomic_write_text(layout.run_dir(run) / "params.json", params.model_dump_json(indent=2) + "\n")

    def autocast():
        return accelerator.autocast() if res.mixed_precision != "no" else contextlib.nullcontext()

    def save(iteration: int, metrics: dict[str, float]) -> Path | None:
        state = {"run_key": run_key, "policy_version": policy_version, "jagg_frac": jagg_frac,
                 "method": method_name, "seed": seed,
                 "metrics": metrics, "params": params.model_dump(mode="json")}
        trainable_state = trainable_state_dict(policy.transformer)  # collective under FSDP: every rank takes part
        opt_state = _optimizer_state(optimizer, policy.transformer, sharded=isinstance(sync, Fsdp2Sync))
        path = None
        if main:
            path = save_checkpoint(ckpt_root, iteration, trainable=trainable_state, optimizer=opt_state,
                                   state=state, ema=ema, keep=tcfg.keep_checkpoints).path
        accelerator.wait_for_everyone()
        return path

    history: list[dict[str, float]] = []
    consecutive_skips = 0
    last_ckpt = ckpt.path if ckpt is not None else None
    bar = None
    if progress and main:
        from tqdm import tqdm

        bar = tqdm(total=tcfg.iterations, initial=start, desc=f"train {run}", unit="it", dynamic_ncols=True)

    t_loop = time.perf_counter()
    for it in range(start, tcfg.iterations):
        step = it + 1  # iterations completed after this one: the x-axis of every curve
        t_iter = time.perf_counter()
        metrics: dict[str, float] = {}

        # Rollout: this process's prompts, G images each.
        idx = _iteration_prompts(train_prompts, sample.prompts_per_iteration, seed, it)
        per_rank = sample.prompts_per_iteration // world
        mine = list(range(rank * per_rank, (rank + 1) * per_rank))
        fault("rollout", step)
        t0 = time.perf_counter()
        traj = rollout(policy, [train_prompts[idx[k]] for k in mine], mine, sample, seed=seed, iteration=it,
                       keep_velocities=method.reuse_rollout_velocity and method.mode != "exact",
                       policy_version=policy_version)
        metrics["time/rollout"] = time.perf_counter() - t0

        # Rewards and advantages.
        t0 = time.perf_counter()
        prompts_b = [traj.prompts[int(i)] for i in traj.prompt_index]
        rewards, info = reward_fn(traj.images, prompts_b, [{} for _ in prompts_b])
        if fault("reward", step) == "nan":
            rewards = rewards.clone()
            rewards[0] = float("nan")
        metrics["time/reward"] = time.perf_counter() - t0
        all_rewards = accelerator.gather(rewards.to(accelerator.device)).cpu()
        metrics["reward/mean"] = float(all_rewards.mean())
        metrics["reward/std"] = float(all_rewards.std()) if all_rewards.numel() > 1 else 0.0
        for key, val in info.items():
            if isinstance(val, torch.Tensor) and val.numel() == rewards.numel():
                gathered = accelerator.gather(val.float().to(accelerator.device)).cpu()
                metrics[f"{key}/mean"] = float(gathered.mean())
                metrics[f"{key}/std"] = float(gathered.std()) if gathered.numel() > 1 else 0.0
        # Advantages over the global batch (groups never straddle processes, but the global std spans them all), so
        # N processes compute what one process would; every rank keeps its own rows and agrees on skipping.
        all_groups = accelerator.gather(traj.group_ids.to(accelerator.device)).cpu()
        all_adv = group_advantages(all_rewards, all_groups, eps=tcfg.adv_eps, clip=tcfg.adv_clip,
                                   global_std=tcfg.global_std)
        rank = accelerator.process_index
        advantages = all_adv[rank * traj.batch_size : (rank + 1) * traj.batch_size]
        finite = bool(torch.isfinite(advantages).all())
        # Groups whose advantages are all zero carry no signal: skip their images (not under FSDP, where every
        # rank must run the same collectives).
        if isinstance(sync, Fsdp2Sync):
            rows = torch.arange(traj.batch_size)
        else:
            rows = torch.nonzero(advantages != 0).flatten()
        metrics["train/kept_fraction"] = len(rows) / traj.batch_size

        # jagg_frac 'auto' and the fidelity monitor: cos(jagg, exact) per group position on this rollout.
        want_auto = method.jagg_frac == "auto" and (
            jagg_frac == "auto" or (method.auto_every and it % method.auto_every == 0)
        )
        if (want_auto or (tcfg.fidelity_every and it % tcfg.fidelity_every == 0)) and finite and len(rows):
            if isinstance(sync, Fsdp2Sync):
                log.warning("gradient fidelity is not measured under FSDP; jagg_frac 'auto' falls back to 0.6")
                jagg_frac = 0.6 if jagg_frac == "auto" else jagg_frac
            else:
                rep = _fidelity(policy, traj, advantages, rows, method, params, autocast)
                for pos, cj, ca in zip(rep.positions, rep.cos_jagg, rep.cos_ablate):
                    metrics[f"jagg/cos_jagg/g{pos}"] = cj
                    metrics[f"jagg/cos_ablate/g{pos}"] = ca
                if want_auto:
                    jagg_frac = rep.jagg_frac(method.auto_threshold)
        if jagg_frac == "auto":  # no usable rollout yet (e.g. all-zero advantages): be conservative
            jagg_frac = 0.0
        metrics["jagg/jagg_frac"] = float(jagg_frac)

        # Update: backward over the stored experience, one optimizer step per chunk.
        t0 = time.perf_counter()
        ustats = UpdateStats()
        backward_time = optimizer_time = 0.0
        skipped = 0
        grad_norms: list[float] = []
        group_gen = torch.Generator().manual_seed(derive_seed(seed, it, -3))
        for epoch in range(tcfg.inner_epochs):
            perm = rows[torch.randperm(len(rows), generator=group_gen)] if len(rows) else rows
            for chunk in perm.tensor_split(tcfg.optimizer_steps_per_epoch):
                groups = plan_update(traj, method, sample, jagg_frac, group_gen)
                reuse = method.reuse_rollout_velocity and policy_version == traj.policy_version
                sync.start_step()
                if len(chunk) and finite:
                    st = accumulate_gradients(policy, traj, advantages, chunk, groups, method, sample=sample,
                                              train=tcfg, sync=sync, reuse=reuse, autocast=autocast)
                    ustats.add(st)
                t1 = time.perf_counter()
                sync.reduce(trainable)
                norm = torch.nn.utils.clip_grad_norm_(trainable, tcfg.max_grad_norm)
                norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
                nonfinite = not math.isfinite(norm) or not finite or not math.isfinite(ustats.loss)
                if fault("update", step) == "nan":  # (also the kill point "during update": after a backward)
                    nonfinite = True
                if nonfinite:
                    skipped += 1
                elif len(chunk) or world > 1:
                    grad_norms.append(norm)
                    optimizer.step()
                    policy_version += 1
                    if ema is not None:
                        with torch.no_grad():
                            for n, p in named:
                                ema[n].lerp_(p.detach().float(), 1 - tcfg.ema_decay)
                optimizer.zero_grad(set_to_none=True)
                optimizer_time += time.perf_counter() - t1
        backward_time = ustats.backward_seconds
        metrics["time/update"] = time.perf_counter() - t0 - optimizer_time
        metrics["time/backward"] = backward_time
        metrics["time/optimizer"] = optimizer_time
        metrics["train/loss"] = ustats.loss
        for key in ("policy_loss", "approx_kl", "clipfrac", "kl"):
            metrics[f"train/{key}"] = _mean(ustats.extras.get(key, []))
        metrics["train/grad_norm"] = _mean(grad_norms)
        metrics["train/grad_forwards"] = ustats.grad_forwards
        metrics["train/nograd_forwards"] = ustats.nograd_forwards
        metrics["train/forward_calls"] = ustats.forward_calls
        metrics["train/backward_calls"] = ustats.backward_calls
        metrics["train/all_reduces"] = sync.all_reduces
        metrics["jagg/reused_velocities"] = ustats.reused_velocities
        metrics["train/skipped_updates"] = skipped
        metrics["train/policy_version"] = policy_version

        metrics["time/iteration"] = time.perf_counter() - t_iter
        sink.log_metrics(metrics, step)
        # Numerical faults: a non-finite update is skipped; too many in a row stop the run (after logging the row).
        if skipped:
            consecutive_skips += 1
            log.warning("iteration %d: non-finite reward, loss or gradient; update skipped", step)
            if consecutive_skips >= tcfg.max_consecutive_skips:
                raise TrainingError(
                    f"{consecutive_skips} consecutive updates were skipped for non-finite values (iteration {step}); "
                    f"check the rewards and lower train.lr. The last good checkpoint is {last_ckpt}."
                )
        else:
            consecutive_skips = 0
        if main and tcfg.log_images_every and (step % tcfg.log_images_every == 0 or step == 1):
            k = min(8, traj.batch_size)
            sink.log_image(image_grid(traj.images[:k], prompts_b[:k], ncols=4), "rollout", step)
        history.append({"iteration": step, **metrics})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", s_it=f"{metrics['time/iteration']:.1f}")
        elif main:  # no terminal (Prefect, DVC, a log file): one line per iteration, so the run is never silent
            done = len(history)
            eta = (time.perf_counter() - t_loop) / done * (tcfg.iterations - step)
            log.info("train %s: iteration %d/%d  reward %.4f  update %.2f s  iteration %.2f s  ETA %d:%02d", run,
                     step, tcfg.iterations, metrics["reward/mean"], metrics["time/update"],
                     metrics["time/iteration"], eta // 60, eta % 60)

        # Checkpoint every N iterations and at the end.
        if step % tcfg.checkpoint_every == 0 or step == tcfg.iterations:
            last_ckpt = save(step, {k: v for k, v in metrics.items() if not k.startswith("time/")})
    if bar is not None:
        bar.close()
    if start >= tcfg.iterations and main:
        log.info("%s already trained for %d iterations; nothing to do", run, tcfg.iterations)
    return TrainResult(run=run, iterations=tcfg.iterations, checkpoint=last_ckpt, curve=layout.curve(run),
                       history=history)


def _fidelity(policy, traj: Trajectory, advantages, rows, method: ResolvedMethod, params: Params, autocast):
    """cos(JAGG, exact) per group position on a micro-batch of this rollout (its own scale, grads restored)."""
    mb = rows[: params.train.micro_batch]
    steps = traj.train_steps

    def fns(i: int):
        return make_step_fns(policy, traj, mb, advantages, [steps[i]], sample=params.sample, train=params.train,
                             scale=1.0, autocast=autocast)

    def velocity(i: int):
        return fns(i)[0](0)

    def step_loss(i: int, v):
        return fns(i)[2](0, v)

    return gradient_fidelity(policy.trainable_parameters(), velocity, step_loss, traj.timesteps[steps],
                             method.window, anchors=method.anchors, variant=method.variant)
