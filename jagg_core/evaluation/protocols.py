"""The evaluation protocols of this literature as named choices (``eval.protocol``), and the scorers' conventions.

Two HPSv2.1 test sets of HPDv2 (Hugging Face dataset ``zhwang/HPDv2``, mirrored as ``ymhao/HPDv2``; the layout of
github.com/tgxs002/HPSv2's README and ``hpsv2/evaluation.py``), each with its own summary:

- ``hpdv2-benchmark``: ``benchmark/{anime,concept-art,paintings,photo}.json`` (JSON lists of 800 prompt strings),
  images ``<style>/<index:05d>.jpg``; per style the mean of consecutive blocks of ``eval.block_size`` (hpsv2: 80)
  image scores, the headline is the average over styles of those block means (benchmark.py) -- the form of
  hpsv2's leaderboard, which prints it x100 (``logits_per_image = image_features @ text_features.T * 100``).
- ``hpdv2-test``: ``test.json`` (a JSON list of 400 objects ``{"prompt", "image_path", "rank", "raw_annotations"}``;
  only ``prompt`` is read), one image per prompt as ``test/<index:05d>.jpg``, the headline is the plain mean of the
  raw scores -- the JAGG paper's table form (arXiv:2607.17572: "the official HPSv2.1 test set", HPSv2.1 ~0.32),
  and MixGRPO's (its ``data/prompts_test.txt`` is these 400 prompts; ``fastvideo/eval/eval_reward.py`` reports
  ``np.mean`` of the per-image scores).

The toy world has both: its test split as ``benchmark/<style>.json`` and the same prompts, style after style, as a
``test.json`` of HPDv2's layout (tasks/prepare.py). Its benchmark run carries the test form too, computed from the
same images (one per prompt), so both forms appear, labelled, in the toy's report.

The value a table shows per metric (its reward spec's ``table``): HPSv2.1 and CLIPScore as raw cosines, PickScore as its
logit-scale score / 100 (the paper's 0.2252; MixGRPO's ``(r * 8 + 18) / 100`` undoes its own normalisation to the
same), toy rewards as themselves. What else a score depends on (scorer weights, resolution, steps, guidance, seeds) is
in conventions.py; docs/evaluation.md sets out which anchor paper reports which form.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..setup.registry import reward_names, reward_spec
from ..setup.storage import PromptFileError, read_prompt_json

__all__ = ["HPDV2_MIRRORS", "PROTOCOLS", "TEST_GROUP", "apply_protocol", "hpdv2_test_path",
           "load_hpdv2_test", "protocol_forms", "read_test_list"]

PROTOCOLS = ("hpdv2-benchmark", "hpdv2-test")
HPDV2_MIRRORS = ("zhwang/HPDv2", "ymhao/HPDv2")  # the same files; hpsv2's own code reads the first
TEST_GROUP = "test"  # the one "style" of the test list: images test/<index:05d>.jpg, seeds (eval.seed, 0, index)



def _hint() -> str:
    repo = HPDV2_MIRRORS[0]
    return (f"download test.json from the Hugging Face dataset {repo} into the local Hugging Face cache (hf download "
            f"{repo} test.json --repo-type dataset), or into a folder and pass that folder")


def read_test_list(path: Path) -> list[str]:
    """The prompts of a ``test.json`` in file order: HPDv2's list of ``{"prompt": ...}`` objects (or of strings)."""
    items = read_prompt_json(path)
    prompts = [it.get("prompt") if isinstance(it, dict) else it for it in items] if isinstance(items, list) else []
    bad = next((i for i, p in enumerate(prompts) if not isinstance(p, str) or not p.strip()), None)
    if not prompts or bad is not None:
        where = f" (entry {bad} has none)" if bad is not None else ""
        raise PromptFileError(f"{path} must hold a non-empty JSON list of objects with a \"prompt\" string, as "
                              f"HPDv2's test.json{where}.")
    return prompts


def load_hpdv2_test(source: str | Path | None = None, *, subset: int | None = None) -> dict[str, list[str]]:
    """The HPDv2 test list as ``{"test": [prompt, ...]}`` in file order.

    Args:
        source: a folder holding ``test.json`` (or that file itself); ``None`` reads it from the local Hugging Face
            cache of ``zhwang/HPDv2`` or its mirror ``ymhao/HPDv2`` (never the network).
        subset: keep the first ``subset`` prompts (``None``: all).
    """
    if subset is not None and (isinstance(subset, bool) or not isinstance(subset, int) or subset < 1):
        raise ValueError(f"subset must be a positive integer or None, got {subset!r}.")
    if source is None:
        from huggingface_hub import try_to_load_from_cache

        found = [try_to_load_from_cache(repo, "test.json", repo_type="dataset") for repo in HPDV2_MIRRORS]
        path = next((Path(p) for p in found if isinstance(p, str)), None)
        if path is None:
            raise FileNotFoundError(f"the HPDv2 test list test.json is not in the local Hugging Face cache: "
                                    f"{_hint()}.")
    else:
        path = hpdv2_test_path(source)
    return {TEST_GROUP: read_test_list(path)[:subset]}


def hpdv2_test_path(source: str | Path) -> Path:
    """The HPDv2 test list a local ``source`` names: a folder's ``test.json``, or the file itself."""
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "test.json"
    elif not path.exists():
        raise FileNotFoundError(f"the HPDv2 folder {str(source)!r} does not exist: {_hint()}.")
    if not path.is_file():
        raise FileNotFoundError(f"the HPDv2 test list {path} does not exist: {_hint()}.")
    return path


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs)


def protocol_forms(summary: Mapping[str, Any], metric: str, forms: Sequence[str]) -> dict[str, dict[str, float]]:
    """Each protocol form of ``metric``'s table value (its reward spec's ``table``) from a :func:`summarize_scores` result.

    ``hpdv2-benchmark``: ``raw`` = the average over groups of their block means, ``x100`` = 100 x raw;
    ``hpdv2-test``: ``raw`` = the plain mean over all images."""
    key, factor, _ = reward_spec(metric).table_value if metric in reward_names() else (metric, 1.0, "")
    s = summary[key] if key in summary else summary[metric]
    if key not in summary:
        factor = 1.0
    out: dict[str, dict[str, float]] = {}
    for form in forms:
        if form == "hpdv2-benchmark":
            raw = factor * _mean([st["block_mean"] for st in s["styles"].values()])
            out[form] = {"raw": raw, "x100": 100.0 * raw, "n_images": s["n_images"]}
        elif form == "hpdv2-test":
            out[form] = {"raw": factor * s["mean"], "n_images": s["n_images"]}
        else:
            raise ValueError(f"unknown protocol form {form!r}; use one of {', '.join(PROTOCOLS)}.")
    return out


def apply_protocol(summary: dict[str, dict[str, Any]], protocol: str, *, both_forms: bool = False) -> dict:
    """``summary`` (of :func:`summarize_scores`) read by ``protocol``: each entry gets ``protocol``, ``forms`` (of
    :func:`protocol_forms`) and ``benchmark`` = the protocol's headline in the metric's own units (hpdv2-test: the
    plain mean). ``both_forms``: the images are one per prompt of the test list as well (the toy), so the other form
    is added."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown eval.protocol {protocol!r}; use one of {', '.join(PROTOCOLS)}.")
    forms = list(PROTOCOLS) if both_forms else [protocol]
    for metric, s in summary.items():
        if protocol == "hpdv2-test":
            s["benchmark"] = s["mean"]
        s["protocol"] = protocol
        s["forms"] = protocol_forms(summary, metric, forms)
    return summary
