"""docs/trainers.md ("JAGG in your trainer"): every Python snippet runs as printed, in order, in one namespace (each
block builds on the ones before it and asserts what the page claims)."""

from __future__ import annotations

import re
import socket

import pytest
import torch

from conftest import REPO

PAGE = REPO / "docs" / "trainers.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_page_has_a_snippet_for_each_way_a_trainer_backpropagates():
    text = "\n".join(blocks())
    for needle in ("group_surrogate(", "accelerator.backward(", "scaler.scale(", "no_sync()", "backward=lambda",
                   'kl_convention="flow_grpo"', 'subset="prefix"'):
        assert needle in text, needle


@pytest.fixture
def one_process_group():
    """A one-process gloo group for the DDP snippet (torch.distributed's real DDP, one rank)."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        AcceleratorState._reset_state(True)  # the accelerate snippet's process-wide state
        GradientState._reset_state()


def test_every_snippet_runs_as_printed(one_process_group):
    namespace: dict = {}
    found = blocks()
    assert len(found) >= 7
    for i, code in enumerate(found):
        try:
            exec(compile(code, f"{PAGE.name} block {i + 1}", "exec"), namespace)
        except Exception as e:  # name the block that failed
            raise AssertionError(f"{PAGE.name}'s python block {i + 1} failed: {e!r}\n{code}") from e
    assert isinstance(namespace["cos"], torch.Tensor) and float(namespace["cos"]) > 0.9
