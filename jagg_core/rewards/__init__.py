"""Rewards by name (the registry in :mod:`.base`); importing this package registers the built-in ones."""

from . import clipscore, hps, pickscore  # noqa: F401  (registers the real rewards)
from . import preference, toy  # noqa: F401  (registers toy rewards)
from .base import (RewardError, RewardFn, available_rewards, check_reward_options, check_rewards, loaded_rewards,
                   make_reward, register_reward, rewards_off_device)
from .weighted import make_weighted_reward

__all__ = [
    "RewardError",
    "RewardFn",
    "available_rewards",
    "check_reward_options",
    "check_rewards",
    "loaded_rewards",
    "make_reward",
    "make_weighted_reward",
    "register_reward",
    "rewards_off_device",
]
