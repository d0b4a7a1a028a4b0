"""The training reward: the weighted sum of named rewards (``reward.weights``), each on images or on the chosen frames
of clips (:mod:`.clips`); a pointwise reward on the whole batch, a groupwise one once per prompt group
(:mod:`.groupwise`).

A reward whose spec says it may run beside the policy (``beside_policy``: a served reward, whose judge is another
machine) can be scored while the rollout is still sampling: :meth:`Scoring.add` hands over each part of the rollout as
it is sampled, and every call of that reward whose images are all there is sent at once, on a small thread pool, while
the policy samples the next part. The calls are the ones the whole batch would get (a pointwise reward's consecutive
slices of ``request_size`` images from the batch's start, a groupwise one's groups), and the answers are put together
in batch order and summed in the order of ``reward.weights``, so the total is the same to the last bit whether the
parts came during sampling or all at once after it. The scoring threads draw no random number of the run.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from .base import RewardError, RewardFn, make_reward
from .clips import on_frames
from .groupwise import group_members, placed, score_groups
from .inflight import Pool, answers, failure

if TYPE_CHECKING:
    import torch

    Answer = tuple[torch.Tensor, dict[str, Any]]  # a reward's (scores, info)

__all__ = ["Scoring", "make_weighted_reward"]


def make_weighted_reward(
    weights: Mapping[str, float], options: Mapping[str, Mapping[str, Any]] | None = None,
    frames: str | int | Sequence[int] = "all",
) -> RewardFn:
    """``Σ_k w_k · reward_k``; ``info`` holds each component's per-image values under ``reward/<name>``. Clips
    ``(B, F, 3, H, W)`` are scored on the frames ``frames`` chooses, averaged per clip (:mod:`.clips`).

    The returned ``fn(images, prompts, metadata, groups=None)`` calls a pointwise reward once on the whole batch and
    a groupwise reward once per group of ``groups`` (the (B,) group id of each image, its prompt: the trainer's
    ``Trajectory.group_ids``), which a groupwise reward needs. ``fn.begin(prompts, metadata, groups)`` scores the same
    batch as its images are sampled (:class:`Scoring`); ``fn.beside`` says whether any of its rewards may run beside
    the policy (else the trainer scores after sampling, as it gains nothing)."""
    import torch

    if not weights:
        raise RewardError("at least one reward with a weight is needed.")
    options = options or {}
    fns = {name: on_frames(make_reward(name, **dict(options.get(name, {}))), frames) for name in weights}

    def whole(name: str, images, prompts, metadata, groups) -> Answer:
        if getattr(fns[name], "kind", "pointwise") == "groupwise":
            return score_groups(fns[name], name, images, prompts, metadata, groups)
        return fns[name](images, prompts, metadata)

    def total(n: int, got: Mapping[str, Answer]) -> tuple[torch.Tensor, dict[str, Any]]:
        out = torch.zeros(n, dtype=torch.float32)
        info: dict[str, Any] = {}
        for name, w in weights.items():  # summed in this order, however the answers came
            r, extra = got[name]
            r = r.detach().float().cpu()
            out += float(w) * r
            info[f"reward/{name}"] = r
            info.update({f"reward/{name}/{k}": v for k, v in extra.items()})
        return out, info

    def fn(images, prompts, metadata, groups=None):
        return total(len(prompts), {name: whole(name, images, prompts, metadata, groups) for name in weights})

    fn.groupwise = any(getattr(f, "kind", "pointwise") == "groupwise" for f in fns.values())
    fn.beside = any(getattr(f, "beside_policy", False) for f in fns.values())
    fn.begin = lambda prompts, metadata, groups=None: Scoring(fns, prompts, metadata, groups, whole, total)
    return fn


class Scoring:
    """One batch's training reward, scored as its images arrive: :meth:`add` the next rows as they are sampled,
    :meth:`result` once all are; :meth:`close` if the batch is abandoned. The rewards that may run beside the policy
    are called as soon as a call's images are all there, on a pool of the largest ``max_in_flight`` among them; the
    others, and every reward on clips, are called in :meth:`result` on the whole batch, exactly as ``fn`` calls them."""

    def __init__(self, fns: Mapping[str, RewardFn], prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]],
                 groups: torch.Tensor | Sequence[int] | None, whole: Callable[..., Answer],
                 total: Callable[[int, Mapping[str, Answer]], tuple[torch.Tensor, dict[str, Any]]]) -> None:
        self.fns, self.prompts, self.metadata, self.groups = fns, list(prompts), list(metadata), groups
        self.whole, self.total, self.n = whole, total, len(self.prompts)
        self.parts: list[torch.Tensor] = []  # the rows added so far, part by part
        self.sampled, self.clips = 0, False
        # each beside reward's calls (their rows, in the order the whole batch would make them) and those sent
        self.plans: dict[str, list[list[int]]] = {}
        for name, f in fns.items():
            if not getattr(f, "beside_policy", False):
                continue
            if getattr(f, "kind", "pointwise") == "groupwise":
                self.plans[name] = group_members(name, groups, self.n)
            else:
                size = getattr(f, "request_size", None) or self.n
                self.plans[name] = [list(range(a, min(a + size, self.n))) for a in range(0, self.n, size)]
        self.sent: dict[str, list[concurrent.futures.Future]] = {name: [] for name in self.plans}
        workers = max([getattr(fns[name], "max_in_flight", 1) for name in self.plans], default=0)
        self.pool = Pool(workers, "jagg-scoring") if workers else None

    def add(self, images: torch.Tensor) -> None:
        """The batch's next rows ``images`` (b, 3, H, W), in batch order: the calls they complete are sent now; a call
        sent earlier that failed is raised here (its one sentence), so a dead judge stops the rollout early."""
        if self.sampled + len(images) > self.n:
            raise ValueError(f"got {self.sampled + len(images)} images for a batch of {self.n}.")
        self.parts.append(images)
        self.sampled += len(images)
        self.clips = self.clips or images.ndim == 5  # clips: scored whole, in result()
        if self.pool is not None and not self.clips:
            for name, plan in self.plans.items():
                sent = self.sent[name]
                while len(sent) < len(plan) and plan[len(sent)][-1] < self.sampled:
                    rows = plan[len(sent)]
                    sent.append(self.pool.submit(self.fns[name], self._take(rows), [self.prompts[i] for i in rows],
                                                 [self.metadata[i] for i in rows]))
        error = failure([f for sent in self.sent.values() for f in sent])
        if error is not None:
            self.close()
            raise error

    def result(self) -> tuple[torch.Tensor, dict[str, Any]]:
        """The batch's total reward and info, as ``fn`` gives them for the whole batch."""
        import torch

        if self.sampled != self.n:
            raise ValueError(f"the batch of {self.n} images is scored with only {self.sampled} added.")
        try:
            images = self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)
            args = (images, self.prompts, self.metadata, self.groups)
            # the rewards beside the policy were sent as their images came; the others run here, while any of those
            # requests still out are answered
            besides = {name for name, sent in self.sent.items() if sent}
            got = {name: self.whole(name, *args) for name in self.fns if name not in besides}
            for name in besides:
                parts = answers(self.sent[name])
                kind = getattr(self.fns[name], "kind", "pointwise")
                got[name] = placed(name, self.n, self.plans[name], parts) if kind == "groupwise" else _joined(parts)
            return self.total(self.n, {name: got[name] for name in self.fns})
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the calls not yet started; those in flight end at their own deadlines, nobody waiting for them (on
        daemon threads: they do not hold the process open)."""
        for sent in self.sent.values():
            for f in sent:
                f.cancel()

    def _take(self, rows: list[int]) -> torch.Tensor:
        """The images of ``rows`` (consecutive ones: slices of the parts they span; no copy if one part holds them)."""
        import torch

        a, b = rows[0], rows[-1] + 1
        if rows != list(range(a, b)):
            return torch.cat(self.parts)[torch.tensor(rows)]
        pieces, start = [], 0
        for part in self.parts:
            lo, hi = max(a, start), min(b, start + len(part))
            if lo < hi:
                pieces.append(part[lo - start : hi - start])
            start += len(part)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _joined(parts: Sequence[Answer]) -> Answer:
    """A pointwise reward's answers for consecutive slices of a batch, as one answer for the batch: the scores and the
    per-image extras concatenated, a scalar extra averaged over the calls."""
    import torch

    if len(parts) == 1:
        return parts[0]
    sizes = [int(r.numel()) for r, _ in parts]
    scores = torch.cat([r.detach().float().cpu().reshape(-1) for r, _ in parts])
    info: dict[str, Any] = {}
    for key in parts[0][1]:
        values = [extra.get(key) for _, extra in parts]
        if all(isinstance(v, torch.Tensor) and v.ndim == 1 and v.numel() == s for v, s in zip(values, sizes)):
            info[key] = torch.cat([v.detach().float().cpu() for v in values])
        elif all(isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1) for v in values):
            info[key] = sum(float(v) for v in values) / len(values)
    return scores, info
