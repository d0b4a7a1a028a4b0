"""`jagg plan`: what a run of a profile costs before anyone rents GPUs.

Arithmetic only, no weights loaded: the backbone's published architecture (its spec's ``cost``), the profile's
sampling and training settings, and the trainer's own routing (:func:`jagg_core.jagg.plan_groups`). It gives the
parameters trained, a per-rank memory estimate, the FLOPs of an iteration for exact and JAGG, and the time those FLOPs
take on H100 / H200 at a stated utilisation (:data:`GPUS`, :data:`UTILISATION`), plus the evaluation's cost.

The FLOP model: a forward of one image at one step is ``2·N·S + 4·L·S²·d`` (N transformer parameters, S = image +
text tokens, L attention layers of width d), times 2 under true classifier-free guidance; a video backbone (Wan)
attends to the text by cross-attention: S = latent frames × patches per frame, plus ``4·L·S·S_text·d``; a backward costs
:func:`jagg_core.cost.backward_factor` forwards: 2 for a full fine-tune, 1 with LoRA (no weight gradients of the frozen
base), one more with gradient checkpointing (the recompute). A JAGG group of W steps costs K with-grad forwards and backwards plus
W − K no-grad forwards (none with rollout-velocity reuse); an exact group W of each. The frozen reference's no-grad
forwards are counted as the trainer makes them (at β > 0 one per trained step, in the update; at β = 0 the
``train/kl_ref`` diagnostic's, every ``train.kl_ref_every`` iterations), and so is the fidelity monitor, both amortised
over the run (:func:`forward_counts`; ``tests/test_forward_counts.py`` checks them against a traced run's calls).
Everything else (the reward, the optimizer step, communication) is left out and named as such: the figures are a
floor for the GPU time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..setup.config import Params, ParamsError, ResolvedMethod
from ..setup.registry import CostFacts as Architecture, backbone_names, backbone_spec
from ..cost import backward_factor, group_forwards
from ..jagg import AUTO_FALLBACK_JAGG_FRAC, plan_groups

__all__ = ["GPUS", "UTILISATION", "PAPER", "forward_counts", "forward_flops", "format_plan", "implied_utilisation",
           "plan"]


# Dense bf16 peak (NVIDIA's datasheets, SXM parts, without sparsity) and memory.
GPUS: dict[str, dict[str, float]] = {
    "H100": {"peak_tflops": 989.0, "memory_gb": 80.0},
    "H200": {"peak_tflops": 989.0, "memory_gb": 141.0},
}
UTILISATION = 0.35  # model FLOPs utilisation assumed for the time columns (see docs/scaling.md for the paper's)

# The paper's own wall-clock figures on 8 GPUs (arXiv:2607.17572, Efficiency Analysis): seconds per update stage and
# per iteration, baseline → JAGG.
PAPER: dict[str, dict[str, tuple[float, float]]] = {
    "flux-fast": {"update": (144.0, 101.0), "iteration": (316.0, 272.0)},
    "qwenimage": {"update": (393.0, 275.0), "iteration": (674.0, 556.0)},
}


def _bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def sequence_tokens(arch: Architecture, height: int, width: int, frames: int = 1) -> int:
    """The transformer's sequence: image (or clip) tokens, plus the text where it is in the joint sequence."""
    latent_frames = (frames - 1) // arch.frames_per_latent + 1 if arch.frames_per_latent else 1
    s = latent_frames * (height // arch.pixels_per_token) * (width // arch.pixels_per_token)
    return s if arch.cross_attention else s + arch.text_tokens


def forward_flops(arch: Architecture, height: int, width: int, cfg: int, frames: int = 1) -> float:
    """FLOPs of one transformer forward of one image (or clip of ``frames`` frames) at one step (both CFG halves)."""
    s = sequence_tokens(arch, height, width, frames)
    cross = 4 * arch.layers * s * arch.text_tokens * arch.hidden if arch.cross_attention else 0.0
    return cfg * (2 * arch.params * s + 4 * arch.layers * s * s * arch.hidden + cross)


def _lora_params(arch: Architecture, rank: int) -> float:
    """LoRA on the attention projections (q, k, v, out of both streams): 8 d×d matrices per block."""
    return arch.layers * 8 * rank * 2 * arch.hidden


def forward_counts(params: Params, method: ResolvedMethod) -> dict[str, float]:
    """The transformer forwards of one iteration, per image of the iteration (all processes'), as the trainer runs
    them: expected over DanceGRPO's random choice of groups, and amortised over ``train.iterations`` for what runs
    every N iterations. Every image is assumed trained (the trainer skips groups whose advantages are all 0).

    - ``rollout``: the sampler's forwards (one per step).
    - ``grad`` / ``nograd``: the update's policy forwards with a graph (a backward each) and without one (JAGG's middle
      steps), per pass (``train.inner_epochs``), from the trainer's own routing (:func:`jagg_core.jagg.plan_groups`).
    - ``reference``: at β > 0, the loss's KL: one no-grad forward of the frozen reference per trained step, every
      iteration (inside the update's time).
    - ``kl_ref``: at β = 0 with ``train.kl_ref``, the ``train/kl_ref`` diagnostic: one reference forward at each
      group's two endpoint steps, every ``train.kl_ref_every`` iterations (and the first).
    - ``monitor_grad`` / ``monitor_nograd`` / ``monitor_reference``: the fidelity monitor (every
      ``train.fidelity_every`` iterations and, under ``jagg_frac: auto``, when it re-estimates): on
      ``train.fidelity_batch`` images per process, the exact, JAGG and ablate gradients of every full group of the
      trajectory (W + 2K graphs and 2(W − K) no-grad forwards; at β > 0 3W reference forwards); not run when the
      parameters are sharded (FSDP on more than one GPU).
    """
    sample, train, res = params.sample, params.train, params.resources
    trained = sample.trained_steps
    frac = AUTO_FALLBACK_JAGG_FRAC if method.jagg_frac == "auto" else float(method.jagg_frac)
    groups = plan_groups(trained, method.window, frac, mode=method.mode)
    keep = max(1, round(sample.group_fraction * len(groups))) / len(groups)
    grad = nograd = reference = kl_ref = 0.0
    for g in groups:
        k, n = group_forwards(len(g.steps), g.mode, anchors=method.anchor_count, reuse=method.reuse_rollout_velocity,
                              random_anchor=method.random_anchor is not None)
        grad, nograd = grad + k, nograd + n
        reference += len(g.steps) if train.beta > 0 else 0
        kl_ref += min(2, len(g.steps)) if train.beta == 0 and train.kl_ref else 0
    passes = keep * train.inner_epochs
    iterations = range(train.iterations)
    kl_share = sum(it % train.kl_ref_every == 0 for it in iterations) / train.iterations

    # The fidelity monitor: the iterations it runs at, and its forwards per run on its images.
    world = res.num_processes * res.num_machines
    auto = method.jagg_frac == "auto"
    runs = 0 if res.distributed == "fsdp" and world > 1 else sum(
        (train.fidelity_every and it % train.fidelity_every == 0)
        or (auto and (it == 0 or (method.auto_every and it % method.auto_every == 0))) for it in iterations)
    full = [g for g in plan_groups(trained, method.window, 1.0, mode="jagg") if len(g.steps) == method.window]
    w, k = method.window, min(method.anchors, method.window)
    images = sample.prompts_per_iteration * sample.group_size
    per_image = min(train.fidelity_batch, images // world) * world / images * runs / train.iterations
    return {"rollout": float(sample.num_steps), "grad": grad * passes, "nograd": nograd * passes,
            "reference": reference * passes, "kl_ref": kl_ref * passes * kl_share,
            "monitor_grad": len(full) * (w + 2 * k) * per_image, "monitor_nograd": len(full) * 2 * (w - k) * per_image,
            "monitor_reference": len(full) * 3 * w * per_image if train.beta > 0 else 0.0,
            "monitor_runs": float(runs), "kl_ref_runs": kl_share * train.iterations}


def plan(params: Params, *, methods: tuple[str, ...] | None = None, utilisation: float = UTILISATION,
         given: str = "", eval_prompts: int | None = None) -> dict[str, Any]:
    """The whole estimate as a dict (see the module docstring). ``given``: the arguments the plan was asked with
    beyond the profile (``--params FILE``, ``--set K=V``, shell-quoted), repeated in the commands it prints so that
    they run what was planned; ``eval_prompts``: the test set's prompts as read (else the protocol's published
    size)."""
    backbone = params.model.backbone
    spec = backbone_spec(backbone)
    arch = spec.cost
    if arch is None:
        planned = [b for b in backbone_names() if backbone_spec(b).cost is not None]
        raise ParamsError(f"jagg plan needs a real backbone ({', '.join(planned)}); profile {params.profile!r} "
                          f"uses {backbone!r}, which runs on a laptop in minutes.")
    arch = _with_text(arch, {**spec.defaults, **params.model.options})
    shape = _Shape.of(params, arch)
    sample, train, res = params.sample, params.train, params.resources
    n_gpus = res.num_processes * res.num_machines
    f = forward_flops(arch, shape.height, shape.width, shape.cfg, shape.frames)
    images = sample.prompts_per_iteration * sample.group_size
    memory, state = _memory(params, arch, shape, n_gpus)
    b, why = backward_factor(lora=bool(state["rank"]), checkpointing=shape.ckpt)
    rows = _method_rows(params, methods or tuple(params.run.methods), f=f, b=b * f,
                        images=images, state=state, n_gpus=n_gpus, utilisation=utilisation)
    return {
        "profile": params.profile, "architecture": arch.name, "architecture_source": arch.source,
        "gpus": n_gpus, "utilisation": utilisation, "height": shape.height, "width": shape.width,
        "frames": shape.frames, "cfg_forwards": shape.cfg,
        "gradient_checkpointing": shape.ckpt, "backward_forwards": b, "backward_why": why, "tokens": shape.tokens, "trainable_params": state["trainable"],
        "lora_rank": state["rank"], "images_per_iteration": images, "num_steps": sample.num_steps,
        "iterations": train.iterations, "forward_tflop_per_image_step": f / 1e12, "memory": memory, "methods": rows,
        "evaluation": _evaluation(params, f, n_gpus, utilisation, eval_prompts), "paper": PAPER.get(params.profile),
        "notes": _forward_notes(params, rows, n_gpus),
        "commands": [f"jagg run --profile {params.profile}{given}",
                     f"jagg train --profile {params.profile}{given} --method <method> --seed 0   # one run",
                     f"jagg train --profile {params.profile}{given} --method <method> --seed 0 --machine-rank <r> "
                     f"--main-process-ip <machine 0>   # one run on resources.num_machines machines (each its r)"],
    }


def _forward_notes(params: Params, rows: list[dict[str, Any]], n_gpus: int) -> list[str]:
    """The footnote: what the forward columns count, and when the reference and the fidelity monitor run."""
    train, res = params.train, params.resources
    first = rows[0]["forwards"] if rows else {}
    n = train.iterations
    if train.beta > 0:
        ref = f"β = {train.beta:g}: the loss's KL, one per trained step, every iteration (in the update)"
    elif train.kl_ref:
        ref = (f"β = 0: train/kl_ref's diagnostic, one at each group's two endpoint steps at "
               f"{first.get('kl_ref_runs', 0):.0f} of {n} iterations ({_cadence(train.kl_ref_every)}), "
               "amortised (in diag)")
    else:
        ref = "none (β = 0, train.kl_ref off)"
    runs = first.get("monitor_runs", 0)
    if runs:
        monitor = (f"{train.fidelity_batch} images per process, the exact, JAGG and ablate gradients of every full "
                   f"group, at {runs:.0f} of {n} iterations")
    elif res.distributed == "fsdp" and n_gpus > 1:
        monitor = f"not run under FSDP on {n_gpus} GPUs"
    else:
        monitor = "off (train.fidelity_every 0)"
    return ["grad fwd / nograd: the policy's forwards per image with a graph (a backward each) / without one "
            "(JAGG's middle steps)",
            "ref fwd: the frozen reference's no-grad forwards per image; " + ref,
            "diag PFLOP: beside the update, amortised over the run: the train/kl_ref diagnostic and the fidelity "
            f"monitor ({monitor})"]


def _with_text(arch: Architecture, opts: dict[str, Any]) -> Architecture:
    """``arch`` with the text tokens the policy encodes: padded to ``max_sequence_length`` (the profile's, else the
    policy's default) plus a fixed part, or an unpadded prompt's length at most that (it counted 512 T5 tokens
    whatever max_sequence_length said)."""
    length = opts.get("max_sequence_length")
    if length is None:
        return arch
    text = arch.text_fixed + int(length) if arch.text_fixed is not None else min(arch.text_tokens, int(length))
    return dataclasses.replace(arch, text_tokens=text)


@dataclass(frozen=True)
class _Shape:
    """What one forward sees: pixels, frames, CFG forwards, gradient checkpointing and the sequence length."""

    height: int
    width: int
    frames: int
    cfg: int
    ckpt: bool
    tokens: int

    @classmethod
    def of(cls, params: Params, arch: Architecture) -> "_Shape":
        opts = params.model.options
        height, width = int(opts.get("height", 512)), int(opts.get("width", 512))
        guidance = float(opts.get("guidance_scale", 1.0))
        cfg = 2 if arch.true_cfg and guidance > 1 else 1
        frames = int(opts.get("num_frames", 81)) if arch.frames_per_latent else 1
        return cls(height, width, frames, cfg, bool(opts.get("gradient_checkpointing", False)),
                   sequence_tokens(arch, height, width, frames))


def _memory(params: Params, arch: Architecture, shape: _Shape, n_gpus: int) -> tuple[dict[str, float], dict]:
    """Memory per rank in GB (FSDP shards weights, gradients and AdamW state; DDP keeps all on every rank), and the
    byte counts the methods' peaks add their graphs to."""
    res = params.resources
    rank = int(params.model.lora.rank or 0)
    trainable = _lora_params(arch, rank) if rank else arch.params
    nbytes = _bytes(params.model.dtype)
    shard = n_gpus if res.distributed == "fsdp" else 1
    micro = params.train.micro_batch * shape.cfg
    tokens = shape.tokens
    # Activations of one graph: with checkpointing each block keeps its input (S·d) and one block is live; without,
    # Megatron's ~34·S·d bytes per layer at 16 bits (attention scores not materialised: fused attention).
    per_graph = (arch.layers * tokens * arch.hidden * nbytes + 34 * tokens * arch.hidden) * micro if shape.ckpt else (
        34 * tokens * arch.hidden * arch.layers * micro)
    weights = arch.params * nbytes / shard
    lora_state = trainable * 4 * 4 if rank else 0.0  # LoRA adapters float32: weights, grads, 2 AdamW moments
    full_state = 0.0 if rank else trainable * nbytes * 3 / shard  # grads + 2 AdamW moments in the dtype
    frozen = arch.frozen_params * nbytes
    memory = {"transformer_weights_gb": weights / 1e9, "trainable_state_gb": (lora_state + full_state) / 1e9,
              "frozen_encoders_gb": frozen / 1e9, "activations_per_graph_gb": per_graph / 1e9}
    return memory, {"rank": rank, "trainable": trainable, "fixed": weights + lora_state + full_state + frozen,
                    "per_graph": per_graph}


def _method_rows(params: Params, names: tuple[str, ...], *, f: float, b: float, images: int, state: dict,
                 n_gpus: int, utilisation: float) -> list[dict[str, Any]]:
    """One row per method: forwards per image, PFLOPs, peak memory, seconds and hours per GPU kind, speedups over the
    first exact method."""
    rollout = images * params.sample.num_steps * f
    rows = []
    base = None
    for name in names:
        m = params.method(name)
        units = forward_counts(params, m)
        # The update: the policy's forwards and backwards, and at β > 0 the loss's reference forwards.
        update = images * (units["grad"] * (f + b) + (units["nograd"] + units["reference"]) * f)
        # Beside it, amortised: the train/kl_ref diagnostic (β = 0) and the fidelity monitor.
        diagnostics = images * ((units["kl_ref"] + units["monitor_nograd"] + units["monitor_reference"]) * f
                                + units["monitor_grad"] * (f + b))
        graphs = (m.window if m.mode == "exact_batched"  # every step's graph alive at once
                  else 1 if m.mode == "exact" else 2 if m.variant == "sequential" and m.random_anchor
                  else 1 if m.variant == "sequential"
                  else m.anchor_count + (1 if m.random_anchor and m.mode == "jagg" else 0))
        row = {"method": name, "mode": m.mode, "variant": m.variant, "window": m.window, "jagg_frac": m.jagg_frac,
               "grad_forwards_per_image": units["grad"], "nograd_forwards_per_image": units["nograd"],
               "reference_forwards_per_image": units["reference"] + units["kl_ref"], "forwards": units,
               "rollout_pflop": rollout / 1e15, "update_pflop": update / 1e15,
               "diagnostics_pflop": diagnostics / 1e15, "iteration_pflop": (rollout + update + diagnostics) / 1e15,
               "peak_gb_per_rank": (state["fixed"] + graphs * state["per_graph"]) / 1e9}
        for gpu, spec in GPUS.items():
            rate = n_gpus * spec["peak_tflops"] * 1e12 * utilisation
            row[f"{gpu}_update_s"] = update / rate
            row[f"{gpu}_iteration_s"] = (rollout + update + diagnostics) / rate
            row[f"{gpu}_run_h"] = (rollout + update + diagnostics) / rate * params.train.iterations / 3600
        if m.mode == "exact" and base is None:
            base = row
        rows.append(row)
    for row in rows:
        if base:
            row["update_speedup"] = base["update_pflop"] / row["update_pflop"]
            row["iteration_speedup"] = base["iteration_pflop"] / row["iteration_pflop"]
    return rows


# The test sets' published sizes (jagg_core/evaluation/protocols.py): groups × prompts per group.
PUBLISHED_EVAL = {"hpdv2-benchmark": (4, 800), "hpdv2-test": (1, 400)}


def _evaluation(params: Params, f: float, n_gpus: int, utilisation: float,
                prompts: int | None = None) -> dict[str, Any]:
    """The test set's prompts (as read, else the protocol's published size, eval.subset applied) at eval.num_steps,
    per checkpoint evaluated: one image each."""
    if prompts is not None:
        eval_images, source = prompts, "as read"
    else:
        groups, per = PUBLISHED_EVAL[params.eval.protocol]
        eval_images = groups * min(per, params.eval.subset or per)
        source = "published size, not read here"
    eval_flops = eval_images * params.eval.num_steps * f
    evaluation = {"images": eval_images, "images_source": source, "steps": params.eval.num_steps,
                  "pflop": eval_flops / 1e15}
    for gpu, spec in GPUS.items():
        evaluation[f"{gpu}_s"] = eval_flops / (n_gpus * spec["peak_tflops"] * 1e12 * utilisation)
    return evaluation


def _fmt(x: float, digits: int = 2) -> str:
    return f"{x:,.{digits}f}"


def format_plan(p: dict[str, Any]) -> str:
    """The plan as the text `jagg plan` prints."""
    mem = p["memory"]
    lines = [
        f"jagg plan — profile {p['profile']}: {p['architecture']} at {p['height']}×{p['width']}"
        f"{' × ' + str(p['frames']) + ' frames' if p.get('frames', 1) > 1 else ''} "
        f"({p['tokens']} tokens, {'CFG: 2 forwards per step' if p['cfg_forwards'] == 2 else 'no CFG'}), "
        f"{p['gpus']} GPU(s)",
        f"  architecture: {p['architecture_source']}",
        f"  trained: {p['trainable_params'] / 1e9:.3g} B parameters "
        f"({'LoRA rank ' + str(p['lora_rank']) if p['lora_rank'] else 'full fine-tune'}); "
        f"{p['images_per_iteration']} images × {p['num_steps']} steps per iteration, {p['iterations']} iterations",
        f"  forward of one image at one step: {p['forward_tflop_per_image_step']:.1f} TFLOP; backward = "
        f"{p['backward_forwards']:g} forward{'s' if p['backward_forwards'] != 1 else ''} ({p['backward_why']})",
        f"  memory per rank (estimate): transformer {mem['transformer_weights_gb']:.1f} GB + trainable state "
        f"{mem['trainable_state_gb']:.1f} GB + frozen encoders {mem['frozen_encoders_gb']:.1f} GB + "
        f"{mem['activations_per_graph_gb']:.1f} GB of activations per live graph",
        "",
        f"  {'method':<16}{'grad fwd/img':>13}{'nograd/img':>11}{'ref fwd/img':>12}{'update PFLOP':>13}"
        f"{'diag PFLOP':>11}{'iter PFLOP':>11}"
        f"{'peak GB/rank':>13}{'H100 upd s':>11}{'H100 it s':>10}{'H200 it s':>10}{'H100 run h':>11}"
        f"{'update ×':>9}{'iter ×':>8}",
    ]
    for r in p["methods"]:
        lines.append(
            f"  {r['method']:<16}{r['grad_forwards_per_image']:>13.2f}{r['nograd_forwards_per_image']:>11.2f}"
            f"{r['reference_forwards_per_image']:>12.2f}{r['update_pflop']:>13.1f}{r['diagnostics_pflop']:>11.1f}"
            f"{r['iteration_pflop']:>11.1f}{r['peak_gb_per_rank']:>13.1f}"
            f"{r['H100_update_s']:>11.1f}{r['H100_iteration_s']:>10.1f}{r['H200_iteration_s']:>10.1f}"
            f"{r['H100_run_h']:>11.1f}{r.get('update_speedup', 1.0):>8.2f}×{r.get('iteration_speedup', 1.0):>7.2f}×")
    ev = p["evaluation"]
    lines += [
        "",
        f"  evaluation per checkpoint: {ev['images']:,} test prompts' {'images' if p.get('frames', 1) == 1 else 'clips'}"
        f"{' (' + ev['images_source'] + ')' if ev.get('images_source') else ''} × "
        f"{ev['steps']} steps = {ev['pflop']:.0f} PFLOP, {ev['H100_s'] / 60:.1f} min on {p['gpus']} H100"
        + ("" if p.get("frames", 1) == 1 else " (scored as frame-averaged image scores, docs/video.md)"),
        f"  times assume {p['utilisation']:.0%} of the dense bf16 peak ({GPUS['H100']['peak_tflops']:.0f} TFLOPS per "
        "GPU) and leave out the reward, the optimizer step and communication: a floor.",
        *(f"  {note}" for note in p.get("notes", [])),
    ]
    if p["paper"]:
        pu, pi = p["paper"]["update"], p["paper"]["iteration"]
        jagg = next((r for r in p["methods"] if r["mode"] == "jagg"), None)
        if jagg:
            lines.append(f"  the paper (8 GPUs): update {pu[0]:.0f} → {pu[1]:.0f} s ({pu[0] / pu[1]:.2f}×), iteration "
                         f"{pi[0]:.0f} → {pi[1]:.0f} s ({pi[0] / pi[1]:.2f}×); this model: update "
                         f"{jagg['update_speedup']:.2f}×, iteration {jagg['iteration_speedup']:.2f}×")
    lines += ["", "  run it:"] + [f"    {c}" for c in p["commands"]]
    return "\n".join(lines)


def implied_utilisation(p: dict[str, Any], seconds: float, what: str = "iteration") -> float:
    """The utilisation at which this plan's exact iteration (or update) takes ``seconds`` on H100s."""
    base = next(r for r in p["methods"] if r["mode"] == "exact")
    flop = base[f"{what}_pflop"] * 1e15
    return flop / (seconds * p["gpus"] * GPUS["H100"]["peak_tflops"] * 1e12)


def _cadence(every: int) -> str:
    """Which iterations a diagnostic measured every ``every`` runs at: the first, then every ``every``-th after it."""
    return "every one" if every == 1 else f"iterations 1, {1 + every}, {1 + 2 * every}, …"
