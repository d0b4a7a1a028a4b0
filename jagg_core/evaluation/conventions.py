"""What every evaluation score depends on, named beside it (MLflow tags of the evaluation, the report's list).

The protocol (protocols.py), each scorer's variant -- model, pretrained weights, the scale of its table value --, the
resolution, the ODE steps, the guidance and the per-prompt seed rule of the test images (evaluate.py).
"""

from __future__ import annotations

from typing import Any, Mapping

from .protocols import TABLE_SCALES

__all__ = ["evaluation_conventions", "scorer_variant"]


def scorer_variant(name: str, options: Mapping[str, Any]) -> str:
    """What ``name`` scores with, in one line: model, pretrained weights and the scale of the table value."""
    scale = TABLE_SCALES.get(name, (name, 1.0, "the reward's value"))[2]
    if name == "hpsv2.1":
        from ..rewards.hps import HPS_CHECKPOINT, HPS_REPO

        return (f"open_clip {options.get('model_name', 'ViT-H-14')}, pretrained "
                f"{options.get('checkpoint', HPS_REPO)}:{HPS_CHECKPOINT}; {scale} (x100 in hpsv2's leaderboard)")
    if name == "pickscore":
        from ..rewards.pickscore import PICKSCORE_MODEL, PICKSCORE_PROCESSOR

        return (f"{options.get('model', PICKSCORE_MODEL)} with processor "
                f"{options.get('processor', PICKSCORE_PROCESSOR)}; {scale} (the reward itself: score / 26)")
    if name == "clipscore":
        from ..rewards.clipscore import CLIPSCORE_MODEL

        prefix = options.get("prefix", "")
        return (f"{options.get('model', CLIPSCORE_MODEL)}; {scale} of image and prompt"
                f"{f' prefixed {prefix!r}' if prefix else ''} (not 2.5 x CLIP-S)")
    if name == "served":
        from ..rewards.served import shown_address

        return f"the reward server at {shown_address(options.get('url', ''))}; its own scores, as it answers them"
    return f"the toy world's {name}; {scale}"


def evaluation_conventions(params) -> dict[str, str]:  # noqa: ANN001 (a pipeline Params)
    """What every evaluation score depends on, as flat strings (MLflow tags, the report's conventions list)."""
    ev, opts = params.eval, dict(params.model.options)
    if params.is_toy:
        size = params.world.image_size
        resolution, guidance = f"{size}x{size}", opts.get("guidance_scale", params.pretrain.guidance_scale)
    else:
        from importlib import import_module

        defaults = import_module(f"jagg_core.policies.{params.model.backbone}").DEFAULTS
        resolution = f"{opts.get('height', defaults['height'])}x{opts.get('width', defaults['width'])}"
        guidance = opts.get("guidance_scale", defaults["guidance_scale"])
    group = "0" if ev.protocol == "hpdv2-test" else "the style's index in file order"
    if ev.protocol == "hpdv2-test":
        test_set = "test.json, one image per prompt, plain mean"
    else:
        test_set = f"benchmark/<style>.json, average over styles of block means (blocks of {ev.block_size})"
    if not params.is_toy:
        test_set += "; HPDv2"
    else:
        test_set += "; the toy's test split in HPDv2's layouts"
        if ev.protocol == "hpdv2-benchmark":
            test_set += "; its hpdv2-test form: the plain mean of the same images"
    out = {
        "eval.protocol": ev.protocol,
        "eval.test_set": test_set,
        "eval.resolution": resolution,
        "eval.steps": f"{ev.num_steps} (ODE)",
        "eval.guidance": str(guidance),
        "eval.seed_rule": f"image i of a prompt group: derive_seed({ev.seed}, group, i), group = {group}",
    }
    for m in ev.metrics:
        out[f"eval.scorer.{m}"] = scorer_variant(m, params.reward.options.get(m, {}))
    return out
