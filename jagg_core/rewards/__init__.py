"""Rewards by name (the registry in :mod:`.base`); importing this package registers the built-in ones."""

from . import clipscore, hps, pickscore  # noqa: F401  (registers the real rewards)
from . import preference, toy  # noqa: F401  (registers toy rewards)
from . import served  # noqa: F401  (registers the reward served over HTTP)
from .base import (REWARD_KINDS, RewardError, RewardFn, available_rewards, check_metric, check_reward_options,
                   check_rewards, loaded_rewards, make_metric, make_reward, register_reward, reward_kind,
                   rewards_off_device)
from .groupwise import pairwise_wins, score_groups
from .weighted import make_weighted_reward

__all__ = [
    "REWARD_KINDS",
    "RewardError",
    "RewardFn",
    "available_rewards",
    "check_metric",
    "check_reward_options",
    "check_rewards",
    "loaded_rewards",
    "make_metric",
    "make_reward",
    "make_weighted_reward",
    "pairwise_wins",
    "register_reward",
    "reward_kind",
    "rewards_off_device",
    "score_groups",
]
