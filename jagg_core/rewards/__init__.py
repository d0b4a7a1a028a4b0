"""Rewards by name (the registry in :mod:`.base`); importing this package registers the built-in ones."""

from .base import RewardError, RewardFn, available_rewards, make_reward, make_weighted_reward, register_reward

__all__ = ["RewardError", "RewardFn", "available_rewards", "make_reward", "make_weighted_reward", "register_reward"]
