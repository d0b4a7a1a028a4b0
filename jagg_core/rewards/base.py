"""The reward registry: rewards by name, each a factory returning ``fn(images, prompts, metadata) -> (rewards, info)``.

As in DDPO's reward functions: a factory does the heavy imports and model loading lazily (once per process, cached by
its options), and the returned function is called on batches.

- ``images``: (B, 3, H, W) float tensor in [0, 1] (on any device).
- ``prompts``: B strings. ``metadata``: B dicts (the world's parsed scene for the toy rewards; may be empty).
- returns ``rewards``: (B,) float32 CPU tensor, and ``info``: a dict of extra per-image (B,) tensors or scalars.

A reward is of one of two kinds (:data:`REWARD_KINDS`), declared where it is registered
(``@register_reward(name, kind=...)``) and set on every built function as ``fn.kind``:

- ``pointwise`` (the default): a score per image; the trainer calls it on whole batches, any images together.
- ``groupwise``: a score that depends on the other images of the same prompt (a pairwise-preference ranking turned
  into per-image scores, as Flow-Factory's ``PickScore_Rank``); the trainer calls it once per prompt group, with
  exactly the G images of that prompt (:mod:`.groupwise`). Evaluation draws one image per prompt, so a groupwise
  reward is refused as an evaluation metric (:func:`check_rewards`).

A reward built on a neural network exposes it as ``fn.modules`` (a tuple of ``torch.nn.Module``): then
:func:`rewards_off_device` can move it to the CPU while the policy needs the GPU (evaluation's generation) and back.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

from ..errors import UserError, sentence
from ..setup.registry import PluginError, RewardSpec, add, reward_names, reward_spec

if TYPE_CHECKING:
    import torch

__all__ = [
    "REWARD_KINDS",
    "RewardFn",
    "RewardError",
    "available_rewards",
    "check_reward_options",
    "check_metric",
    "check_rewards",
    "checked_scores",
    "forget_reward",
    "make_metric",
    "make_reward",
    "register_reward",
    "reward_kind",
    "rewards_off_device",
    "loaded_rewards",
]


class RewardFn(Protocol):
    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, dict[str, Any]]: ...


class RewardError(UserError, ValueError):
    """A reward that cannot be built: unknown name, bad option, missing weights. The message is for the user."""


REWARD_KINDS = ("pointwise", "groupwise")


def register_reward(name: str, **facts: Any) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """Decorator: register a factory ``(**options) -> RewardFn`` under ``name`` with its spec's ``facts``
    (:class:`jagg_core.setup.registry.RewardSpec`: ``options`` at least, the schema of what the factory takes; ``kind``
    a name of :data:`REWARD_KINDS`, or a function of the options that returns one, for a reward whose kind is an
    option, as the served reward's)."""
    kind = facts.get("kind", "pointwise")
    if not callable(kind) and kind not in REWARD_KINDS:
        raise ValueError(f"reward {name!r}: kind must be one of {', '.join(REWARD_KINDS)}, got {kind!r}.")

    def deco(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        if "options" not in facts:  # no schema declared: the factory's keyword parameters, of any type
            params = inspect.signature(factory).parameters.values()
            facts["options"] = {p.name: (Any, None) for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        add("reward", RewardSpec(name=name, factory=factory, **facts))
        return factory

    return deco


def reward_kind(name: str, options: Mapping[str, Any] | None = None) -> str:
    """The kind of the registered reward ``name`` with ``options``: ``pointwise`` or ``groupwise``."""
    kind = _spec(name).kind
    kind = kind(dict(options or {})) if callable(kind) else kind
    if kind not in REWARD_KINDS:
        raise RewardError(f"reward {name!r}: kind must be one of {', '.join(REWARD_KINDS)}, got {kind!r}.")
    return kind


def available_rewards() -> list[str]:
    return reward_names()


def _spec(name: str) -> RewardSpec:
    try:
        return reward_spec(name)
    except PluginError as e:
        raise RewardError(sentence(e)) from None


def _freeze(value: Any) -> Any:
    """A hashable key for options of any shape: mappings (sorted), lists and tuples, sets; the factory gets the
    options as given, not this key."""
    if isinstance(value, Mapping):
        return ("map", tuple(sorted((k, _freeze(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(_freeze(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(_freeze(v) for v in value))
    return value


_BUILT: dict[tuple[str, Any], RewardFn] = {}  # (name, frozen options) -> the reward built in this process


def _cached(name: str, options: Mapping[str, Any]) -> RewardFn:
    key = (name, _freeze(options))
    if key not in _BUILT:
        spec = _spec(name)
        beside = spec.beside_policy(dict(options)) if callable(spec.beside_policy) else spec.beside_policy
        _BUILT[key] = _Checked(name, spec.origin, spec.factory(**options), reward_kind(name, options), bool(beside))
    return _BUILT[key]


class _Checked:
    """A built reward, every call of it checked (:func:`checked_scores`): the one place a reward's answer is read,
    for training (pointwise, groupwise, on clips' frames) and evaluation alike. ``kind`` is what the weighted reward
    reads to call it per batch or per prompt group, ``beside_policy`` (its spec's, :mod:`.weighted`) whether the trainer
    may call it on parts of a rollout while the policy samples; any other attribute (``modules``, …) is the reward's
    own."""

    def __init__(self, name: str, origin: str, fn: RewardFn, kind: str, beside_policy: bool = False):
        self.name, self.origin, self.fn, self.kind = name, origin, fn, kind
        self.beside_policy = beside_policy

    def __call__(self, images, prompts, metadata):
        answer = self.fn(images, prompts, metadata)
        return checked_scores(self.name, self.origin, answer, len(prompts), self.kind)

    def __getattr__(self, attr: str) -> Any:  # only for what __init__ did not set
        if attr == "fn":  # not set yet (copy, pickle): no recursion
            raise AttributeError(attr)
        return getattr(self.fn, attr)


def checked_scores(name: str, origin: str, answer: Any, n: int, kind: str = "pointwise"
                   ) -> tuple[torch.Tensor, dict[str, Any]]:
    """A reward's answer for ``n`` images, or one sentence naming the reward: ``(scores, info)`` with ``scores`` a
    (n,) tensor of a floating dtype and finite values, ``info`` a dict.

    Integer or bool scores are refused, not converted (a count or a verdict is a score the reward should give as
    the float it means). A NaN or an infinity stops the run, as a served reward's does (its server's answer is checked
    in :mod:`.served`): an update computed from it is skipped anyway, and a reward that always answers NaN used to skip
    every update and end FINISHED with checkpoints of the untrained model."""
    import torch

    who = f"reward {name!r} ({kind})"
    where = f" ({name!r} is registered by {origin})" if origin and origin != name else ""
    what = "a group" if kind == "groupwise" else "a batch"
    if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[1], dict)):
        got = f"a tuple of {len(answer)}" if isinstance(answer, tuple) else f"a {type(answer).__name__}"
        raise RewardError(f"{who} returned {got}; a reward returns (scores, info): a ({n},) tensor of scores and a "
                          f"dict of extras ({{}} for none){where}.")
    scores, info = answer
    if not isinstance(scores, torch.Tensor):
        raise RewardError(f"{who} returned its scores as a {type(scores).__name__}; a reward returns a ({n},) torch "
                          f"tensor of floats, one score per image{where}.")
    if tuple(scores.shape) != (n,):
        raise RewardError(f"{who} returned {scores.numel()} scores for {what} of {n} images (shape "
                          f"{tuple(scores.shape)}); it must return one score per image, a ({n},) tensor{where}.")
    if not scores.is_floating_point():
        raise RewardError(f"{who} returned scores of dtype {scores.dtype}, which jagg refuses rather than converts: "
                          f"return the floats they stand for (e.g. scores.float()){where}.")
    bad = ~torch.isfinite(scores.detach())
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise RewardError(f"{who} gave image {i} of {what} of {n} the score {float(scores[i])}, not a finite number; "
                          f"a reward's scores must be finite, so jagg stops here as it does for a served reward's "
                          f"NaN{where}.")
    return scores, info


def forget_reward(name: str, options: Mapping[str, Any]) -> None:
    """Drop the reward built with ``options`` from this process, so the next :func:`make_reward` builds it again: its
    weights changed under it (a file replaced at the same path, evaluation/score_cache.py)."""
    _BUILT.pop((name, _freeze(options)), None)


def loaded_rewards() -> list[RewardFn]:
    """The rewards this process has built so far (each once per options)."""
    return list(_BUILT.values())


@contextlib.contextmanager
def rewards_off_device(fns: Iterable[RewardFn]) -> Iterator[None]:
    """Move the networks of ``fns`` (``fn.modules``) that sit on an accelerator to the CPU for the duration of the
    block, then back where they were: the GPU memory goes to what runs in the block (e.g. generation)."""
    import torch

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
    """Every reward and evaluation metric named exists and takes the options given, and no metric is groupwise (one
    sentence otherwise), before a stage loads any model or starts a process."""
    for name in dict.fromkeys([*weights, *options, *metrics]):
        check_reward_options(name, options.get(name, {}))
    for name in metrics:
        check_metric(name, options.get(name, {}))


def check_metric(name: str, options: Mapping[str, Any]) -> None:
    """One sentence for a groupwise reward named as an evaluation metric: evaluation draws one image per prompt, so
    the reward would have no group to compare an image with (a ranking of one image says nothing)."""
    if reward_kind(name, options) == "groupwise":
        raise RewardError(f"eval.metrics: {name!r} is a groupwise reward (it scores an image against the other images "
                          f"of its prompt) and evaluation draws one image per prompt, so it cannot be a metric; "
                          f"evaluate with a pointwise reward instead.")


def make_metric(name: str, **options: Any) -> RewardFn:
    """The evaluation metric ``name``: :func:`make_reward`, refusing a groupwise reward (:func:`check_metric`)."""
    check_reward_options(name, options)
    check_metric(name, options)
    return make_reward(name, **options)


def make_reward(name: str, **options: Any) -> RewardFn:
    """The reward ``name`` built with ``options``; built once per process for the same options."""
    check_reward_options(name, options)
    return _cached(name, options)
