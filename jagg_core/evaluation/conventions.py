"""What every evaluation score depends on, named beside it (MLflow tags of the evaluation, the report's list).

The protocol (protocols.py), each scorer's variant -- model, pretrained weights, the scale of its table value --, the
resolution, the ODE steps, the guidance and the per-prompt seed rule of the test images (evaluate.py).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..setup.registry import backbone_spec, reward_spec

__all__ = ["evaluation_conventions", "scorer_variant", "split_named"]


def split_named(name: str, split: str) -> str:
    """An evaluation's MLflow metric, image key or tag as logged on ``split``: the test split's as named (``eval/…``,
    ``eval``, ``eval.…``), the validation split's under ``eval-validation`` (``eval-validation/toy_fidelity``,
    ``eval-validation.protocol``), as its files are under ``eval-validation/``: a run evaluated on both splits never
    holds the validation scores under the test split's names."""
    if split == "test":
        return name
    if name == "eval" or name.startswith(("eval/", "eval.")):
        return "eval-validation" + name[len("eval"):]
    return name


def scorer_variant(name: str, options: Mapping[str, Any]) -> str:
    """What ``name`` scores with, in one line: model, pretrained weights and the scale of the table value (its spec's
    ``describe``, else the reward's own value)."""
    spec = reward_spec(name)
    return spec.describe(options) if spec.describe else f"{name}; {spec.table_value[2]}"


def evaluation_conventions(params) -> dict[str, str]:  # noqa: ANN001 (a pipeline Params)
    """What every evaluation score depends on, as flat strings (MLflow tags, the report's conventions list)."""
    ev, opts = params.eval, dict(params.model.options)
    if params.is_toy:
        size = params.world.image_size
        resolution, guidance = f"{size}x{size}", opts.get("guidance_scale", params.pretrain.guidance_scale)
    else:
        defaults = backbone_spec(params.model.backbone).defaults
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
        test_set += f"; the toy's {ev.split} split in HPDv2's layouts"
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
