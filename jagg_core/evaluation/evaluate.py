"""Evaluate checkpoints on the test set: ODE samples with fixed seeds per prompt, scored by every configured metric.

For each evaluated step the images are written as ``<eval_dir>/steps/<iteration:06d>/images/<style>/<index:05d>.jpg``
(hpsv2's layout), per-image scores as ``scores.jsonl`` and the summary as ``metrics.json``; the run's top-level
``metrics.json`` holds the last step's summary and the curve over all evaluated steps (step 0 = the base model).
Generation is resumable: a step folder records what generated it (checkpoint digest, sampler, seeds) and images
already there for the same generation are not generated again.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ..build import pick_device, policy_from_params
from ..config import Params
from ..errors import UserError
from ..paths import Layout
from ..policies.lora import load_trainable_state_dict
from ..trainer.checkpoint import Checkpoint, list_checkpoints
from ..metric_logger import MetricLogger, NullLogger
from ..sampling import derive_seed
from ..storage import atomic_write_bytes, atomic_write_text, base_model_digest
from .benchmark import image_path, load_hps_benchmark, score_image_folder, score_records, summarize_scores

__all__ = ["EvalError", "test_prompts", "evaluate_run", "evaluate_step"]


class EvalError(UserError, RuntimeError):
    """Evaluation cannot run; the message is for the user."""


def test_prompts(params: Params, layout: Layout) -> dict[str, list[str]]:
    """The test set by style: the toy split written by the prepare stage, or the HPSv2.1 benchmark."""
    ev = params.eval
    source = ev.benchmark if ev.benchmark else (layout.prompts if params.is_toy else None)
    if params.is_toy:
        styles = sorted(p.stem for p in (Path(source) / "benchmark").glob("*.json")) if Path(source).is_dir() else []
        if not styles:
            raise EvalError(f"no test prompts under {source}/benchmark; run the prepare stage (`jagg prepare`).")
        return load_hps_benchmark(source, styles=styles, subset=ev.subset)
    return load_hps_benchmark(source, subset=ev.subset)


def _digest(tensors: Mapping[str, torch.Tensor] | None) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors or {}):
        h.update(k.encode())
        h.update(tensors[k].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _save_jpeg(path: Path, image: torch.Tensor) -> None:
    from PIL import Image

    from ..sampling import to_uint8

    buf = io.BytesIO()
    Image.fromarray(to_uint8(image[None])[0]).save(buf, format="JPEG", quality=95)
    atomic_write_bytes(path, buf.getvalue())


def evaluate_step(
    params: Params,
    layout: Layout,
    out_dir: Path,
    *,
    weights: Mapping[str, torch.Tensor] | None,
    step: int,
    prompts: Mapping[str, Sequence[str]],
    policy=None,
    progress: bool = False,
) -> dict[str, Any]:
    """Generate (what is missing) and score one step's images; returns and writes its summary."""
    from ..rewards import make_reward
    from ..sampling import sample_images

    ev = params.eval
    out_dir.mkdir(parents=True, exist_ok=True)
    images_dir = out_dir / "images"
    # Everything the images depend on: the checkpoint, the base model's weights, the model options, the sampler and
    # the prompts. Any change regenerates them.
    generation = {"weights": _digest(weights), "base_model": base_model_digest(layout.base_model, params.model.path),
                  "model": params.model.model_dump(mode="json"), "num_steps": ev.num_steps, "seed": ev.seed,
                  "prompts": hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()[:16]}
    marker = out_dir / "generation.json"
    if marker.exists() and json.loads(marker.read_text()) != generation:
        shutil.rmtree(images_dir, ignore_errors=True)  # images of another checkpoint or sampler: start over
    atomic_write_text(marker, json.dumps(generation, indent=2) + "\n")

    todo = [(s, i) for s_idx, (s, ps) in enumerate(prompts.items()) for i in range(len(ps))
            if not image_path(images_dir, s, i).is_file()]
    if todo:
        if policy is None:
            policy = policy_from_params(params, layout, pick_device(params))
        if weights is not None:
            load_trainable_state_dict(policy.transformer, weights)
        styles = list(prompts)
        for start in range(0, len(todo), ev.batch_size):
            batch = todo[start : start + ev.batch_size]
            texts = [prompts[s][i] for s, i in batch]
            seeds = [derive_seed(ev.seed, styles.index(s), i) for s, i in batch]  # fixed per (style, prompt)
            images = sample_images(policy, texts, num_steps=ev.num_steps, seeds=seeds, batch_size=ev.batch_size)
            for (s, i), img in zip(batch, images):
                _save_jpeg(image_path(images_dir, s, i), img)

    metrics = {name: make_reward(name, **params.reward.options.get(name, {})) for name in ev.metrics}
    scores = score_image_folder(images_dir, prompts, metrics, batch_size=ev.batch_size, progress=progress)
    summary = summarize_scores(scores, block_size=ev.block_size)
    result = {"step": step, "metrics": summary}
    atomic_write_text(out_dir / "scores.jsonl",
                      "".join(json.dumps(r) + "\n" for r in score_records(prompts, scores)))
    atomic_write_text(out_dir / "metrics.json", json.dumps(result, indent=2) + "\n")
    return result


def _flat(summary: Mapping[str, Any]) -> dict[str, float]:
    """``eval/<metric>`` (benchmark protocol) and ``eval/<metric>/<style>`` for logging."""
    out = {}
    for metric, s in summary.items():
        out[f"eval/{metric}"] = s["benchmark"]
        for style, st in s["styles"].items():
            out[f"eval/{metric}/{style}"] = st["block_mean"]
    return out


def evaluate_run(
    params: Params,
    layout: Layout,
    run: str,
    *,
    checkpoints: Sequence[Checkpoint] | None = None,
    logger: MetricLogger | None = None,
    progress: bool = False,
    report: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Evaluate every retained checkpoint of ``run`` (or the base model for ``run == "base"``) and write
    ``<eval_dir>/metrics.json`` with the last step's summary and the curve over steps.

    ``report`` (e.g. a Prefect run logger's ``info``) gets one line per evaluated step.
    """
    logger = logger or NullLogger()
    prompts = test_prompts(params, layout)
    eval_dir = layout.eval_dir(run)
    if run == "base":
        steps = [(0, None)]
    else:
        found = list(checkpoints) if checkpoints is not None else list_checkpoints(layout.checkpoints(run))
        if not found:
            raise EvalError(f"run {run} has no complete checkpoint under {layout.checkpoints(run)}; train it first.")
        use_ema = params.train.ema_decay > 0
        steps = [(c.iteration, c) for c in found]
    curve = []
    policy = None
    for step, ckpt in steps:
        weights = None
        if ckpt is not None:
            name = "ema" if use_ema and (ckpt.path / "ema.safetensors").exists() else "trainable"
            weights = ckpt.tensors(name)
        if policy is None:
            policy = policy_from_params(params, layout, pick_device(params))
        res = evaluate_step(params, layout, eval_dir / "steps" / f"{step:06d}", weights=weights, step=step,
                            prompts=prompts, policy=policy, progress=progress)
        flat = _flat(res["metrics"])
        logger.log_metrics(flat, step)
        if report is not None:
            report(f"evaluate {run}: step {step} ({len(curve) + 1}/{len(steps)}): " +
                   ", ".join(f"{m} {s['benchmark']:.4f}" for m, s in res["metrics"].items()))
        curve.append({"step": step, **flat})
    final = {"run": run, "step": steps[-1][0], "metrics": res["metrics"], "curve": curve,
             "images": str((eval_dir / "steps" / f"{steps[-1][0]:06d}" / "images").relative_to(layout.root))}
    atomic_write_text(eval_dir / "metrics.json", json.dumps(final, indent=2) + "\n")
    # The curve as a DVC plot (`dvc plots show`): one row per evaluated step; `main` is the benchmark score of the
    # first of eval.metrics, the same field name on every profile.
    main = params.eval.metrics[0]
    rows = [{"step": p["step"], "main": p[f"eval/{main}"], "main_metric": main,
             **{m: p[f"eval/{m}"] for m in params.eval.metrics}} for p in curve]
    atomic_write_text(eval_dir / "curve.json", json.dumps(rows, indent=1) + "\n")
    return final
