"""Flow-matching pretraining of the embedded default's `toy-flux` base model on the procedural world.

Rectified flow as in SD3/Flux: ``z = (1 − σ)·x₀ + σ·ε`` with σ from a logit-normal, target ``v = ε − x₀``; the
transformer and the text encoder train together on (caption, image) pairs whose captions are imperfect with
probability ``caption_noise`` (like web alt-text), which leaves a prompt-following but imperfect model — room for RL.
Writes ``models/<profile>/base/`` (diffusers / transformers save formats) atomically, with ``card.json`` and a short
``README.md`` model card.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from ..setup.config import Params
from ..setup.storage import atomic_write_text, replace_dir, temp_dir
from ..policies.toy_flux import ToyFluxPolicy, ToyFluxShape, build_toy_flux, save_toy_flux
from ..world import sample_training_pair, vocabulary
from ..policies.base import PromptEmbeds

__all__ = ["pretrain_toy"]


def _batch(rng: np.random.Generator, n: int, caption_noise: float, size: int, exclude) -> tuple[list[str], torch.Tensor]:
    pairs = [sample_training_pair(rng, caption_noise, size=size, exclude=exclude) for _ in range(n)]
    images = torch.from_numpy(np.stack([img for _, img in pairs])).permute(0, 3, 1, 2).float() / 255.0
    return [c for c, _ in pairs], images  # (B, 3, H, W) in [0, 1]


def pretrain_toy(
    params: Params,
    out_dir: str | os.PathLike,
    *,
    exclude: Iterable[str] = (),
    progress: bool = True,
    report: Callable[[str], None] | None = None,
    report_every_s: float = 15.0,
) -> dict:
    """Pretrain `toy-flux` per ``params.pretrain`` / ``params.world`` and save it to ``out_dir``; returns the card.

    ``progress`` shows a terminal progress bar; otherwise ``report`` (e.g. a Prefect run logger's ``info``) gets a
    line with the step, the loss and the time left every ``report_every_s`` seconds.
    """
    cfg, world = params.pretrain, params.world
    if cfg.batch_size < 2:
        raise ValueError("pretrain.batch_size must be at least 2.")
    out_dir = Path(out_dir)
    exclude = frozenset(exclude)
    transformer, text_encoder, tokenizer, geometry = _build(params)
    policy = ToyFluxPolicy(transformer, text_encoder, tokenizer, geometry, device="cpu", dtype=torch.float32)
    text_encoder.train().requires_grad_(True)
    transformer.train()
    params_ = list(transformer.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params_, lr=cfg.lr, weight_decay=0.01)
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    shown = _Progress(cfg.steps, progress, report, report_every_s)
    losses: list[float] = []
    for step in range(cfg.steps):
        captions, images = _batch(rng, cfg.batch_size, cfg.caption_noise, world.image_size, exclude)
        # caption dropout: the empty prompt learns the unconditional model that guidance pushes away from
        captions = ["" if rng.random() < cfg.caption_dropout else c for c in captions]
        loss = _flow_matching_loss(policy, tokenizer, text_encoder, captions, images, gen, cfg)
        for g in opt.param_groups:
            g["lr"] = _lr_at(cfg, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params_, 1.0)
        opt.step()
        losses.append(loss.item())
        shown.step(step, losses)
    wall = shown.close()
    card = _card(params, losses, wall, transformer, text_encoder, geometry)
    transformer.eval()
    text_encoder.eval()
    _save_atomically(out_dir, transformer, text_encoder, tokenizer, geometry, card)
    return card


def _build(params: Params):
    """The untrained `toy-flux` (transformer, text encoder, tokenizer, geometry) of ``params.pretrain``'s shape."""
    cfg = params.pretrain
    return build_toy_flux(vocabulary(), ToyFluxShape(
        image_size=params.world.image_size,
        patch_size=cfg.patch_size,
        num_layers=cfg.num_layers,
        num_single_layers=cfg.num_single_layers,
        num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim,
        text_hidden_size=cfg.text_hidden_size,
        text_layers=cfg.text_layers,
        max_text_length=cfg.max_text_length,
        prediction=cfg.prediction,
        guidance_scale=cfg.guidance_scale,
        seed=cfg.seed,
    ))


def _lr_at(cfg, step: int) -> float:
    """Linear warmup over ``cfg.warmup`` steps, then cosine decay to 10% of ``cfg.lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _flow_matching_loss(policy, tokenizer, text_encoder, captions, images, gen, cfg) -> torch.Tensor:
    """One batch's rectified-flow loss; draws ε then σ from ``gen`` (in that order: the shipped base's bits)."""
    ids = tokenizer(captions, padding="max_length", max_length=cfg.max_text_length, truncation=True,
                    return_tensors="pt").input_ids
    enc = text_encoder(input_ids=ids)
    x0 = policy.encode_images(images)  # (B, tokens, channels)
    eps = torch.randn(x0.shape, generator=gen)
    # logit-normal sigma as SD3; a positive mean weights the high-noise steps that decide the layout
    sigma = torch.sigmoid(cfg.logit_mean + cfg.logit_std * torch.randn(x0.shape[0], generator=gen))
    z = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * eps
    out = policy.predict(z, sigma * policy.num_train_timesteps, _embeds(enc))
    # x0-prediction is fit in x0 space (the velocity loss weighted by σ², which keeps low noise from dominating)
    return torch.nn.functional.mse_loss(out, x0 if policy.prediction == "x0" else eps - x0)


class _Progress:
    """A terminal progress bar, or a line to ``report`` every ``every_s`` seconds (step, loss, time left)."""

    def __init__(self, steps: int, bar: bool, report: Callable[[str], None] | None, every_s: float):
        self.steps, self.report, self.every_s = steps, report, every_s
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=steps, desc="pretrain toy-flux", unit="step", dynamic_ncols=True)
        self.t_start = self.last = time.perf_counter()

    def step(self, step: int, losses: list[float]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if step % 10 == 0:
                self.bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")
        elif self.report is not None and (time.perf_counter() - self.last > self.every_s or step + 1 == self.steps):
            self.last = time.perf_counter()
            left = (self.last - self.t_start) / (step + 1) * (self.steps - step - 1)
            self.report(f"pretrain toy-flux: step {step + 1}/{self.steps}  loss {np.mean(losses[-50:]):.4f}  "
                        f"time left {int(left) // 60}:{int(left) % 60:02d}")

    def close(self) -> float:
        """Closes the bar; the wall time in seconds since the start."""
        if self.bar is not None:
            self.bar.close()
        return time.perf_counter() - self.t_start


def _card(params: Params, losses: list[float], wall: float, transformer, text_encoder, geometry) -> dict:
    cfg = params.pretrain
    return {
        "backbone": "toy-flux",
        "steps": cfg.steps,
        "batch_size": cfg.batch_size,
        "images_seen": cfg.steps * cfg.batch_size,
        "caption_noise": cfg.caption_noise,
        "seed": cfg.seed,
        "final_loss": float(np.mean(losses[-50:])),
        "first_loss": float(np.mean(losses[:10])),
        "wall_seconds": round(wall, 1),
        "transformer_parameters": sum(p.numel() for p in transformer.parameters()),
        "text_encoder_parameters": sum(p.numel() for p in text_encoder.parameters()),
        "geometry": geometry,
        "pretrain": cfg.model_dump(),
        "world": params.world.model_dump(),
    }


def _embeds(enc):
    return PromptEmbeds({"prompt_embeds": enc.last_hidden_state, "pooled": enc.pooler_output})


def _save_atomically(out_dir: Path, transformer, text_encoder, tokenizer, geometry, card: dict) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(out_dir.parent, f".tmp-{out_dir.name}-")
    try:
        save_toy_flux(tmp, transformer, text_encoder, tokenizer, geometry)
        atomic_write_text(tmp / "card.json", json.dumps(card, indent=2) + "\n")
        atomic_write_text(tmp / "README.md", _card_markdown(card))
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _card_markdown(card: dict) -> str:
    return (
        "# toy-flux base model\n\n"
        f"A tiny diffusers `FluxTransformer2DModel` on packed {card['pretrain']['patch_size']}x"
        f"{card['pretrain']['patch_size']} pixel patches with a tiny CLIP text encoder, "
        "pretrained by rectified flow matching on jagg's procedural shapes world (`jagg_core.world`) with "
        "`jagg pretrain` (the recipe is `card.json`'s `pretrain` and `world`).\n\n"
        f"- steps: {card['steps']} x batch {card['batch_size']} ({card['images_seen']} images), seed {card['seed']}\n"
        f"- imperfect captions: {card['caption_noise']:.0%} of pairs\n"
        f"- flow-matching loss: {card['first_loss']:.4f} at start, {card['final_loss']:.4f} at the end\n"
        f"- parameters: transformer {card['transformer_parameters']:,}, "
        f"text encoder {card['text_encoder_parameters']:,}\n"
        f"- wall time: {card['wall_seconds']} s\n"
    )
