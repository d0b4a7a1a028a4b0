"""Evaluate checkpoints on the test set: ODE samples with fixed seeds per prompt, scored by every configured metric.

For each evaluated step the images are written as ``<eval_dir>/steps/<iteration:06d>/images/<style>/<index:05d>.jpg``
(hpsv2's layout), per-image scores as ``scores.jsonl`` and the summary as ``metrics.json``; the run's top-level
``metrics.json`` holds the last step's summary and the curve over all evaluated steps (step 0 = the base model).
Generation is resumable: a step folder records what generated it (checkpoint digest, sampler, seeds) and images
already there for the same generation are not generated again; scoring likewise: a score whose scorer and image
are unchanged is reused, the rest scored (:mod:`.score_cache`, the step's ``score_cache.json``). A video backbone's samples are clips: each test prompt
gets a clip with the seed its image would get, its chosen frames and frame strip are saved under
``images/<style>/<index:05d>/`` and each metric is the mean over its frames (:mod:`.clips`; not a video benchmark).

Several processes (``accelerate launch``, one per GPU) share the work by blocks of ``eval.batch_size`` images, dealt
round-robin (:class:`Part`): each process generates its blocks into the shared image folder and scores its blocks;
the scores are gathered and rank 0 writes the summaries. Every image is generated and scored in the same batch as in
one process, so N processes give the metrics of one.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ..build import pick_device, policy_from_params
from ..setup.config import Params
from ..setup.json_read import read_json
from ..setup.paths import Layout, held
from ..policies.lora import load_trainable_state_dict
from ..trainer.checkpoint import Checkpoint, list_checkpoints
from ..trainer.distributed import gather_objects
from ..setup.metric_logger import MetricLogger, NullLogger
from ..sampling import derive_seed, sample_images, to_uint8
from ..setup.storage import atomic_write_bytes, atomic_write_text, base_model_digest
from .benchmark import (image_path, load_hps_benchmark, merge_score_parts, score_image_folder, score_records,
                        summarize_scores)
from .clips import clip_complete, clip_frames, save_clip, score_clip_folder
from . import EvalError
from .conventions import evaluation_conventions
from .score_cache import CACHE_NAME, ScoreCache, image_digests, scorer_key, weights_digest
from .protocols import apply_protocol, hpdv2_test_path, load_hpdv2_test
from ..rewards import loaded_rewards, make_metric, rewards_off_device
from ..rewards.base import forget_reward
from ..world import parse_prompt, render, scene_for_prompt, shown_prompt

__all__ = ["EvalError", "Part", "StepOptions", "test_prompts", "evaluate_ground_truth", "evaluate_run", "evaluate_step"]


@dataclass(frozen=True)
class Part:
    """This process's share of an evaluation: block ``k`` (of ``eval.batch_size`` images) is rank ``k % world``'s.

    With ``world > 1`` a ``torch.distributed`` process group must be initialised (``accelerate launch``)."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mine(self, k: int) -> bool:
        return k % self.world == self.rank

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        return gather_objects(obj)


def test_prompts(params: Params, layout: Layout) -> dict[str, list[str]]:
    """The test set of ``eval.protocol`` by prompt group: the benchmark's styles, or the test list as one group
    ``test``; the toy's written by the prepare stage, a real profile's from ``eval.benchmark`` or the HF cache."""
    ev = params.eval
    source = ev.benchmark if ev.benchmark else (layout.held_out if params.is_toy else None)
    if ev.protocol == "hpdv2-test":
        if params.is_toy and not ev.benchmark and not (Path(source) / "test.json").is_file():
            raise EvalError(f"no test list {source}/test.json; run the prepare stage (`jagg prepare`).")
        groups = load_hpdv2_test(source, subset=ev.subset)
        return _toy_grammar(groups, lambda _: hpdv2_test_path(source), params) if params.is_toy else groups
    if params.is_toy:
        styles = sorted(p.stem for p in (Path(source) / "benchmark").glob("*.json")) if Path(source).is_dir() else []
        if not styles:
            raise EvalError(f"no test prompts under {source}/benchmark; run the prepare stage (`jagg prepare`).")
        groups = load_hps_benchmark(source, styles=styles, subset=ev.subset)
        return _toy_grammar(groups, lambda style: Path(source) / "benchmark" / f"{style}.json", params)
    return load_hps_benchmark(source, subset=ev.subset)


def _toy_grammar(groups: dict[str, list[str]], file_of: Callable[[str], Path], params: Params) -> dict[str, list[str]]:
    """On the toy world every test prompt must be one of its grammar (the toy rewards parse it): checked before any
    image is generated, one sentence naming the file a group was read from (``file_of(style)``) and the prompt, shown
    cut (a 10 MB prompt is not echoed)."""
    if not any(name.startswith("toy_") for name in [*params.eval.metrics, *params.reward.weights]):
        return groups

    for style, prompts in groups.items():
        for n, prompt in enumerate(prompts):
            try:
                parse_prompt(prompt)
            except ValueError:
                raise EvalError(f"{file_of(style)}: prompt {n} {shown_prompt(prompt)} is not a prompt of the toy "
                                f"world's grammar; regenerate the test set with `jagg prepare`.") from None
    return groups


def _digest(tensors: Mapping[str, torch.Tensor] | None) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors or {}):
        h.update(k.encode())
        h.update(tensors[k].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _save_jpeg(path: Path, image: torch.Tensor) -> None:
    from PIL import Image

    buf = io.BytesIO()
    # 4:4:4 chroma: the default 4:2:0 averages colour over 2x2 pixels, which bleeds every edge of a 24-pixel toy
    # image into its neighbours (a ground-truth render would score like a blurred one); on a 720-pixel image it
    # changes nothing a scorer sees.
    Image.fromarray(to_uint8(image[None])[0]).save(buf, format="JPEG", quality=95, subsampling=0)
    atomic_write_bytes(path, buf.getvalue())


@dataclass(frozen=True)
class StepOptions:
    """How :func:`evaluate_step` runs, not what it computes: the images and scores are the same whatever these are."""

    # a function that returns the policy to reuse across steps (its weights are replaced), called only when an image
    # is missing (a step whose images are all there loads no model); None: built from params
    policy: Callable[[], Any] | None = None
    progress: bool = False  # a progress bar while scoring
    part: Part = Part()  # this process's share
    curve_subset: int | None = None  # also summarise the first N images per style (the curve's point, ``curve``)


def evaluate_step(
    params: Params,
    layout: Layout,
    out_dir: Path,
    *,
    weights: Mapping[str, torch.Tensor] | None,
    step: int,
    prompts: Mapping[str, Sequence[str]],
    options: StepOptions = StepOptions(),
) -> dict[str, Any]:
    """Generate (what is missing) and score one step's images, or clips for a video backbone (a clip's score is the
    mean over its ``reward.frames``, :mod:`.clips`); returns and writes its summary.

    With ``options.part`` of several processes (a collective: every rank calls it), each generates and scores its
    blocks."""
    ev = params.eval
    policy, progress, part = options.policy, options.progress, options.part
    held(out_dir).mkdir(parents=True, exist_ok=True)
    images_dir = held(out_dir / "images")  # a link leading out of the project: refused before anything is removed
    # Everything the images depend on: the checkpoint, the base model's weights, the model options, the sampler and
    # the prompts. Any change regenerates them. (The model options as masked: a plugin's secret options `***`.)
    generation = {"weights": _digest(weights), "base_model": base_model_digest(layout.base_model, params.model.path),
                  "model": params.masked()["model"], "num_steps": ev.num_steps, "seed": ev.seed,
                  "jpeg": "q95-444",
                  "prompts": hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()[:16]}
    frames = clip_frames(params)  # a video backbone: the frames of each clip that are saved and scored (clips.py)
    if frames is not None:
        generation["frames"] = frames
    marker = out_dir / "generation.json"
    if part.main:
        if (marker.exists() or marker.is_symlink()) and _generation_of(marker) != generation:
            shutil.rmtree(images_dir, ignore_errors=True)  # images of another checkpoint or sampler: start over
        atomic_write_text(marker, json.dumps(generation, indent=2) + "\n")
    part.barrier()

    def done(s: str, i: int) -> bool:
        return image_path(images_dir, s, i).is_file() if frames is None else clip_complete(images_dir, s, i, frames)

    todo = [(s, i) for s, ps in prompts.items() for i in range(len(ps)) if not done(s, i)]
    part.barrier()  # every rank has listed the same missing images before any writes one
    blocks = [todo[k : k + ev.batch_size] for k in range(0, len(todo), ev.batch_size)]
    mine = [b for k, b in enumerate(blocks) if part.mine(k)]
    if mine:
        policy = policy_from_params(params, layout, pick_device(params)) if policy is None else policy()
        if weights is not None:
            load_trainable_state_dict(policy.transformer, weights)
        styles = list(prompts)
        with rewards_off_device(loaded_rewards()):  # the scorers of the last step wait on the CPU meanwhile
            for batch in mine:
                texts = [prompts[s][i] for s, i in batch]
                seeds = [derive_seed(ev.seed, styles.index(s), i) for s, i in batch]  # fixed per (style, prompt)
                images = sample_images(policy, texts, num_steps=ev.num_steps, seeds=seeds, batch_size=ev.batch_size)
                for (s, i), img in zip(batch, images):
                    if frames is None:
                        _save_jpeg(image_path(images_dir, s, i), img)
                    else:  # a clip (F, 3, H, W): its chosen frames and its strip
                        save_clip(images_dir, s, i, img, frames, _save_jpeg)
    part.barrier()  # every image is there

    scores = _score_step(params, images_dir, prompts, frames, progress, part)
    summary = _summary(params, scores)
    result = {"step": step, "metrics": summary}
    if options.curve_subset is not None:  # the learning curve's point: the fixed subset of these same images
        n = options.curve_subset
        result["curve"] = _summary(params, {k: {s: v[:n] for s, v in by_style.items()} for k, by_style in scores.items()})
    if part.main:
        atomic_write_text(out_dir / "scores.jsonl",
                          "".join(json.dumps(r) + "\n" for r in score_records(prompts, scores)))
        atomic_write_text(out_dir / "metrics.json", json.dumps(result, indent=2) + "\n")
    part.barrier()
    return result


def _generation_of(marker: Path) -> Any:
    """What a step's ``generation.json`` says its images were made from; None where it cannot be read (a FIFO there
    hung the evaluation, a file cut short was a JSONDecodeError traceback): images no marker vouches for are made
    again, and the marker is rewritten (replacing what was there)."""
    try:
        return read_json(marker, ValueError, limit=1 << 20)
    except ValueError:  # unreadable, not UTF-8, not JSON (read_regular's sentences are ValueErrors here)
        return None


_BUILT_FROM: dict[tuple[str, str], dict] = {}  # (metric, its options) -> the weights digest it was built from


def _score_step(params: Params, images_dir: Path, prompts: Mapping[str, Sequence[str]], frames: list[int] | None,
                progress: bool, part: Part) -> dict[str, dict[str, Any]]:
    """Every metric of ``eval.metrics`` on one step's images (or clips), this process's share gathered: what the
    step's ``score_cache.json`` holds for the same scorers and images is reused, the rest scored (score_cache.py);
    a scorer with nothing to score is not built."""
    ev = params.eval
    cache = ScoreCache(images_dir.parent / CACHE_NAME, {m: scorer_key(params, m) for m in ev.metrics},
                       image_digests(images_dir, prompts, frames), ev.batch_size)
    needed = functools.cache(cache.needed)
    chunks = [(s, a, min(a + ev.batch_size, len(ps))) for s, ps in prompts.items()
              for a in range(0, len(ps), ev.batch_size)]
    again = {m for c in chunks for m in needed(*c)}  # the same on every rank: the images and the cache are shared
    shares = [cache.reused(prompts, needed)]
    if again:
        for name in again:  # a scorer this process built from other weights (replaced since) is built again
            options = params.reward.options.get(name, {})
            weights = weights_digest(name, options)
            if _BUILT_FROM.setdefault((name, repr(options)), weights) != weights:
                forget_reward(name, options)
                _BUILT_FROM[(name, repr(options))] = weights
        metrics = {name: make_metric(name, **params.reward.options.get(name, {})) for name in ev.metrics
                   if name in again}
        score = score_image_folder if frames is None else functools.partial(score_clip_folder, frames=frames)
        mine = score(images_dir, prompts, metrics, batch_size=ev.batch_size, progress=progress and part.main,
                     part=(part.rank, part.world), needed=needed)
        shares += part.gather(mine) if part.world > 1 else [mine]
    merged = merge_score_parts(shares, prompts)
    # each metric's fields together, in eval.metrics' order (a fresh scoring's): reused or not, the same files
    owner = {f: next(k for k, m in enumerate(ev.metrics) if f == m or f.startswith(m + "/")) for f in merged}
    scores = {f: merged[f] for f in sorted(merged, key=owner.__getitem__)}
    if part.main and again:
        cache.write(scores)
    return scores


def evaluate_ground_truth(params: Params, layout: Layout) -> dict[str, Any]:
    """The toy world's exact renders of the test prompts, scored like a model's samples (saved as the same JPEGs,
    the same metrics and protocol): the ceiling that a method's gain is a share of. Writes
    ``eval/<outputs>/ground-truth/metrics.json``; the placement a prompt leaves open is drawn from the prompt's seed.
    """
    import numpy as np

    if not params.is_toy:
        raise EvalError("ground-truth images exist only in the toy world (a real benchmark has no renderer).")
    ev = params.eval
    prompts = test_prompts(params, layout)
    out_dir = layout.eval_dir("ground-truth")
    images_dir = out_dir / "images"
    styles = list(prompts)
    for s, ps in prompts.items():
        for i, prompt in enumerate(ps):
            rng = np.random.default_rng(derive_seed(ev.seed, styles.index(s), i))
            pixels = render(scene_for_prompt(prompt, rng), params.world.image_size)  # (H, W, 3) uint8
            _save_jpeg(image_path(images_dir, s, i), torch.from_numpy(pixels).permute(2, 0, 1).float() / 255.0)
    scores = _score_step(params, images_dir, prompts, None, False, Part())  # the renders' scores, reused as any
    result = {"run": "ground-truth", "step": 0, "metrics": _summary(params, scores)}
    atomic_write_text(out_dir / "metrics.json", json.dumps(result, indent=2) + "\n")
    return result


def _summary(params: Params, scores: Mapping[str, Any]) -> dict[str, Any]:
    """The summary by ``eval.protocol``; the toy's test list is its benchmark split, so its images give both forms."""
    summary = summarize_scores(scores, block_size=params.eval.block_size)
    return apply_protocol(summary, params.eval.protocol,
                          both_forms=params.is_toy and params.eval.protocol == "hpdv2-benchmark")


def _flat(summary: Mapping[str, Any]) -> dict[str, float]:
    """``eval/<metric>`` (the protocol's headline), ``eval/<metric>/<style>`` and each protocol form's table value,
    ``eval/<metric>/form/<protocol>[-x100]``, for logging."""
    out = {}
    for metric, s in summary.items():
        out[f"eval/{metric}"] = s["benchmark"]
        for style, st in s["styles"].items():
            out[f"eval/{metric}/{style}"] = st["block_mean"]
        for form, values in s.get("forms", {}).items():
            out[f"eval/{metric}/form/{form}"] = values["raw"]
            if "x100" in values:
                out[f"eval/{metric}/form/{form}-x100"] = values["x100"]
    return out


def _curve_subset(prompts: Mapping[str, Sequence[str]], n: int | None) -> int | None:
    """``eval.curve_subset`` where it cuts the split (None where every style has at most N prompts)."""
    return n if n is not None and any(len(ps) > n for ps in prompts.values()) else None


def evaluate_run(
    params: Params,
    layout: Layout,
    run: str,
    *,
    checkpoints: Sequence[Checkpoint] | None = None,
    logger: MetricLogger | None = None,
    progress: bool = False,
    report: Callable[[str], None] | None = None,
    part: Part = Part(),
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Evaluate every retained checkpoint of ``run`` (or the base model for ``run == "base"``) and write
    ``<eval_dir>/metrics.json`` with the last step's summary and the curve over steps.

    With ``eval.curve_subset`` = N the checkpoints before the last are evaluated on the first N prompts per style
    only, and every point of the curve (the last one's too, from the same images) is that fixed subset's summary:
    the curve compares like with like, and the final scores (``metrics``) are the whole split's. MLflow gets the
    curve under ``eval/…`` and, then, the last step's whole-split scores under ``eval/final/…``.

    ``report`` (e.g. a Prefect run logger's ``info``) gets one line per evaluated step. With ``part`` of several
    processes, each generates and scores its share on ``device`` (its own GPU); rank 0 writes and logs.
    """
    clip_frames(params)  # a reward.frames that the clips do not have fails before any model loads
    logger = logger or NullLogger()
    prompts = test_prompts(params, layout)
    eval_dir = layout.eval_dir(run)
    steps = _steps(layout, run, checkpoints, part)
    use_ema = params.train.ema_decay > 0
    n_curve = _curve_subset(prompts, params.eval.curve_subset)
    curve_prompts = {s: ps[:n_curve] for s, ps in prompts.items()} if n_curve else prompts
    curve = []
    built = []  # the policy, loaded by the first step with an image to generate and reused by the next ones

    def policy():  # noqa: ANN202  (a Policy)
        if not built:
            built.append(policy_from_params(params, layout, device or pick_device(params)))
        return built[0]

    for k, (step, ckpt) in enumerate(steps):
        weights = None
        if ckpt is not None:
            weights = ckpt.tensors("ema" if use_ema and ckpt.has("ema") else "trainable")
        last = k == len(steps) - 1
        res = evaluate_step(params, layout, eval_dir / "steps" / f"{step:06d}", weights=weights, step=step,
                            prompts=prompts if last else curve_prompts,
                            options=StepOptions(policy, progress, part, n_curve if last else None))
        flat = _flat(res.get("curve", res["metrics"]))
        if not part.main:
            curve.append({"step": step, **flat})
            continue
        logger.log_metrics(flat, step)
        if "curve" in res:  # the whole split's scores of the last checkpoint, beside the curve's subset
            logger.log_metrics({f"eval/final/{key[len('eval/'):]}": v for key, v in _flat(res["metrics"]).items()},
                               step)
        if report is not None:
            report(f"evaluate {run}: step {step} ({len(curve) + 1}/{len(steps)}): " +
                   ", ".join(f"{m} {s['benchmark']:.4f}" for m, s in res["metrics"].items()))
        curve.append({"step": step, **flat})
    final = {"run": run, "step": steps[-1][0], "metrics": res["metrics"], "curve": curve,
             "curve_prompts_per_style": n_curve,  # None: the curve's points are on the whole split
             "conventions": evaluation_conventions(params),  # what every score depends on (conventions.py)
             "images": str((eval_dir / "steps" / f"{steps[-1][0]:06d}" / "images").relative_to(layout.root))}
    if part.main:
        _write_metrics(params, eval_dir, final)
    return final


def _steps(layout: Layout, run: str, checkpoints: Sequence[Checkpoint] | None,
           part: Part) -> list[tuple[int, Checkpoint | None]]:
    """(iteration, checkpoint) of each step to evaluate: the base model's one step, or the run's checkpoints."""
    if run == "base":
        return [(0, None)]
    if checkpoints is not None:
        found = list(checkpoints)
    else:  # rank 0 verifies them (reads every file once), the others take its list
        found = part.gather(list_checkpoints(layout.checkpoints(run)) if part.main else None)[0]
    if not found:
        raise EvalError(f"run {run} has no complete checkpoint under {layout.checkpoints(run)}; train it first.")
    return [(c.iteration, c) for c in found]


def _write_metrics(params: Params, eval_dir: Path, final: dict[str, Any]) -> None:
    """``metrics.json`` (the summary) and ``curve.json``, the curve as a DVC plot (`dvc plots show`): one row per
    evaluated step; ``main`` is the benchmark score of the first of eval.metrics, the same field name on every
    profile."""
    atomic_write_text(eval_dir / "metrics.json", json.dumps(final, indent=2) + "\n")
    main = params.eval.metrics[0]
    rows = [{"step": p["step"], "main": p[f"eval/{main}"], "main_metric": main,
             **{m: p[f"eval/{m}"] for m in params.eval.metrics}} for p in final["curve"]]
    atomic_write_text(eval_dir / "curve.json", json.dumps(rows, indent=1) + "\n")
