"""What the benchmark runs on: a policy (built-in `toy`/`large`, or a profile's real one), one stored rollout, and the
update stage of one micro-batch exactly as the trainer runs it (``plan_groups`` → ``accumulate_gradients``).

Everything here is rebuilt deterministically from a :class:`ModelSpec` (plain JSON), so the memory probes and the
communication workers, each in its own process, differentiate the same (latents, timesteps, old log-probs).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ..setup.config import Params, ParamsError, ResolvedMethod, SampleConfig, TrainConfig
from ..jagg import Group, plan_groups
from ..policies.base import Policy
from ..trainer.distributed import GradSync, NoSync
from ..trainer.rollout import Trajectory, rollout
from ..trainer.update import UpdateContext, UpdateStats, accumulate_gradients
from ..build import policy_from_params
from ..policies.toy_flux import ToyFluxPolicy, ToyFluxShape, build_toy_flux
from ..setup.params_io import load_params
from ..setup.paths import Layout
from ..world import FAMILIES, sample_prompt, vocabulary

__all__ = [
    "BUILTIN_MODELS",
    "BenchError",
    "ModelSpec",
    "Experience",
    "BENCH_METHODS",
    "bench_method",
    "fits",
    "model_spec",
    "profile_spec",
    "build_policy",
    "make_experience",
    "update_groups",
    "run_update",
    "zero_grads",
]


class BenchError(ParamsError):
    """A benchmark setting that cannot run; the message is one sentence for the user."""


# A Flux-shaped model with tens of millions of parameters: 8 heads × 64 (inner 512), 2 double + 4 single blocks,
# 256 image tokens (64×64 RGB in 4×4 patches: 48 channels) and 64 text tokens of width 256. ~36 M parameters.
LARGE_GEOMETRY: dict[str, int] = {
    "image_size": 64, "patch_size": 4, "num_layers": 2, "num_single_layers": 4, "num_attention_heads": 8,
    "attention_head_dim": 64, "text_hidden_size": 256, "text_layers": 2, "max_text_length": 64,
}
BUILTIN_MODELS = ("toy", "large")


@dataclass(frozen=True)
class ModelSpec:
    """How to rebuild the benchmarked policy in any process (JSON-serialisable)."""

    name: str  # "toy" | "large" | the profile name
    kind: str  # "builtin": random init from `geometry`; "profile": the profile's real policy (policy_from_params)
    device: str
    geometry: dict[str, int] = field(default_factory=dict)  # build_toy_flux keywords (builtin)
    profile: str | None = None
    params_path: str | None = None
    root: str | None = None
    noise_level: float = 0.7  # the rollout SDE (sample.noise_level of the params)
    sde_kind: str = "flow_grpo"
    clip_range: float = 1e-3  # train.clip_range (the PPO step loss)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ModelSpec":
        return cls(**d)


def _rollout_settings(params: Params) -> dict[str, Any]:
    return {"noise_level": params.sample.noise_level, "sde_kind": params.sample.sde_kind,
            "clip_range": params.train.clip_range}


def model_spec(name: str, params: Params, *, device: str) -> ModelSpec:
    """A built-in model: ``toy`` (the embedded default's geometry, read from ``params``' world and pretrain
    sections) or ``large``; random weights."""
    if name == "toy":
        pre = params.pretrain
        geometry = {"image_size": params.world.image_size, "patch_size": pre.patch_size,
                    "num_layers": pre.num_layers, "num_single_layers": pre.num_single_layers,
                    "num_attention_heads": pre.num_attention_heads, "attention_head_dim": pre.attention_head_dim,
                    "text_hidden_size": pre.text_hidden_size, "text_layers": pre.text_layers,
                    "max_text_length": pre.max_text_length}
    elif name == "large":
        geometry = dict(LARGE_GEOMETRY)
    else:
        raise BenchError(f"unknown model {name!r}; built-in models: {', '.join(BUILTIN_MODELS)}.")
    return ModelSpec(name, "builtin", device, geometry=geometry, **_rollout_settings(params))


def profile_spec(params: Params, *, device: str, params_path: str | Path, root: str | Path) -> ModelSpec:
    """The profile's own policy, loaded from its weights by ``policy_from_params`` (e.g. Flux on a GPU)."""
    return ModelSpec(params.profile, "profile", device, profile=params.profile, params_path=str(params_path),
                     root=str(root), **_rollout_settings(params))


def build_policy(spec: ModelSpec) -> Policy:
    """A fresh policy: random weights for the built-ins (speed does not depend on training), real ones for a profile."""
    if spec.kind == "profile":
        params = load_params(spec.params_path, spec.profile)
        return policy_from_params(params, Layout.of(params, Path(spec.root).resolve()),
                                  torch.device(spec.device))

    # Velocity prediction and no CFG: the x0 skip connection would divide random outputs by small sigmas, and CFG
    # would double every batch; neither changes what is compared.
    transformer, text_encoder, tokenizer, geometry = build_toy_flux(
        vocabulary(), ToyFluxShape(**spec.geometry, prediction="velocity", guidance_scale=1.0, seed=0)
    )
    return ToyFluxPolicy(transformer.eval(), text_encoder, tokenizer, geometry, device=spec.device,
                         dtype=torch.float32)


@dataclass
class Experience:
    """One stored rollout and the micro-batch the update differentiates."""

    traj: Trajectory
    advantages: torch.Tensor  # (B,) random, nonzero
    rows: torch.Tensor  # (N,) the micro-batch: image rows 0..N−1
    sample: SampleConfig
    train: TrainConfig

    @property
    def steps(self) -> int:
        return len(self.traj.train_steps)


def make_experience(policy: Policy, spec: ModelSpec, *, steps: int, batch: int, seed: int) -> Experience:
    """A real SDE rollout of ``batch`` images (random world prompts, 2 images each) over ``steps`` steps, with the
    rollout velocities kept (for the reuse variant) and random nonzero advantages."""
    rng = np.random.default_rng(seed)
    n_prompts = math.ceil(batch / 2)
    prompts = [sample_prompt(rng, FAMILIES[i % len(FAMILIES)]) for i in range(n_prompts)]
    sample = SampleConfig(num_steps=steps, noise_level=spec.noise_level, sde_kind=spec.sde_kind, recipe="dance_grpo",
                          group_size=2, prompts_per_iteration=n_prompts, batch_size=batch)
    traj = rollout(policy, prompts, list(range(n_prompts)), sample, seed=seed, iteration=0, keep_velocities=True)
    a = torch.randn(traj.batch_size, generator=torch.Generator().manual_seed(seed))
    advantages = a.sign() * (a.abs() + 0.5)  # |A| ≥ 0.5: every image carries signal
    train = TrainConfig(micro_batch=batch, clip_range=spec.clip_range, beta=0.0)
    return Experience(traj, advantages, torch.arange(batch), sample, train)


# The bench's named ways to run the update, as the trainer's own method settings (``ResolvedMethod``): one vocabulary
# for the trainer, the bench and the report. ``jagg-k<K>`` is K-anchor JAGG (joint); ``exact-batched`` is the
# strongest exact baseline: every step of a group an anchor (K = W), all W in one forward call and one backward.
BENCH_METHODS: dict[str, dict] = {
    "exact": {"mode": "exact"},
    "jagg-joint": {"mode": "jagg"},
    "jagg-sequential": {"mode": "jagg", "variant": "sequential"},
    "ablate": {"mode": "ablate"},
    "jagg-reuse": {"mode": "jagg", "reuse_rollout_velocity": True},
    # the unbiased JAGG: the endpoints and one random anchor per image (docs/frontier.md): what K = 3 costs
    "jagg-unbiased": {"mode": "jagg", "random_anchor": "image"},
}


def _settings(name: str, window: int | None = None) -> dict:
    if name == "exact-batched":
        return {"mode": "jagg", "variant": "joint", "anchors": window or 2, "reuse_rollout_velocity": False}
    if name in BENCH_METHODS:
        return {"variant": "joint", "anchors": 2, "reuse_rollout_velocity": False, **BENCH_METHODS[name]}
    if name.startswith("jagg-k") and name[6:].isdigit() and int(name[6:]) >= 2:
        return {"mode": "jagg", "variant": "joint", "anchors": int(name[6:]), "reuse_rollout_velocity": False}
    raise BenchError(f"unknown variant {name!r}; use one of {', '.join(BENCH_METHODS)}, exact-batched or jagg-k<K>.")


def bench_method(name: str, window: int, jagg_frac: float = 1.0) -> ResolvedMethod:
    """The named method at window ``window`` (every group routed by default; middle velocities recomputed unless the
    name says reuse)."""
    return ResolvedMethod(name=name, window=window, jagg_frac=jagg_frac, **_settings(name, window))


def fits(name: str, window: int) -> bool:
    """False where the named method cannot run at ``window``, or would repeat another's work exactly (W = 2 has no
    middle steps, so ablate and reuse do what jagg-joint does)."""
    s = _settings(name, window)
    if s["mode"] == "exact" or name == "exact-batched":
        return True
    if window == 2 and (s["mode"] == "ablate" or s["reuse_rollout_velocity"] or s.get("random_anchor")):
        return False  # no middle step: nothing to reuse, discard or draw
    return s["anchors"] <= window


def update_groups(exp: Experience, method: ResolvedMethod) -> list[Group]:
    """The trainer's routing of the trained steps (``plan_groups``; every group kept)."""
    return plan_groups(exp.traj.train_steps, method.window, float(method.jagg_frac), mode=method.mode)


def run_update(policy: Policy, exp: Experience, method: ResolvedMethod, groups: list[Group], *,
               sync: GradSync | None = None) -> UpdateStats:
    """Forward + backward of ``groups`` over the micro-batch: the trainer's ``accumulate_gradients``."""
    ctx = UpdateContext(policy, method, exp.sample, exp.train, sync or NoSync(), contextlib.nullcontext)
    return accumulate_gradients(ctx, exp.traj, exp.advantages, exp.rows, groups, reuse=method.reuse_rollout_velocity)


def zero_grads(policy: Policy) -> None:
    """What the trainer does after each optimizer step (``zero_grad(set_to_none=True)``)."""
    for p in policy.trainable_parameters():
        p.grad = None
