"""The one-command smoke test (`jagg smoke`): a tiny random Flux through the real trainer, every method a few
iterations, under bf16 mixed precision.

What it builds: a FLUX.1-dev-shaped diffusers pipeline with random weights (CLIP + T5 text encoders, a VAE with
Flux's 8× downsampling and 16 latent channels, a ``FluxTransformer2DModel`` with guidance embedding) saved as a
diffusers folder, so the policy loads it through exactly the code path of the released weights; nothing is
downloaded. What it runs: ``train(params, method, seed)`` of a Flux profile (``flux`` by default) with its weights
swapped for that folder, for each method, in a temporary project root.

What it checks and measures, per method:

- the PPO ratio is exactly 1 at the first optimizer step: iteration 1's ``train/approx_kl`` and ``train/clipfrac``
  are exactly 0 (the rollout ran the policy under the update's own autocast; see README, "Under bf16 mixed
  precision ...");
- peak GPU memory over the method's run (``torch.cuda.max_memory_allocated``, reset before each method: weights,
  optimizer state and the update's graphs); on a CPU it is not measured;
- the update stage's time (``time/update``, medians over iterations 2.. on; the first is warm-up) and its speedup
  over the baseline, beside the cost model's ideal from the forwards the trainer counted.

Two sizes: ``gpu`` (256 px, 16 steps, the bench's 36 M-parameter Flux shape) and ``cpu`` (64 px, a one-block
transformer) so that CI runs the same code in seconds. Torch only: no MLflow, no Prefect.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from jagg_core.setup.config import Params

from jagg_core.setup.params_io import load_params
from jagg_core.bench.models import LARGE_GEOMETRY, BenchError

from ..policies.tiny import FluxShape, build_flux
from jagg_core.bench.run import machine_info
from jagg_core.build import pick_device
from jagg_core.pipeline.report import cost_model_speedup
from jagg_core.setup.storage import atomic_write_text, finite_json
from jagg_core.trainer import train
from jagg_core.trainer.checkpoint import Checkpoint
from .wan import WAN_PROFILES, WAN_SIZES, build_tiny_wan, wan_overrides

__all__ = ["SIZES", "SmokeConfig", "SmokeError", "SmokeSize", "build_tiny_flux", "check", "run_smoke",
           "smoke_params", "write_result"]


class SmokeError(BenchError):
    """A smoke-test setting that cannot run; the message is one sentence for the user."""


@dataclass(frozen=True)
class SmokeSize:
    """The tiny model and the rollout it is trained on."""

    resolution: int  # pixels (square); a multiple of 16 (VAE 8× and Flux's 2×2 packing)
    num_steps: int | None  # denoising steps; None: the profile's own
    group_size: int  # images per prompt
    prompts_per_iteration: int
    max_sequence_length: int  # T5 tokens
    num_layers: int  # double-stream blocks
    num_single_layers: int
    num_attention_heads: int
    attention_head_dim: int
    text_hidden_size: int  # T5 width (joint_attention_dim)
    pooled_hidden_size: int  # CLIP width (pooled_projection_dim)
    vae_channels: tuple[int, ...]  # four blocks: 8× downsampling, as Flux's VAE


SIZES: dict[str, SmokeSize] = {
    # The bench's `large` Flux shape (8 heads × 64, 2 double + 4 single blocks, text width 256): ~36 M trained
    # parameters at 256 px (256 image tokens) with the profile's 512 T5 tokens and 16 steps.
    "gpu": SmokeSize(resolution=256, num_steps=None, group_size=4, prompts_per_iteration=2, max_sequence_length=512,
                     num_layers=LARGE_GEOMETRY["num_layers"], num_single_layers=LARGE_GEOMETRY["num_single_layers"],
                     num_attention_heads=LARGE_GEOMETRY["num_attention_heads"],
                     attention_head_dim=LARGE_GEOMETRY["attention_head_dim"],
                     text_hidden_size=LARGE_GEOMETRY["text_hidden_size"], pooled_hidden_size=64,
                     vae_channels=(16, 32, 64, 64)),
    # Seconds on 2 CPU cores: 64 px (16 image tokens), 8 steps, 32 T5 tokens (the tiny T5 spells prompts letter
    # by letter), one block of each kind, 2 heads of 16.
    "cpu": SmokeSize(resolution=64, num_steps=8, group_size=2, prompts_per_iteration=2, max_sequence_length=32,
                     num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=16,
                     text_hidden_size=32, pooled_hidden_size=32, vae_channels=(8, 8, 16, 16)),
}

# The methods of the comparison, in the order of the table; the first is the baseline of the speedups.
DEFAULT_METHODS = ("baseline", "jagg", "ablate", "jagg-reuse")

# What the smoke test sets on top of the profile (a --set of the user's comes after and wins; the values that the
# checks need are validated afterwards). Every group through the method (jagg_frac 1, every group trained): the
# speedups are the method's own, not diluted by exact groups or a random subset, and the ratio check covers every
# group. No fidelity monitor, no images, one checkpoint at the end: the iteration is rollout, reward and update.
SMOKE_OVERRIDES: dict[str, Any] = {
    "jagg.jagg_frac": 1.0,
    "sample.timestep_fraction": 1.0,
    "train.fidelity_every": 0,
    "train.log_images_every": 0,
    "train.checkpoint_every": 1000,
    "train.keep_checkpoints": 1,
    "reward.weights": {"jpeg_compressibility": 1.0},  # no reward weights to download; any image gets a score
    "reward.options": {},
    "resources.num_processes": 1,
    "resources.distributed": "ddp",
    "resources.mixed_precision": "bf16",
    "resources.cuda_visible_devices": {},
    "run.seeds": [0],
}

PROMPTS = ["a photo of a cat", "a red cat", "two blue dogs on green grass", "a yellow bird on a tree",
           "a small house by a lake", "an old car in the rain", "a bowl of fruit on a table", "a man riding a horse"]

# --- the tiny pipeline ------------------------------------------------------------------------------------------


def build_tiny_flux(folder: str | Path, size: SmokeSize, *, seed: int = 0) -> Path:
    """A FLUX.1-dev-shaped pipeline of the smoke test's ``size`` with random weights, saved as a diffusers folder
    (jagg_core/policies/tiny.py): FLUX.1's VAE compression (8×, 16 latent channels) and scheduler."""
    if size.attention_head_dim % 2 or size.attention_head_dim < 8:
        raise SmokeError(f"attention_head_dim {size.attention_head_dim} must be an even number of at least 8.")
    shape = FluxShape(
        num_layers=size.num_layers, num_single_layers=size.num_single_layers,
        num_attention_heads=size.num_attention_heads, attention_head_dim=size.attention_head_dim,
        text_hidden_size=size.text_hidden_size, t5_head_dim=size.text_hidden_size // 2,
        pooled_hidden_size=size.pooled_hidden_size, vae_channels=size.vae_channels, latent_channels=16,
        sample_size=size.resolution)
    return build_flux(folder, shape, seed=seed)


# --- params -----------------------------------------------------------------------------------------------------


@dataclass
class SmokeConfig:
    device: str = "cuda"  # cuda | cpu
    size: str | None = None  # gpu | cpu; None: the device's
    profile: str = "flux"
    methods: tuple[str, ...] = DEFAULT_METHODS
    iterations: int = 4
    resolution: int | None = None  # None: the size's
    num_steps: int | None = None  # None: the size's, else the profile's
    seed: int = 0
    threads: int | None = None  # torch CPU threads (None: torch's default)
    overrides: dict[str, Any] = field(default_factory=dict)  # --set KEY=VALUE, after the smoke test's own

    def resolved_size(self) -> SmokeSize:
        name = self.size or ("gpu" if self.device == "cuda" else "cpu")
        if name not in SIZES:
            raise SmokeError(f"unknown size {name!r}; sizes: {', '.join(SIZES)}.")
        updates = {k: v for k, v in (("resolution", self.resolution), ("num_steps", self.num_steps)) if v is not None}
        if self.profile in WAN_PROFILES:  # the wan case: a tiny Wan (jagg_core/smoke/wan.py)
            return type(WAN_SIZES[name])(**{**asdict(WAN_SIZES[name]), **updates})
        s = SIZES[name]
        return SmokeSize(**{**asdict(s), **updates, "vae_channels": s.vae_channels})

    def validate(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise SmokeError(f"--device {self.device!r} must be cuda or cpu.")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise SmokeError("no CUDA device is visible; run it on a GPU machine, or with --device cpu for the "
                             "reduced CPU size.")
        if self.iterations < 2:
            raise SmokeError(f"--iterations {self.iterations} must be at least 2 (the first one is warm-up).")
        if not self.methods:
            raise SmokeError("--methods names no method.")
        res = self.resolved_size().resolution
        if res < 16 or res % 16:
            raise SmokeError(f"--resolution {res} must be a positive multiple of 16 pixels (VAE 8× and Flux's 2×2 "
                             "packing).")


def smoke_params(cfg: SmokeConfig, model_dir: str | Path, *, params_path: str | Path) -> tuple[Params, dict]:
    """The profile's params with its weights swapped for ``model_dir`` and the smoke test's sizes; returns them and
    the overrides applied (for the record)."""
    real = load_params(params_path, cfg.profile)
    wan = cfg.profile in WAN_PROFILES
    if real.model.backbone != ("wan" if wan else "flux"):
        raise SmokeError(f"the smoke test trains a tiny Flux or Wan; profile {cfg.profile!r} has backbone "
                         f"{real.model.backbone!r} (use flux, flux-fast or wan).")
    size = cfg.resolved_size()
    images = size.group_size * size.prompts_per_iteration
    overrides: dict[str, Any] = {
        "model.path": str(model_dir),
        "model.dtype": "bfloat16",
        "model.options.height": size.resolution,
        "model.options.width": size.resolution,
        "model.options.max_sequence_length": size.max_sequence_length,
        "sample.group_size": size.group_size,
        "sample.prompts_per_iteration": size.prompts_per_iteration,
        "sample.batch_size": min(real.sample.batch_size, images),
        "train.micro_batch": min(real.train.micro_batch, images),
        "train.iterations": cfg.iterations,
        "resources.device": cfg.device,
        **({"sample.num_steps": size.num_steps} if size.num_steps is not None else {}),
        **({"resources.num_threads": cfg.threads} if cfg.threads else {}),
        "run.methods": list(cfg.methods),
        **SMOKE_OVERRIDES,
        **(wan_overrides(size) if wan else {}),
        **cfg.overrides,
    }
    params = load_params(params_path, cfg.profile, overrides)
    if params.train.inner_epochs != 1 or params.train.optimizer_steps_per_epoch != 1:
        raise SmokeError("the ratio check reads iteration 1 as the first optimizer step: train.inner_epochs and "
                         "train.optimizer_steps_per_epoch must be 1.")
    if params.resources.mixed_precision != "bf16" or params.model.dtype != "bfloat16":
        raise SmokeError("the smoke test checks bf16 training: leave resources.mixed_precision (bf16) and "
                         "model.dtype (bfloat16) as they are.")
    if params.train.iterations < 2:
        raise SmokeError("train.iterations must be at least 2 (the first one is warm-up).")
    return params, overrides


# --- the run ----------------------------------------------------------------------------------------------------


def _median(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else None


def _free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _method_row(params: Params, name: str, history: list[dict[str, float]], peak_mb: float | None,
                wall_s: float) -> dict:
    first = history[0]
    timed = history[1:]  # the first iteration is warm-up (allocator, kernels, caches)
    kl, clip = first.get("train/approx_kl", float("nan")), first.get("train/clipfrac", float("nan"))
    counted = {k: sum(h.get(key, 0.0) for h in timed) for k, key in
               (("grad_forwards", "train/grad_forwards"), ("nograd_forwards", "train/nograd_forwards"),
                ("reused", "jagg/reused_velocities"))}
    method = params.method(name)
    return {
        "method": name, "mode": method.mode, "window": method.window, "jagg_frac": method.jagg_frac,
        "reuse_rollout_velocity": method.reuse_rollout_velocity,
        "first_step": {"approx_kl": kl, "clipfrac": clip, "kept_fraction": first.get("train/kept_fraction")},
        "ratio_is_one": kl == 0.0 and clip == 0.0,  # NaN (no update ran) is not 0
        "peak_memory_mb": peak_mb,
        "update_s": _median([h.get("time/update") for h in timed]),
        "backward_s": _median([h.get("time/backward") for h in timed]),
        "iteration_s": _median([h.get("time/iteration") for h in timed]),
        "backward_calls_per_iteration": _median([h.get("train/backward_calls") for h in timed]),
        "ideal_update_speedup": cost_model_speedup(**counted),
        "wall_s": wall_s,
        "history": history,
    }


def run_smoke(cfg: SmokeConfig, *, params_path: str | Path, progress: Callable[[str], None] | None = None) -> dict:
    """Build the tiny Flux, train every method for ``cfg.iterations`` iterations in a temporary project root
    (removed after), and return the result, checks included (:func:`check`).

    Run it in a process of its own (`jagg smoke` is one): the trainer's ``Accelerator`` sets accelerate's
    process-wide state to bf16 mixed precision, and a later ``Accelerator`` with other settings in the same process
    would be refused."""
    cfg.validate()
    say = progress or (lambda _msg: None)
    size = cfg.resolved_size()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    with tempfile.TemporaryDirectory(prefix="jagg-smoke-") as tmp:
        root = Path(tmp)

        wan = cfg.profile in WAN_PROFILES
        model_dir = root / "models" / ("tiny-wan" if wan else "tiny-flux")
        params, overrides = smoke_params(cfg, model_dir, params_path=params_path)  # every setting checked first
        for name in cfg.methods:
            params.method(name)  # an unknown method fails before any work
        device = pick_device(params)
        t0 = time.perf_counter()
        (build_tiny_wan if wan else build_tiny_flux)(model_dir, size, seed=cfg.seed)
        say(f"built a random tiny {'Wan' if wan else 'Flux'} at {size.resolution} px in {time.perf_counter() - t0:.1f} s "
            f"({model_dir})")
        prompts = root / "data" / params.profile / "prompts" / "train.jsonl"
        atomic_write_text(prompts, "".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
        rows, trainable = _train_methods(cfg, params, root, device, say)
    return _result(cfg, params, overrides, device, size, rows, trainable)


def _train_methods(cfg: SmokeConfig, params, root: Path, device: torch.device,  # noqa: ANN001 (Params)
                   say: Callable[[str], None]) -> tuple[list[dict], int | None]:
    """Each method trained in turn from the same tiny model: its row (times, first step, peak memory) and the
    trainable parameter count, with the update and iteration speedups against the first method."""
    rows, trainable = [], None
    for name in cfg.methods:
        _free_cuda()
        before = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device) / 2**20  # ~0: a leak from the last method shows here
        t1 = time.perf_counter()
        result = train(params, name, cfg.seed, root=root, resume=False, progress=False)
        wall = time.perf_counter() - t1
        peak = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) / 2**20
        rows.append(_method_row(params, name, result.history, peak, wall))
        rows[-1]["allocated_before_mb"] = before
        if trainable is None:
            trainable = _trainable_count(result.checkpoint)
        r = rows[-1]
        say(f"{name}: {len(result.history)} iterations in {wall:.1f} s; first step approx_kl "
            f"{r['first_step']['approx_kl']:.3g}, clipfrac {r['first_step']['clipfrac']:.3g}")
        del result
    base = rows[0]
    for r in rows:
        r["update_speedup"] = (base["update_s"] / r["update_s"]) if base["update_s"] and r["update_s"] else None
        r["iteration_speedup"] = ((base["iteration_s"] / r["iteration_s"])
                                  if base["iteration_s"] and r["iteration_s"] else None)
    return rows, trainable


def _result(cfg: SmokeConfig, params, overrides: dict, device: torch.device, size,  # noqa: ANN001
            rows: list[dict], trainable: int | None) -> dict:
    """The smoke test's result: machine, configuration, model, recipe, each method's row and the checks."""
    sample = params.sample
    out = {
        "kind": "jagg-smoke",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "config": {"profile": cfg.profile, "device": str(device), "size": cfg.size or ("gpu" if cfg.device == "cuda"
                   else "cpu"), "iterations": params.train.iterations, "seed": cfg.seed,
                   "methods": list(cfg.methods), "overrides": overrides},
        "model": {"trainable_params": trainable, "resolution": size.resolution,
                  "image_tokens": (size.resolution // 16) ** 2, "text_tokens": size.max_sequence_length,
                  "geometry": asdict(size), "dtype": params.model.dtype,
                  "mixed_precision": params.resources.mixed_precision},
        "recipe": {"recipe": sample.recipe, "num_steps": sample.num_steps, "trained_steps": params.sample.trained_steps,
                   "window": params.jagg.window, "jagg_frac": params.jagg.jagg_frac,
                   "images_per_iteration": sample.group_size * sample.prompts_per_iteration,
                   "micro_batch": params.train.micro_batch, "clip_range": params.train.clip_range,
                   "gradient_checkpointing": bool(params.model.options.get("gradient_checkpointing", False)),
                   "lora_rank": params.model.lora.rank},
        "methods": rows,
    }
    out["checks"] = check(out)
    return out



def _trainable_count(checkpoint: Path | None) -> int | None:
    """Trained parameters, counted from the run's last checkpoint (the policy is gone by then)."""
    if checkpoint is None:
        return None

    return int(sum(t.numel() for t in Checkpoint(checkpoint, 0).tensors().values()))


def check(result: Mapping[str, Any]) -> dict:
    """``{"passed": bool, "failures": [one sentence each]}``: the first ratio is exactly 1 for every method, and
    every method has timed iterations."""
    failures = []
    for r in result["methods"]:
        fs = r["first_step"]
        if not r["ratio_is_one"]:
            if math.isnan(fs["approx_kl"]):
                failures.append(f"{r['method']}: no update ran at iteration 1 (kept fraction {fs['kept_fraction']}): "
                                "every advantage was zero, so the first ratio could not be checked.")
            else:
                failures.append(f"{r['method']}: the PPO ratio is not 1 at the first optimizer step (approx_kl "
                                f"{fs['approx_kl']:.3g}, clipfrac {fs['clipfrac']:.3g}; both must be exactly 0): the "
                                "rollout and the update computed different velocities under bf16.")
        if r["update_s"] is None:
            failures.append(f"{r['method']}: no update time was measured after the warm-up iteration.")
    return {"passed": not failures, "failures": failures}


# --- output -----------------------------------------------------------------------------------------------------


def write_result(result: Mapping[str, Any], path: str | Path) -> Path:
    """The result as JSON, written atomically (a NaN, no value, as null: strict JSON)."""
    path = Path(path)
    atomic_write_text(path, json.dumps(finite_json(result)[0], indent=1, allow_nan=False) + "\n")
    return path
