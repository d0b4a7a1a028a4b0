"""One training run's state between the phases of the recipe: its setup, its resume and its checkpoints.

:func:`setup_run` builds a :class:`RunState` (processes, device, policy, gradient sync, optimizer, EMA, reward,
prompts); :func:`resume_run` loads the latest complete checkpoint written with the same params (or stops with one
sentence naming what changed); :func:`save_run_checkpoint` writes one (sharded under FSDP2). The recipe itself is
:mod:`jagg_core.trainer.loop`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..build import pick_device, policy_from_params, reward_from_params
from ..setup.config import Params, ResolvedMethod
from ..setup.json_read import parse_json
from ..setup.paths import Layout, run_name
from ..setup.redact import flatten
from ..setup.storage import move, read_prompts
from ..policies.lora import load_trainable_state_dict, trainable_state_dict
from ..sampling import derive_seed
from .checkpoint import CheckpointError, latest_checkpoint_together, list_checkpoints, recover_leftovers, save_checkpoint
from .distributed import GradSync, make_grad_sync, shard_transformer
from .errors import TrainingError
from .fingerprint import IGNORED_TRAIN, run_fingerprint
from .sharded import load_sharded_state, save_sharded_checkpoint

if TYPE_CHECKING:  # types only: accelerate is imported where a run starts (setup_run), the others by build.py
    from accelerate import Accelerator

    from ..policies.base import Policy
    from ..rewards.base import RewardFn

__all__ = ["RunState", "resume_run", "save_run_checkpoint", "setup_run"]

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """Everything one training run holds between its phases."""

    params: Params
    method: ResolvedMethod
    name: str  # <method>-s<seed>
    seed: int
    layout: Layout
    accelerator: Accelerator
    policy: Policy
    sync: GradSync
    optimizer: torch.optim.Optimizer
    reward_fn: RewardFn  # the weighted training reward (rewards/weighted.py)
    train_prompts: list[str]
    ckpt_root: Path
    run_key: str
    trainable: list[torch.nn.Parameter]
    named: list[tuple[str, torch.nn.Parameter]]
    ema: dict[str, torch.Tensor] | None
    policy_version: int = 0
    jagg_frac: float | None = None  # the routing's, as the loop resolved it (_route); None before the first iteration
    last_ckpt: Path | None = None
    restart: bool = False  # may start over when the checkpoints were written with other params
    said_no_fidelity: bool = False  # the FSDP warning of _route, once per run
    said_no_signal: bool = False  # the warning that no group's rewards varied, once per run

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    def autocast(self):
        mixed = self.params.resources.mixed_precision != "no"
        return self.accelerator.autocast() if mixed else contextlib.nullcontext()


def setup_run(params: Params, method_name: str, seed: int, root: Path, accelerator: Accelerator | None,
              run_key: str | None) -> RunState:
    """Processes, device, policy (sharded under FSDP), gradient sync, optimizer, EMA, reward and prompts."""
    from accelerate import Accelerator

    method: ResolvedMethod = params.method(method_name)
    layout = Layout.of(params, root)
    res, sample, tcfg = params.resources, params.sample, params.train
    if res.num_threads:
        torch.set_num_threads(res.num_threads)
    if accelerator is None:
        # cpu=True is what makes several CPU processes a real gloo group (else each rank silently trains alone).
        accelerator = Accelerator(cpu=pick_device(params).type == "cpu", mixed_precision=res.mixed_precision)
    world = accelerator.num_processes
    if sample.prompts_per_iteration % world:
        raise TrainingError(
            f"sample.prompts_per_iteration ({sample.prompts_per_iteration}) must be a multiple of the number of "
            f"processes ({world}) so every process holds whole prompt groups."
        )
    torch.manual_seed(derive_seed(seed, accelerator.process_index))

    policy = policy_from_params(params, layout, accelerator.device)
    if tcfg.beta > 0 or tcfg.kl_ref:  # the KL reference is the base model, frozen before any update or resume
        policy.keep_reference()
    if res.distributed == "fsdp" and world > 1:
        # FSDP2 warns at every forward that the transformer returns a view; the trainer never modifies its outputs in
        # place, and tests/test_fsdp.py checks the sharded gradient against the unsharded one.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        shard_transformer(policy.transformer, getattr(plugin, "transformer_cls_names_to_wrap", None))
    sync = make_grad_sync(res.distributed, world, policy.transformer)
    trainable = policy.trainable_parameters()
    if not trainable:
        raise TrainingError("the policy has no trainable parameters; check model.lora.")
    optimizer = torch.optim.AdamW(trainable, lr=tcfg.lr * method.lr_scale, betas=tcfg.adam_betas, eps=tcfg.adam_eps,
                                  weight_decay=tcfg.weight_decay)
    named = [(n, p) for n, p in policy.transformer.named_parameters() if p.requires_grad]
    ema = {n: p.detach().float().clone() for n, p in named} if tcfg.ema_decay > 0 else None
    name = run_name(method_name, seed)
    return RunState(params=params, method=method, name=name, seed=seed, layout=layout, accelerator=accelerator,
                policy=policy, sync=sync, optimizer=optimizer, reward_fn=reward_from_params(params),
                train_prompts=read_prompts(layout.train_prompts), ckpt_root=layout.checkpoints(name),
                run_key=run_key or run_fingerprint(params, layout, method_name, seed), trainable=trainable,
                named=named, ema=ema)


def _changed(old: dict, params: Params, limit: int = 3) -> str:
    """The first few params that differ between a checkpoint's (redacted) params and these, as ``key a → b``."""
    new = flatten(params.redacted())
    was = flatten(old) if isinstance(old, dict) else {}
    neutral = {f"train.{f}" for f in IGNORED_TRAIN}  # how long, how logged, how split: not what a run computes
    diffs = [f"{k} {was.get(k)!r} → {v!r}" for k, v in new.items()
             if k.split(".")[0] not in ("tracking", "resources", "eval", "profile", "outputs") and k not in neutral
             and was.get(k) != v]
    more = f" and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return (", ".join(diffs[:limit]) + more) if diffs else "the base model or the prompts changed"


def resume_run(r: RunState) -> int:
    """Load the latest complete checkpoint of the same configuration; returns the iteration to start from.

    Checkpoints written with other params are moved aside to ``<run>.superseded-<key>``.
    """
    _agree(r)
    if r.main:
        for line in recover_leftovers(r.ckpt_root):
            log.warning("%s: %s", r.name, line)
    r.accelerator.wait_for_everyone()
    ckpt = latest_checkpoint_together(r.ckpt_root)  # every rank verifies its share of the files, all agree
    if ckpt is None and list_checkpoints(r.ckpt_root, check=False):
        raise CheckpointError(
            f"{r.ckpt_root} holds checkpoints but no complete checkpoint (every one is damaged); move the folder "
            f"aside to start over."
        )
    if ckpt is not None and ckpt.state().get("run_key") != r.run_key:
        old = ckpt.state().get("run_key", "unknown")
        if not r.restart:
            raise CheckpointError(
                f"{r.name}: its checkpoints under {r.ckpt_root} were written with other params "
                f"({_changed(ckpt.state().get('params', {}), r.params)}); pass --restart to move them aside and "
                f"start over, or set the params back to resume.")
        if r.main:
            aside = r.ckpt_root.with_name(f"{r.ckpt_root.name}.superseded-{old}")
            log.warning("%s: checkpoints under %s were written with other params; moved to %s, starting over",
                        r.name, r.ckpt_root, aside)
            shutil.rmtree(aside, ignore_errors=True)
            move(r.ckpt_root, aside)
        r.accelerator.wait_for_everyone()
        ckpt = None
    if ckpt is None:
        return 0
    state = ckpt.state()
    if ckpt.sharded:  # each rank reads its own shards, whatever the number of processes that wrote them
        load_sharded_state(ckpt, r.policy.transformer, r.optimizer, r.ema)
    else:
        load_trainable_state_dict(r.policy.transformer, ckpt.tensors())
        _load_optimizer(r.optimizer, r.policy.transformer, ckpt.optimizer_state(), sharded=r.sync.sharded)
        if r.ema is not None and ckpt.has("ema"):
            r.ema = {k: v.float() for k, v in ckpt.tensors("ema").items()}
            if r.sync.sharded:  # a full checkpoint resumed under FSDP2: the EMA sharded like its parameters
                from torch.distributed.tensor import distribute_tensor

                # In the parameters' order on every rank: each distribute_tensor is a collective (and a safetensors
                # file's keys come back in no fixed order).
                r.ema = {k: distribute_tensor(r.ema[k].to(p.device), p.device_mesh, p.placements) for k, p in r.named}
    r.policy_version = int(state["policy_version"])
    frac = state.get("jagg_frac")  # the last reading of jagg_frac 'auto' goes on from here
    r.jagg_frac = None if frac is None else float(frac)
    r.last_ckpt = ckpt.path
    if r.main:
        log.info("resuming %s from %s (iteration %d)", r.name, ckpt.path, int(state["iteration"]))
    return int(state["iteration"])


def _agree(r: RunState) -> None:
    """Every process (on every machine) trains the same params as process 0 and agrees on --restart; a machine whose
    base model files merely differ in their recorded size or time takes process 0's run fingerprint (with a warning).
    Otherwise every process stops with the same sentence (none is left waiting in a collective)."""
    if r.accelerator.num_processes == 1:
        return
    from accelerate.utils import gather_object

    mine = (json.dumps(r.params.redacted(), sort_keys=True), r.restart, r.run_key)
    every = gather_object([mine])
    for rank, (params, restart, _) in enumerate(every):
        if params != every[0][0] or restart != every[0][1]:
            a = flatten(parse_json(every[0][0], TrainingError, "process 0's params"))
            b = flatten(parse_json(params, TrainingError, f"process {rank}'s params"))
            diffs = [f"{k} {a.get(k)!r} → {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            what = ", ".join(diffs[:3]) if diffs else f"--restart {'given' if restart else 'not given'}"
            raise TrainingError(f"process {rank} was started with other settings than process 0 ({what}); start "
                                f"every machine with the same params.yaml, --set options and --restart.")
    if any(key != every[0][2] for _, _, key in every) and r.main:
        log.warning("%s: the base model's files differ between machines (size or modification time); every process "
                    "uses machine 0's run fingerprint — make sure every machine has the same weights", r.name)
    r.run_key = every[0][2]


def _load_optimizer(optimizer, module, state: dict, *, sharded: bool) -> None:
    """A full optimizer state into the optimizer; under FSDP2 (a full checkpoint resumed sharded) each rank keeps its
    shards."""
    if not sharded:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    # optimizer.state_dict() (what an unsharded run saved) numbers the parameters; the sharded loader wants their names.
    names = {id(p): n for n, p in module.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    if all(isinstance(k, int) for k in state["state"]):
        state = {"state": {order[i]: v for i, v in state["state"].items()},
                 "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))


def save_run_checkpoint(r: RunState, iteration: int, metrics: dict[str, float]) -> Path | None:
    """A checkpoint of the trained weights, optimizer, EMA and state (a collective: every rank calls it).

    Sharded training (FSDP2) writes a sharded checkpoint, every rank its own shards; otherwise rank 0 writes the
    (identical on every rank) full state."""
    state = {"run_key": r.run_key, "policy_version": r.policy_version, "jagg_frac": r.jagg_frac,
             "method": r.method.name, "seed": r.seed,
             "metrics": metrics, "params": r.params.redacted()}
    if r.sync.sharded:
        return save_sharded_checkpoint(r.ckpt_root, iteration, module=r.policy.transformer, optimizer=r.optimizer,
                                       state=state, ema=r.ema, keep=r.params.train.keep_checkpoints).path
    path = None
    if r.main:  # every rank holds the same full state: rank 0 writes it
        path = save_checkpoint(r.ckpt_root, iteration, trainable=trainable_state_dict(r.policy.transformer),
                               optimizer=r.optimizer.state_dict(), state=state, ema=r.ema,
                               keep=r.params.train.keep_checkpoints).path
    r.accelerator.wait_for_everyone()
    return path
