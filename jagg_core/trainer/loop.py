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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Sequence

import torch

from ..advantages import mixed_advantages
from ..jagg import AUTO_FALLBACK_JAGG_FRAC, plan_groups
from ..media import log_samples
from ..modes import EXACT_MODES
from ..setup.config import Params
from ..setup.faults import TRAINER_FAULTS
from ..setup.metric_logger import MetricLogger, MultiLogger, NullLogger
from ..setup.paths import held
from ..setup.storage import FolderLock, atomic_write_bytes, atomic_write_text
from ..sampling import derive_seed
from .curve import TsvCurve
from .errors import TrainingError
from .rollout import Trajectory, image_layout, rollout
from .session import RunState, resume_run, save_run_checkpoint, setup_run
from .update import UpdateContext, UpdateStats, accumulate_gradients, trajectory_fidelity

if TYPE_CHECKING:  # accelerate is imported where a run starts (session.py:setup_run)
    from accelerate import Accelerator

    from ..rewards.weighted import Scoring

__all__ = ["TrainResult", "train"]

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    run: str
    iterations: int
    checkpoint: Path | None
    curve: Path
    history: list[dict[str, float]] = field(default_factory=list)


class _Scored(NamedTuple):
    """One iteration's experience as the update stage reads it."""

    traj: Trajectory
    advantages: torch.Tensor  # this process's images' advantages
    rows: torch.Tensor  # the images to train (those of groups with a signal)
    finite: bool  # every advantage is finite (else the update is skipped)


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
    accelerator: Accelerator | None = None,
    progress: bool = True,
    run_key: str | None = None,
    restart: bool = False,
) -> TrainResult:
    """Train ``method_name`` with ``seed`` for ``params.train.iterations`` iterations.

    Resumes from the latest complete checkpoint whose run fingerprint (``run_key``, default: computed from the params)
    matches. Checkpoints of another configuration stop the run with one sentence naming what changed, unless
    ``restart``: then they are moved aside to ``<run>.superseded-<key>`` and training starts over. Never silently.
    """
    r = setup_run(params, method_name, seed, Path(root).resolve(), accelerator, run_key)
    r.restart = restart
    # One writer per run: a second trainer of the same run (a retry beside an orphan, a duplicated method) stops here.
    with FolderLock(r.layout.run_dir(r.name), f"training run {r.name}") if r.main else contextlib.nullcontext():
        return _train(r, logger, resume, progress)


def _train(r: RunState, logger: MetricLogger | None, resume: bool, progress: bool) -> TrainResult:
    """The recipe: resume, then per iteration rollout → advantages → routing → optimizer steps → log → checkpoint."""
    params = r.params
    start = resume_run(r) if resume else 0
    curve = TsvCurve(r.layout.curve(r.name), resume_from=start)
    sink = MultiLogger([curve, logger or NullLogger()]) if r.main else NullLogger()
    if r.main:
        atomic_write_text(r.layout.run_dir(r.name) / "params.json",  # the params with secrets redacted
                          json.dumps(params.redacted(), indent=2) + "\n")
    tcfg = params.train
    # What every update of the run shares, built once: the policy, the method, the sections, the sync, the autocast.
    ctx = UpdateContext(r.policy, r.method, params.sample, tcfg, r.sync, r.autocast)
    meter = _Progress(r, start, progress)
    history: list[dict[str, float]] = []
    consecutive_skips = 0
    for it in range(start, tcfg.iterations):
        step = it + 1  # iterations completed after this one: the x-axis of every curve
        t_iter = time.perf_counter()
        metrics: dict[str, float] = {}
        traj, scoring = _rollout(r, it, step, metrics)
        scored = _advantages(r, traj, scoring, step, metrics)
        jagg_frac = _route(r, ctx, it, scored, metrics)
        skipped = _optimizer_steps(r, ctx, it, step, scored, jagg_frac, metrics)
        t0 = time.perf_counter()
        sink.log_metrics(metrics, step)
        consecutive_skips = _check_skips(r, step, skipped, consecutive_skips)
        if r.main and tcfg.log_images_every and (step % tcfg.log_images_every == 0 or step == 1):
            k = min(8, traj.batch_size)
            captions = traj.image_prompts()[:k]
            log_samples(sink, traj.images[:k], captions, "rollout", step)  # a grid; clips: frame strips + a GIF
        timing = {"time/logging": time.perf_counter() - t0, "time/checkpoint": 0.0}
        # Checkpoint every N iterations and at the end.
        if step % tcfg.checkpoint_every == 0 or step == tcfg.iterations:
            t0 = time.perf_counter()
            r.last_ckpt = save_run_checkpoint(r, step, {k: v for k, v in metrics.items() if not k.startswith("time/")})
            timing["time/checkpoint"] = time.perf_counter() - t0
        # The whole iteration, logging and checkpoint included: the phases (time/…) add up to it.
        timing["time/iteration"] = time.perf_counter() - t_iter
        sink.log_metrics(timing, step)
        metrics.update(timing)
        history.append({"iteration": step, **metrics})
        meter.update(step, metrics)
    meter.close()
    if start >= tcfg.iterations and r.main:
        log.info("%s already trained for %d iterations (its last checkpoint; train.iterations is %d); nothing to do",
                 r.name, start, tcfg.iterations)
    return TrainResult(run=r.name, iterations=tcfg.iterations, checkpoint=r.last_ckpt, curve=r.layout.curve(r.name),
                       history=history)


def _rollout(r: RunState, it: int, step: int, metrics: dict[str, float]) -> tuple[Trajectory, Scoring | None]:
    """This process's share of the iteration's prompts, G images each; with a reward that may run beside the policy
    (a served one), the scoring of each micro-batch started as soon as it is sampled."""
    sample, world, rank = r.params.sample, r.accelerator.num_processes, r.accelerator.process_index
    idx = _iteration_prompts(r.train_prompts, sample.prompts_per_iteration, r.seed, it)
    per_rank = sample.prompts_per_iteration // world
    mine = list(range(rank * per_rank, (rank + 1) * per_rank))
    prompts = [r.train_prompts[idx[k]] for k in mine]
    TRAINER_FAULTS.before_rollout(step)
    scoring = None
    if getattr(r.reward_fn, "beside", False):  # the judge scores a part while the policy samples the next
        prompt_index, group_ids = image_layout(mine, sample.group_size)
        scoring = r.reward_fn.begin([prompts[int(i)] for i in prompt_index], [{} for _ in prompt_index], group_ids)
    t0 = time.perf_counter()
    try:
        traj = rollout(r.policy, prompts, mine, sample, seed=r.seed, iteration=it,
                       keep_velocities=r.method.reuse_rollout_velocity and r.method.mode not in EXACT_MODES,
                       policy_version=r.policy_version, autocast=r.autocast,
                       on_images=scoring.add if scoring is not None else None)
    except BaseException:
        if scoring is not None:
            scoring.close()
        raise
    metrics["time/rollout"] = time.perf_counter() - t0
    metrics["sample/window_start"] = traj.train_steps[0]
    return traj, scoring


def _advantages(r: RunState, traj: Trajectory, scoring: Scoring | None, step: int, metrics: dict[str, float]
                ) -> _Scored:
    """Rewards, their statistics, and group advantages; returns the rollout with its advantages and rows to train.
    ``time/reward`` is the time spent scoring after sampling (with ``scoring``, the wait for the calls still out)."""
    acc, tcfg = r.accelerator, r.params.train
    t0 = time.perf_counter()
    prompts_b = traj.image_prompts()
    # A groupwise reward is called once per prompt group (group_ids); a pointwise one once on the whole batch.
    if scoring is not None:  # begun in _rollout: the same calls, sent as the images were sampled
        rewards, info = scoring.result()
    else:
        rewards, info = r.reward_fn(traj.images, prompts_b, [{} for _ in prompts_b], groups=traj.group_ids)
    rewards, info = TRAINER_FAULTS.rewards(rewards, info, r.params.reward.weights, step)
    metrics["time/reward"] = time.perf_counter() - t0
    all_rewards = acc.gather(rewards.to(acc.device)).cpu()
    metrics["reward/mean"] = float(all_rewards.mean())
    metrics["reward/std"] = float(all_rewards.std()) if all_rewards.numel() > 1 else 0.0
    # Each per-image score gathered once: for its statistics here and, the configured rewards', for the advantages.
    gathered = {key: acc.gather(val.float().to(acc.device)).cpu() for key, val in info.items()
                if isinstance(val, torch.Tensor) and val.numel() == rewards.numel()}
    for key, values in gathered.items():
        metrics[f"{key}/mean"] = float(values.mean())
        metrics[f"{key}/std"] = float(values.std()) if values.numel() > 1 else 0.0
    # Advantages over the global batch (groups never straddle processes, but the global std spans them all), so
    # N processes compute what one process would; every rank keeps its own rows and agrees on skipping.
    all_groups = acc.gather(traj.group_ids.to(acc.device)).cpu()
    rcfg = r.params.reward
    parts = {k: gathered[f"reward/{k}"] for k in rcfg.weights}
    for k, values in parts.items():
        metrics.update(_spread_diagnostics(k, values, all_groups))
    all_adv = mixed_advantages(parts, rcfg.weights, all_groups, normalize=rcfg.normalize, eps=tcfg.adv_eps,
                               clip=tcfg.adv_clip, global_std=tcfg.global_std)
    rank = acc.process_index
    advantages = all_adv[rank * traj.batch_size : (rank + 1) * traj.batch_size]
    finite = bool(torch.isfinite(advantages).all())
    # Groups whose advantages are all zero carry no signal: skip their images (not when parameters are sharded,
    # where every rank must run the same collectives).
    rows = torch.arange(traj.batch_size) if r.sync.sharded else torch.nonzero(advantages != 0).flatten()
    metrics["train/kept_fraction"] = len(rows) / traj.batch_size
    if r.main and finite and not r.said_no_signal and not bool((all_adv != 0).any()):
        r.said_no_signal = True
        means = ", ".join(f"{k} {float(v.mean()):.4f}" for k, v in parts.items())
        log.warning("iteration %d: every group's images earned equal rewards (mean %s), so no image has an advantage "
                    "and nothing is updated; a reward the policy never earns teaches nothing: add a denser reward "
                    "beside it (reward.weights) or raise sample.group_size (said once per run; train/kept_fraction "
                    "is 0 on such iterations)", step, means)
    return _Scored(traj, advantages, rows, finite)


def _spread_diagnostics(name: str, rewards: torch.Tensor, groups: torch.Tensor) -> dict[str, float]:
    """The mean within-group std of one reward and the share of groups whose rewards are all equal (those carry no
    gradient; Flow-GRPO logs the same share)."""
    _, inverse = torch.unique(groups, return_inverse=True)
    stds = torch.stack([rewards[inverse == g].std(unbiased=False) for g in range(int(inverse.max()) + 1)])
    return {f"reward/{name}/group_std": float(stds.mean()), f"reward/{name}/zero_std_frac": float((stds == 0).float().mean())}


def _route(r: RunState, ctx: UpdateContext, it: int, scored: _Scored, metrics: dict[str, float]) -> float:
    """This iteration's jagg_frac, a plain float, and the fidelity monitor: cos(jagg, exact) per group position.

    The one place where ``methods.<name>.jagg_frac`` becomes the routing's number (kept in ``r.jagg_frac`` for the
    checkpoint and the next iteration): a number as configured; ``'auto'`` the fidelity curve's reading at the first
    iteration (and every ``auto_every``), else the last reading; under FSDP, where the curve cannot be measured,
    :data:`AUTO_FALLBACK_JAGG_FRAC` until a reading exists; 0.0 when the first reading finds no rollout it could read
    (e.g. all-zero advantages: conservative), kept until the next ``auto_every`` reading (none with ``auto_every: 0``).
    """
    method, tcfg = r.method, r.params.train
    traj, advantages, rows, finite = scored
    auto = method.jagg_frac == "auto"
    want_auto = auto and (r.jagg_frac is None or bool(method.auto_every and it % method.auto_every == 0))
    frac = float(method.jagg_frac) if not auto else r.jagg_frac
    if (want_auto or (tcfg.fidelity_every and it % tcfg.fidelity_every == 0)) and finite and len(rows):
        if r.sync.sharded:
            if r.main and not r.said_no_fidelity:
                log.warning("gradient fidelity is not measured under FSDP; jagg_frac 'auto' falls back to %s",
                            AUTO_FALLBACK_JAGG_FRAC)
                r.said_no_fidelity = True
            if frac is None:  # 'auto' with no reading yet
                frac = AUTO_FALLBACK_JAGG_FRAC
        else:
            t0 = time.perf_counter()
            rep = trajectory_fidelity(ctx, traj, advantages, rows[: tcfg.fidelity_batch])
            metrics["time/fidelity"] = time.perf_counter() - t0
            for pos, cj, ca in zip(rep.positions, rep.cos_jagg, rep.cos_ablate):
                metrics[f"jagg/cos_jagg/g{pos}"] = cj
                metrics[f"jagg/cos_ablate/g{pos}"] = ca
            if want_auto:
                frac = rep.jagg_frac(method.auto_threshold)
    r.jagg_frac = 0.0 if frac is None else frac  # None: no usable rollout yet
    metrics["jagg/jagg_frac"] = r.jagg_frac
    return r.jagg_frac


def _optimizer_steps(r: RunState, ctx: UpdateContext, it: int, step: int, scored: _Scored, jagg_frac: float,
                     metrics: dict[str, float]) -> int:
    """The method's backward over the stored experience, one optimizer step per chunk; returns the steps skipped.

    Each chunk's groups are ``plan_groups``' (routed with ``jagg_frac``, :func:`_route`'s); DanceGRPO's
    timestep_fraction keeps a random subset of whole groups.
    """
    tcfg, sample, method = r.params.train, r.params.sample, r.method
    traj, advantages, rows, finite = scored
    world = r.accelerator.num_processes
    t0 = time.perf_counter()
    ustats = UpdateStats()
    optimizer_time = sync_time = 0.0
    skipped = 0
    grad_norms: list[float] = []
    sizes: list[dict[str, float]] = []  # train.update_size_every's readings, one per optimizer step
    group_gen = torch.Generator().manual_seed(derive_seed(r.seed, it, -3))
    # the random anchors' draws (jagg.random_anchor): a stream per iteration and process, so a resumed run draws alike
    anchor_gen = torch.Generator().manual_seed(derive_seed(r.seed, it, -4, r.accelerator.process_index))
    fraction = sample.group_fraction
    # train/kl_ref at β = 0 is a diagnostic: measured every train.kl_ref_every iterations (and at the first); at β > 0
    # the loss's own KL, computed at every trained step anyway, is logged every iteration
    kl_now = tcfg.kl_ref and (tcfg.beta > 0 or it % tcfg.kl_ref_every == 0)
    for _epoch in range(tcfg.inner_epochs):
        perm = rows[torch.randperm(len(rows), generator=group_gen)] if len(rows) else rows
        for chunk in perm.tensor_split(tcfg.optimizer_steps_per_epoch):
            groups = plan_groups(traj.train_steps, method.window, jagg_frac, mode=method.mode, fraction=fraction,
                                 subset="random", generator=group_gen)
            reuse = method.reuse_rollout_velocity and r.policy_version == traj.policy_version
            r.sync.start_step()
            if len(chunk) and finite:
                ustats.add(accumulate_gradients(ctx, traj, advantages, chunk, groups, reuse=reuse,
                                                measure_kl_ref=kl_now, generator=anchor_gen))
            TRAINER_FAULTS.after_backward(r.trainable, step)
            t1 = time.perf_counter()
            r.sync.reduce(r.trainable)
            t2 = time.perf_counter()
            sync_time += t2 - t1
            norm = torch.nn.utils.clip_grad_norm_(r.trainable, tcfg.max_grad_norm)
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            nonfinite = not math.isfinite(norm) or not finite or not math.isfinite(ustats.loss)
            if nonfinite:
                skipped += 1
            elif len(chunk) or world > 1:
                grad_norms.append(norm)
                before = _UpdateSize(r) if tcfg.update_size_every and it % tcfg.update_size_every == 0 else None
                _step(r)
                if before is not None:
                    sizes.append(before.measure(r, step))
            r.optimizer.zero_grad(set_to_none=True)
            optimizer_time += time.perf_counter() - t2
    # train/kl_ref's reference forwards are a diagnostic, not the method's work: a phase of their own
    metrics["time/update"] = time.perf_counter() - t0 - optimizer_time - sync_time - ustats.kl_ref_seconds
    if kl_now:  # like time/fidelity: only at the iterations it ran (the report averages an absent phase as 0)
        metrics["time/kl_ref"] = ustats.kl_ref_seconds
    metrics["time/backward"] = ustats.backward_seconds
    metrics["time/sync"] = sync_time
    metrics["time/optimizer"] = optimizer_time
    metrics["train/loss"] = ustats.loss
    for key in ("policy_loss", "approx_kl", "clipfrac", "kl", *(("kl_ref",) if kl_now else ())):
        metrics[f"train/{key}"] = _mean(ustats.extras.get(key, []))
    metrics["train/grad_norm"] = _mean(grad_norms)
    for key in ("update_norm", "update_rel", "update_cos_grad") if sizes else ():
        metrics[f"train/{key}"] = _mean([x[key] for x in sizes])
    metrics["train/grad_forwards"] = ustats.grad_forwards
    metrics["train/nograd_forwards"] = ustats.nograd_forwards
    metrics["train/forward_calls"] = ustats.forward_calls
    metrics["train/backward_calls"] = ustats.backward_calls
    metrics["train/all_reduces"] = r.sync.all_reduces
    metrics["jagg/reused_velocities"] = ustats.reused_velocities
    metrics["train/skipped_updates"] = skipped
    metrics["train/policy_version"] = r.policy_version
    return skipped


class _UpdateSize:
    """The optimizer's update of one step (issue 72: how far a method's AdamW steps go): the trained tensors copied
    before the step, then ‖Δθ‖, ‖Δθ‖/‖θ‖ and cos(Δθ, −gradient) after it (the step reads the clipped gradients and
    leaves them: they are zeroed after this). The main process keeps Δθ in ``updates/update-<iteration>.safetensors``
    of the run's folder (the first optimizer step of the iteration), so that two runs' updates at the same seed and
    iteration can be compared (at the first iteration both start from the same weights and rollout). Sharded tensors
    are read whole (``full_tensor``)."""

    def __init__(self, r: RunState):
        self.theta = [_whole(p).float().clone() for p in r.trainable]

    def measure(self, r: RunState, step: int) -> dict[str, float]:
        delta = [_whole(p).float() - t for p, t in zip(r.trainable, self.theta)]
        grad = [_whole(p.grad).float() if p.grad is not None else torch.zeros_like(d) for p, d in zip(r.trainable, delta)]
        norm = math.sqrt(sum(float((d * d).sum()) for d in delta))
        theta = math.sqrt(sum(float((t * t).sum()) for t in self.theta))
        gnorm = math.sqrt(sum(float((g * g).sum()) for g in grad))
        dot = sum(float((d * -g).sum()) for d, g in zip(delta, grad))
        if r.main:
            folder = r.layout.run_dir(r.name) / "updates"
            target = folder / f"update-{step:06d}.safetensors"
            if not target.exists():
                from safetensors.torch import save as st_save

                held(folder).mkdir(exist_ok=True)  # the path rule: a link planted there leads nowhere
                name = {id(p): n for n, p in r.named}  # each trained tensor's name, by identity
                atomic_write_bytes(held(target), st_save({name[id(p)]: d.contiguous().cpu()
                                                          for p, d in zip(r.trainable, delta)}))
        return {"update_norm": norm, "update_rel": norm / theta if theta else float("nan"),
                "update_cos_grad": dot / (norm * gnorm) if norm and gnorm else float("nan")}


def _whole(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _step(r: RunState) -> None:
    """One optimizer step, then the EMA of the trained weights."""
    r.optimizer.step()
    r.policy_version += 1
    if r.ema is not None:
        with torch.no_grad():
            for n, p in r.named:
                r.ema[n].lerp_(p.detach().float(), 1 - r.params.train.ema_decay)


def _check_skips(r: RunState, step: int, skipped: int, consecutive: int) -> int:
    """A non-finite update is skipped; too many in a row stop the run (after its row was logged)."""
    if not skipped:
        return 0
    consecutive += 1
    log.warning("iteration %d: non-finite reward, loss or gradient; update skipped", step)
    if consecutive >= r.params.train.max_consecutive_skips:
        raise TrainingError(
            f"{consecutive} consecutive updates were skipped for non-finite values (iteration {step}); "
            f"check the rewards and lower train.lr. The last good checkpoint is {r.last_ckpt}."
        )
    return consecutive


class _Progress:
    """A progress bar on a terminal; elsewhere (Prefect, DVC, a log file) one log line per iteration."""

    def __init__(self, r: RunState, start: int, progress: bool):
        self.r, self.start, self.t0 = r, start, time.perf_counter()
        self.total = r.params.train.iterations
        self.bar = None
        if progress and r.main:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=start, desc=f"train {r.name}", unit="it", dynamic_ncols=True)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", s_it=f"{metrics['time/iteration']:.1f}")
        elif self.r.main:
            eta = (time.perf_counter() - self.t0) / (step - self.start) * (self.total - step)
            log.info("train %s: iteration %d/%d  reward %.4f  update %.2f s  iteration %.2f s  ETA %d:%02d",
                     self.r.name, step, self.total, metrics["reward/mean"], metrics["time/update"],
                     metrics["time/iteration"], eta // 60, eta % 60)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
