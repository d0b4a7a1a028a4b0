"""The reward registry: rewards by name, each a factory returning ``fn(images, prompts, metadata) -> (rewards, info)``.

As in DDPO's reward functions: a factory does the heavy imports and model loading lazily (once per process, cached by
its options), and the returned function is called on batches.

- ``images``: (B, 3, H, W) float tensor in [0, 1] (on any device).
- ``prompts``: B strings. ``metadata``: B dicts (the world's parsed scene for the toy rewards; may be empty).
- returns ``rewards``: (B,) float32 CPU tensor, and ``info``: a dict of extra per-image (B,) tensors or scalars.

A reward built on a neural network exposes it as ``fn.modules`` (a tuple of ``torch.nn.Module``): then
:func:`rewards_off_device` can move it to the CPU while the policy needs the GPU (evaluation's generation) and back.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import torch

from ..errors import UserError
from ..setup.registry import PluginError, RewardSpec, add, reward_names, reward_spec

__all__ = [
    "RewardFn",
    "RewardError",
    "available_rewards",
    "check_reward_options",
    "check_rewards",
    "make_reward",
    "register_reward",
    "rewards_off_device",
    "loaded_rewards",
]


class RewardFn(Protocol):
    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, dict[str, Any]]: ...


class RewardError(UserError, ValueError):
    """A reward that cannot be built: unknown name, bad option, missing weights. The message is for the user."""


def register_reward(name: str, **facts: Any) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """Decorator: register a factory ``(**options) -> RewardFn`` under ``name`` with its spec's ``facts``
    (:class:`jagg_core.setup.registry.RewardSpec`: ``options`` at least, the schema of what the factory takes)."""

    def deco(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        add("reward", RewardSpec(name=name, factory=factory, **facts))
        return factory

    return deco


def available_rewards() -> list[str]:
    return reward_names()


def _spec(name: str) -> RewardSpec:
    try:
        return reward_spec(name)
    except PluginError as e:
        raise RewardError(f"{e}.") from None


def _freeze(options: Mapping[str, Any]) -> tuple:
    return tuple(sorted((k, _freeze(v) if isinstance(v, Mapping) else v) for k, v in options.items()))


_BUILT: dict[tuple[str, tuple], RewardFn] = {}  # (name, frozen options) -> the reward built in this process


def _cached(name: str, frozen: tuple) -> RewardFn:
    if (name, frozen) not in _BUILT:
        _BUILT[name, frozen] = _spec(name).factory(**dict(frozen))
    return _BUILT[name, frozen]


def loaded_rewards() -> list[RewardFn]:
    """The rewards this process has built so far (each once per options)."""
    return list(_BUILT.values())


@contextlib.contextmanager
def rewards_off_device(fns: Iterable[RewardFn]) -> Iterator[None]:
    """Move the networks of ``fns`` (``fn.modules``) that sit on an accelerator to the CPU for the duration of the
    block, then back where they were: the GPU memory goes to what runs in the block (e.g. generation)."""
    moved: list[tuple[torch.nn.Module, torch.device]] = []
    for fn in fns:
        for module in getattr(fn, "modules", ()):
            device = next(module.parameters()).device
            if device.type != "cpu":
                module.to("cpu")
                moved.append((module, device))
    if moved and torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        yield
    finally:
        for module, device in moved:
            module.to(device)


def check_reward_options(name: str, options: Mapping[str, Any]) -> None:
    """One sentence for an unknown reward or an option its spec does not declare (before any model is loaded)."""
    known = list(_spec(name).options)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise RewardError(f"reward.options.{name}: {name!r} has no option {unknown[0]!r}; its options: "
                          f"{', '.join(known) or 'none'}.")


def check_rewards(weights: Mapping[str, float], options: Mapping[str, Mapping[str, Any]],
                  metrics: Sequence[str] = ()) -> None:
    """Every reward and evaluation metric named exists and takes the options given (one sentence otherwise), before
    a stage loads any model or starts a process."""
    for name in dict.fromkeys([*weights, *options, *metrics]):
        check_reward_options(name, options.get(name, {}))


def make_reward(name: str, **options: Any) -> RewardFn:
    """The reward ``name`` built with ``options``; built once per process for the same options."""
    check_reward_options(name, options)
    return _cached(name, _freeze(options))
