"""Evaluation reuses generated test images only for the same checkpoint, base model, model options, sampler and
prompts: anything else regenerates them (a reused image of another setting would report a wrong metric)."""

from __future__ import annotations

import shutil

import pytest
import torch


def _generate(root, prompts, **overrides):
    from jagg_core.config import load_params
    from jagg_core.evaluation.evaluate import evaluate_step
    from jagg_core.paths import Layout

    params = load_params(root / "params.yaml", "ci", overrides or None)
    out = root / "eval-step"
    evaluate_step(params, Layout(root, "ci"), out, weights=None, step=0, prompts=prompts)
    return {p.relative_to(out): p.stat().st_mtime_ns for p in sorted((out / "images").rglob("*.jpg"))}


@pytest.fixture
def project(ci_base, tmp_path):
    root = tmp_path / "p"
    shutil.copytree(ci_base, root)
    return root


def test_images_are_reused_only_for_the_same_generation(project):
    from safetensors.torch import load_file, save_file

    prompts = {"anime": ["a small red circle"], "photo": ["a purple square at the bottom left"]}
    first = _generate(project, prompts)
    assert len(first) == 2
    assert _generate(project, prompts) == first  # same everything: reused, not rewritten

    other = {"anime": ["a small purple cross"], "photo": ["a purple square at the bottom left"]}
    assert set(_generate(project, other).values()).isdisjoint(first.values())  # new prompts: all regenerated

    again = _generate(project, prompts)
    fewer = _generate(project, prompts, **{"eval.num_steps": 3})  # another sampler: regenerated ...
    assert fewer.keys() == again.keys() and set(fewer.values()).isdisjoint(again.values())
    assert _generate(project, prompts, **{"eval.num_steps": 3}) == fewer  # ... and then reused

    # A retrained (here: perturbed) base model: the same prompts and options, other weights → regenerated.
    before = _generate(project, prompts)
    weights = next((project / "models/ci/base/transformer").glob("*.safetensors"))
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 0.01 * torch.ones_like(tensors[name])
    save_file(tensors, weights)
    assert set(_generate(project, prompts).values()).isdisjoint(before.values())
