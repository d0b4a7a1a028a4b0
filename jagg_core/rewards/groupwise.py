"""Groupwise rewards: call a reward once per prompt group and put its scores back in batch order.

A groupwise reward (``@register_reward(name, kind="groupwise")``, :mod:`.base`) scores an image against the other
images of its prompt: a pairwise-preference ranking turned into per-image scores, as Flow-Factory's groupwise reward
models. :func:`score_groups` hands it exactly the images of one group per call, so the reward never sees two prompts'
images together and never has to know how the batch is laid out; :func:`pairwise_wins` is the usual way to turn a
group's raw scores into a ranking reward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .base import RewardError, RewardFn
from .inflight import in_order

if TYPE_CHECKING:
    import torch

__all__ = ["group_members", "pairwise_wins", "placed", "score_groups"]


def score_groups(
    fn: RewardFn, name: str, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]],
    groups: torch.Tensor | Sequence[int] | None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``fn`` called once per group of ``groups`` (the (B,) group id of each image: its prompt), with that group's
    images, prompts and metadata in batch order; returns the (B,) scores and the per-image extras in batch order
    (a scalar extra is averaged over the groups). A reward that allows it (``fn.max_in_flight``, a served one) is
    called on that many groups at once."""
    import torch

    members = group_members(name, groups, len(prompts))

    def one(rows: list[int]) -> tuple[torch.Tensor, dict[str, Any]]:
        index = torch.tensor(rows)
        return fn(images[index.to(images.device)], [prompts[i] for i in rows], [metadata[i] for i in rows])

    answers = in_order(one, [(rows,) for rows in members], getattr(fn, "max_in_flight", 1))
    return placed(name, len(prompts), members, answers)


def group_members(name: str, groups: torch.Tensor | Sequence[int] | None, n: int) -> list[list[int]]:
    """The rows of each group of ``groups`` ((n,) group ids): groups in order of their first image, rows in batch
    order."""
    import torch

    if groups is None:
        raise ValueError(f"reward {name!r} is groupwise: pass groups (the (B,) group id of each image) to score it.")
    ids = torch.as_tensor(groups).reshape(-1).tolist()
    if len(ids) != n:
        raise ValueError(f"got {len(ids)} group ids for {n} images.")
    members: dict[Any, list[int]] = {}
    for i, g in enumerate(ids):
        members.setdefault(g, []).append(i)
    return list(members.values())


def placed(name: str, n: int, members: list[list[int]], answers: Sequence[tuple[torch.Tensor, dict[str, Any]]]
           ) -> tuple[torch.Tensor, dict[str, Any]]:
    """The (n,) scores and extras of a batch from its groups' answers (one ``(scores, extras)`` per group of
    ``members``, in that order), each checked for one score per image of its group."""
    import torch

    scores = torch.zeros(n, dtype=torch.float32)
    per_image: dict[str, torch.Tensor] = {}
    scalars: dict[str, list[float]] = {}
    for rows, (r, extra) in zip(members, answers):
        index = torch.tensor(rows)
        r = torch.as_tensor(r).detach().float().cpu().reshape(-1)
        if r.numel() != len(rows):
            raise RewardError(f"reward {name!r} (groupwise) returned {r.numel()} scores for a group of {len(rows)} "
                              f"images; it must return one score per image of the group.")
        scores[index] = r
        for key, value in extra.items():
            if isinstance(value, torch.Tensor) and value.ndim == 1 and value.numel() == len(rows):
                per_image.setdefault(key, torch.zeros(n, dtype=torch.float32))[index] = value.detach().float().cpu()
            elif isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
                scalars.setdefault(key, []).append(float(value))
    info: dict[str, Any] = dict(per_image)
    info.update({k: sum(v) / len(v) for k, v in scalars.items() if k not in per_image})
    return scores, info


def pairwise_wins(scores: torch.Tensor) -> torch.Tensor:
    """(n,) raw scores of one group → (n,) the share of the group's other images each one beats, a tie counting
    half: a pairwise-preference ranking as a reward in [0, 1] (0.5 for a group of one, or of equal scores)."""
    import torch

    s = scores.detach().double().reshape(-1)
    n = s.numel()
    if n < 2:
        return torch.full((n,), 0.5, dtype=torch.float32)
    wins = (s[:, None] > s[None, :]).double() + 0.5 * (s[:, None] == s[None, :]).double()
    return ((wins.sum(1) - 0.5) / (n - 1)).float()  # minus the image's tie with itself
