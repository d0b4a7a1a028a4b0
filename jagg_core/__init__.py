"""jagg_core: GRPO for flow-matching text-to-image transformers with Jacobian-Aggregated Group Gradients.

Two parts (docs/architecture.md is the map):

- **the algorithm**, the modules of this folder that need torch alone: ``jagg`` (Eq. 6–7, ``group_backward``,
  ``plan_groups``), ``modes`` (the registry of backward modes), ``sde``, ``loss``, ``advantages``, ``schedules``,
  ``fidelity``, ``cost`` and ``errors``. The names below are imported lazily: ``import jagg_core`` imports nothing,
  ``from jagg_core import group_backward`` imports ``jagg_core.jagg`` (and torch) only.
- **the library and the application** in subpackages imported explicitly: ``policies``, ``rewards``, ``world``,
  ``trainer``, ``evaluation``, ``sampling`` (the sampler they share), ``media``, ``build`` (policy and reward from
  params) and ``bench`` (the update-stage benchmark), on ``setup`` (configuration, paths, storage, redaction, the
  logging interface, fault injection); ``pipeline``, the application above them (tracking, reports, planning,
  pretraining, export).
"""

from __future__ import annotations

import importlib

# public name -> the algorithm module that defines it
_LAZY = {
    "group_advantages": "advantages",
    "FidelityReport": "fidelity",
    "gradient_fidelity": "fidelity",
    "jagg_frac_from_cosines": "fidelity",
    "Estimator": "jagg",
    "Group": "jagg",
    "GroupStats": "jagg",
    "GroupSteps": "jagg",
    "aggregate_upstream": "jagg",
    "anchor_positions": "jagg",
    "anchor_weights": "jagg",
    "draw_random_anchor": "jagg",
    "group_backward": "jagg",
    "group_surrogate": "jagg",
    "group_timesteps": "jagg",
    "inner_product": "jagg",
    "interpolation_weights": "jagg",
    "plan_groups": "jagg",
    "random_anchor_probabilities": "jagg",
    "resolve_anchors": "jagg",
    "run_group": "jagg",
    "Surrogate": "jagg",
    "MODES": "modes",
    "VARIANTS": "modes",
    "PpoStepLoss": "loss",
    "ppo_step_loss": "loss",
    "Schedule": "schedules",
    "flow_match_schedule": "schedules",
    "resolution_mu": "schedules",
    "shift_sigmas": "schedules",
    "SDE_KINDS": "sde",
    "SdeStep": "sde",
    "randn": "sde",
    "sde_step_with_logprob": "sde",
}

__all__ = sorted(_LAZY)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jagg_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
