"""What a derived file was made from, and its fingerprint: a file that carries them is shown only beside results
made at the same settings (docs/reliability.md, round 6, mechanism 4).

``runs/<outputs>/speed.json`` (the `speed` stage's side-by-side timing) carries :func:`speed_made_from` and its
:func:`fingerprint`; the report and `jagg run`'s last line compare them with their own params.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

from .config import Params
from .redact import redact_own

__all__ = ["fingerprint", "speed_made_from"]

# Train settings that change how long a run goes or what it logs, not the work of one update.
_UNTIMED_TRAIN = {"iterations", "checkpoint_every", "keep_checkpoints", "log_images_every", "fidelity_every",
                  "kl_ref_every", "update_size_every"}


def speed_made_from(params: Params, methods: Sequence[str]) -> dict[str, Any]:
    """What a side-by-side timing of ``methods`` measures, from params: the model, the batch (sample), the update's
    settings (train), each method as resolved, and where it runs (device, threads, precision); secrets redacted."""
    r = params.resources
    tree = {"model": params.masked()["model"], "sample": params.sample.model_dump(mode="json"),
            "train": {k: v for k, v in params.train.model_dump(mode="json").items() if k not in _UNTIMED_TRAIN},
            # a method's learning rate (lr_scale) is not its update's work: a method at another rate times alike
            "methods": {name: params.method(name).model_dump(mode="json", exclude={"lr_scale"}) for name in methods},
            "resources": {"device": r.device, "num_threads": r.num_threads, "mixed_precision": r.mixed_precision}}
    return redact_own(tree)


def fingerprint(made_from: Any) -> str:
    """The digest of a made-from tree (JSON-ready): what a derived file carries beside it."""
    return hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:16]
