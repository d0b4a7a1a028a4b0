"""jagg_core: GRPO for flow-matching text-to-image transformers with Jacobian-Aggregated Group Gradients.

The algorithm (this namespace) needs torch alone. Policies, rewards, the trainer and evaluation live in subpackages
that are imported explicitly (``jagg_core.policies``, ``jagg_core.rewards``, ...). Shared by all of them and by the
orchestration layers: ``storage`` (atomic writes, the folder swap and lock, prompt files), ``cost`` (the update's
cost model), ``metric_logger`` (the logging interface) and ``errors`` (the base of every user-facing error).
"""

from .advantages import group_advantages
from .fidelity import FidelityReport, gradient_fidelity, jagg_frac_from_cosines
from .jagg import (
    MODES,
    VARIANTS,
    Group,
    GroupStats,
    aggregate_upstream,
    anchor_positions,
    anchor_weights,
    group_backward,
    interpolation_weights,
    plan_groups,
)
from .loss import PpoStepLoss, ppo_step_loss
from .schedules import Schedule, flow_match_schedule, resolution_mu, shift_sigmas
from .sde import SDE_KINDS, SdeStep, randn, sde_step_with_logprob

__all__ = [
    "MODES",
    "SDE_KINDS",
    "VARIANTS",
    "FidelityReport",
    "Group",
    "GroupStats",
    "PpoStepLoss",
    "Schedule",
    "SdeStep",
    "aggregate_upstream",
    "anchor_positions",
    "anchor_weights",
    "flow_match_schedule",
    "gradient_fidelity",
    "group_advantages",
    "group_backward",
    "interpolation_weights",
    "jagg_frac_from_cosines",
    "plan_groups",
    "randn",
    "ppo_step_loss",
    "resolution_mu",
    "sde_step_with_logprob",
    "shift_sigmas",
]
__version__ = "0.1.0"
