"""Groupwise rewards: declared at registration, called once per prompt group with exactly that group's images (the
trainer's rollout scoring), refused as evaluation metrics; pointwise rewards still called once per batch."""

from __future__ import annotations

import contextlib

import pytest
import torch

from jagg_core.rewards import (RewardError, check_rewards, make_metric, make_reward, make_weighted_reward,
                               pairwise_wins, register_reward, reward_kind)
from jagg_core.rewards import available_rewards, base as reward_base
from jagg_core.setup.registry import remove


@contextlib.contextmanager
def registered(name: str, factory, kind: str = "pointwise"):
    """``factory`` registered as reward ``name`` for the block (the registry is process-wide)."""
    register_reward(name, kind=kind)(factory)
    try:
        yield
    finally:
        remove("reward", name)
        for key in [k for k in reward_base._BUILT if k[0] == name]:
            del reward_base._BUILT[key]


def _tagged(n: int) -> torch.Tensor:
    """``n`` images whose pixels all hold their batch index / 100: a reward can tell which images it got."""
    return (torch.arange(n, dtype=torch.float32) / 100)[:, None, None, None].expand(n, 3, 4, 4).clone()


def _index(images: torch.Tensor) -> list[int]:
    return [round(float(v) * 100) for v in images[:, 0, 0, 0]]


def test_a_groupwise_reward_gets_each_prompts_whole_group_and_pointwise_ones_the_whole_batch():
    calls = {"group": [], "point": []}

    def group_factory():
        def fn(images, prompts, metadata):
            calls["group"].append((_index(images), list(prompts), [m["i"] for m in metadata]))
            # a ranking within the group: the later image scores higher; extras per image and a scalar
            return torch.arange(len(prompts), dtype=torch.float32), {"seen": torch.full((len(prompts),), 1.0 * len(prompts)),
                                                                     "calls": 1.0}
        return fn

    def point_factory():
        def fn(images, prompts, metadata):
            calls["point"].append(_index(images))
            return torch.tensor(_index(images), dtype=torch.float32), {}
        return fn

    groups = torch.tensor([7, 7, 7, 2, 2, 2, 9, 9, 9])  # as a rollout lays them out: G images per prompt
    prompts = [f"p{int(g)}" for g in groups]
    with registered("test_group", group_factory, "groupwise"), registered("test_point", point_factory):
        assert reward_kind("test_group") == "groupwise" and make_reward("test_group").kind == "groupwise"
        assert make_reward("test_point").kind == "pointwise"
        fn = make_weighted_reward({"test_group": 1.0, "test_point": 0.5})
        total, info = fn(_tagged(9), prompts, [{"i": i} for i in range(9)], groups=groups)
    assert calls["point"] == [list(range(9))]  # once, the whole batch
    assert calls["group"] == [([0, 1, 2], ["p7"] * 3, [0, 1, 2]), ([3, 4, 5], ["p2"] * 3, [3, 4, 5]),
                              ([6, 7, 8], ["p9"] * 3, [6, 7, 8])]
    assert info["reward/test_group"].tolist() == [0, 1, 2] * 3  # back in batch order
    assert info["reward/test_group/seen"].tolist() == [3.0] * 9 and info["reward/test_group/calls"] == 1.0
    assert torch.equal(total, info["reward/test_group"] + 0.5 * torch.arange(9, dtype=torch.float32))


def test_groups_need_not_be_contiguous_and_a_wrong_count_is_one_sentence():
    seen = []

    def factory(short: bool = False):
        def fn(images, prompts, metadata):
            seen.append(_index(images))
            return torch.zeros(len(prompts) - short), {}
        return fn

    with registered("test_group", factory, "groupwise"):
        fn = make_weighted_reward({"test_group": 1.0})
        fn(_tagged(4), ["a", "b", "a", "b"], [{}] * 4, groups=[0, 1, 0, 1])
        assert seen == [[0, 2], [1, 3]]
        with pytest.raises(ValueError, match="is groupwise: pass groups"):
            fn(_tagged(4), ["a"] * 4, [{}] * 4)
        short = make_weighted_reward({"test_group": 1.0}, {"test_group": {"short": True}})
        with pytest.raises(RewardError, match=r"'test_group' \(groupwise\) returned 1 scores for a group of 2 images"):
            short(_tagged(4), ["a"] * 4, [{}] * 4, groups=[0, 0, 1, 1])


def test_a_groupwise_reward_on_clips_ranks_each_chosen_frame_across_the_groups_clips():
    frames_seen = []

    def factory():
        def fn(images, prompts, metadata):
            frames_seen.append(tuple(images.shape))
            return images.mean((1, 2, 3)), {}
        return fn

    clips = torch.rand(4, 5, 3, 4, 4)  # (B, F, 3, H, W)
    with registered("test_group", factory, "groupwise"):
        fn = make_weighted_reward({"test_group": 1.0}, frames=[0, 4])
        total, _ = fn(clips, ["a", "a", "b", "b"], [{}] * 4, groups=[0, 0, 1, 1])
    assert frames_seen == [(2, 3, 4, 4)] * 4  # per group, per chosen frame: that frame of the group's two clips
    assert torch.allclose(total, clips[:, [0, 4]].mean((2, 3, 4)).mean(1))


def test_pairwise_wins_is_a_ranking_in_zero_one_with_ties_half():
    assert pairwise_wins(torch.tensor([0.3, 0.1, 0.2])).tolist() == [1.0, 0.0, 0.5]
    assert pairwise_wins(torch.tensor([1.0, 1.0, 0.0])).tolist() == [0.75, 0.75, 0.0]
    assert pairwise_wins(torch.tensor([5.0])).tolist() == [0.5]


def test_the_builtin_toy_fidelity_rank_ranks_toy_fidelity_within_each_group():
    from jagg_core.world import render, scene_for_prompt
    import numpy as np

    prompt = "a red circle"
    truth = torch.from_numpy(render(scene_for_prompt(prompt, np.random.default_rng(0)), 24)).permute(2, 0, 1) / 255.0
    images = torch.stack([truth, torch.zeros_like(truth), truth * 0.5 + 0.25, truth])
    fn = make_weighted_reward({"toy_fidelity_rank": 1.0})
    total, info = fn(images, [prompt] * 4, [{}] * 4, groups=[0, 0, 0, 0])
    raw = make_reward("toy_fidelity")(images, [prompt] * 4, [{}] * 4)[0]
    assert torch.equal(total, pairwise_wins(raw)) and torch.equal(info["reward/toy_fidelity_rank/fidelity"], raw)
    assert total[0] == total[3] > total[1]


def test_a_groupwise_metric_is_refused_with_one_sentence():
    for name, options in (("toy_fidelity_rank", {}), ("served", {"url": "http://127.0.0.1:9/s", "kind": "groupwise"})):
        with pytest.raises(RewardError, match=f"eval.metrics: '{name}' is a groupwise reward") as e:
            check_rewards({"toy_fidelity": 1.0}, {name: options}, [name])
        assert "\n" not in str(e.value)
        with pytest.raises(RewardError, match="evaluation draws one image per prompt"):
            make_metric(name, **options)
    check_rewards({"toy_fidelity_rank": 1.0}, {}, ["toy_fidelity"])  # as a training reward it is fine
    check_rewards({"toy_fidelity": 1.0}, {"served": {"url": "http://127.0.0.1:9/s"}}, ["served"])  # pointwise


def test_kinds_are_checked_where_they_are_declared():
    with pytest.raises(ValueError, match="kind must be one of pointwise, groupwise"):
        register_reward("test_bad_kind", kind="listwise")
    assert "test_bad_kind" not in available_rewards()


# Through the command line (a CLI training with this built-in groupwise reward beside a groupwise reward by file and
# a package's pointwise reward, one training for the three): tests/test_plugins.py.
