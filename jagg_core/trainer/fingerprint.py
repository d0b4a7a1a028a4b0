"""A run's fingerprint: a digest of everything that determines its training (not how long or how it is logged).

A checkpoint records the fingerprint of the run that wrote it. Resuming requires the same fingerprint, so raising
``train.iterations`` continues a finished run, while changing e.g. ``train.lr`` or the base model's weights starts it
over.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..setup.config import Params
from ..setup.registry import reward_spec
from ..setup.paths import Layout
from ..setup.storage import PromptFileError, base_model_digest, file_sha256

__all__ = ["IGNORED_TRAIN", "run_fingerprint"]

# Fields that change how long a run goes, what it logs, or how its work is split into forwards (micro_batch: the
# gradient of a chunk is the same sum, so lowering it after an out-of-memory error resumes the run), not what it
# computes.
IGNORED_TRAIN = {"iterations", "checkpoint_every", "keep_checkpoints", "log_images_every", "fidelity_every",
                  "micro_batch", "kl_ref", "kl_ref_every", "update_size_every"}


def run_fingerprint(params: Params, layout: Layout, method: str, seed: int) -> str:
    ignored = set(IGNORED_TRAIN)
    if params.method(method).jagg_frac != "auto":  # the fidelity monitor only decides the routing under 'auto'
        ignored.add("fidelity_batch")
    masked = params.masked()  # a plugin's secret options hashed as `***` (no digest of a secret); without: unchanged
    tree = {
        "model": masked["model"],
        "base_model": base_model_digest(layout.base_model, params.model.path),  # its weights, not its card
        "sample": params.sample.model_dump(mode="json"),
        "train": _train(params, ignored),
        "method": _method(params, method),
        # reward.frames at its default ("all") is left out: fingerprints from before the field existed still match.
        "reward": _reward(params, masked["reward"]),
        "prompts": _digest(layout.train_prompts),
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:16]


# jagg settings added after runs were fingerprinted, left out at their defaults so those runs' fingerprints still match
_NEW_METHOD_DEFAULTS = {"anchor_at": None, "random_anchor": None, "random_anchor_p": "uniform",
                        "random_anchor_weight": 1.0, "lr_scale": 1.0}


# train settings added after runs were fingerprinted, likewise; the KL convention also wherever beta is 0 (no KL term)
_NEW_TRAIN_DEFAULTS = {"kl_convention": "gaussian"}


def _train(params: Params, ignored: set[str]) -> dict:
    tree = {k: v for k, v in params.train.model_dump(mode="json").items() if k not in ignored}
    if params.train.beta == 0:
        tree.pop("kl_convention")
    return {k: v for k, v in tree.items() if k not in _NEW_TRAIN_DEFAULTS or v != _NEW_TRAIN_DEFAULTS[k]}


def _method(params: Params, method: str) -> dict:
    tree = params.method(method).model_dump(mode="json")
    return {k: v for k, v in tree.items() if k not in _NEW_METHOD_DEFAULTS or v != _NEW_METHOD_DEFAULTS[k]}


def _reward(params: Params, reward: dict) -> dict:
    """The reward section (``reward``: as :meth:`Params.masked` dumps it) as it decides the scores: reward.frames at
    its default ("all") is left out (fingerprints from before the field existed still match), and so is how the
    served reward reaches its server (its token, timeout, batching, retries: its spec's ``transport``): a rotated
    token or a longer timeout resumes the run, as a rotated secret option (hashed as ``***``) does."""
    tree = {k: v for k, v in reward.items() if (k, v) != ("frames", "all")}
    for name, options in tree.get("options", {}).items():
        transport = reward_spec(name).transport
        if transport:
            tree["options"][name] = {k: v for k, v in options.items() if k not in transport}
    return tree


def _digest(path: Path) -> str | None:
    return file_sha256(path, PromptFileError, fix="regenerate it with `jagg prepare`")[:16] if path.exists() else None
