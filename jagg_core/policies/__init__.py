"""Policies by backbone name (the registry in :mod:`.base`); importing this package registers the built-in ones."""

from .base import Policy, PolicyError, PromptEmbeds, available_backbones, load_policy, register_backbone
from . import flux, qwenimage, sd3, toy_flux, wan  # noqa: F401  (registers the backbones)

__all__ = ["Policy", "PolicyError", "PromptEmbeds", "available_backbones", "load_policy", "register_backbone"]
