"""examples/flow_grpo_sd3/train.py, the trainer in Flow-GRPO's shape, held to what docs/trainers.md says of it.

Its JAGG-off path (W = 1) is Flow-GRPO's per-step loop bit for bit and steps the optimizer after the same
micro-batches; JAGG (W = 4) steps after them too, with one backward per group; a GradScaler steps (the same weights
as without one) and skips an inf step; two DDP processes (gloo) make one all-reduce per micro-batch and the one-process
gradient.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "flow_grpo_sd3" / "train.py"
_spec = importlib.util.spec_from_file_location("flow_grpo_sd3_example", EXAMPLE)  # a script, not a package
example = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up
_spec.loader.exec_module(example)


def run(**kw) -> dict:
    """One training of the example in this process (accelerate's process-wide state reset first)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return example.train(example.Config(cpu=True, **kw))


# 8 images (2 prompts × 4), micro-batches of 2, two micro-batches per optimizer step: steps after micro-batches 1, 3
SETTING = dict(gradient_accumulation_steps=2, train_batch_size=2)


@pytest.fixture(scope="module")
def per_step():
    return run(per_step=True, **SETTING)


def test_jagg_off_is_flow_grpos_per_step_loop_bit_for_bit_and_jagg_steps_after_the_same_micro_batches(per_step):
    off = run(window=1, **SETTING)
    assert per_step["optimizer_steps_after"] == off["optimizer_steps_after"] == [1, 3]
    assert all(torch.equal(a, b) for a, b in zip(per_step["grads"], off["grads"]))
    assert torch.equal(per_step["weights"], off["weights"])
    assert len(per_step["kl_loss"]) == 4 * 9 and min(per_step["kl_loss"]) > 0  # 9 of 10 steps, a real KL
    jagg = run(window=4, **SETTING)
    assert jagg["optimizer_steps_after"] == [1, 3]  # not after micro-batches 2 and 5: the batch is Flow-GRPO's
    assert len(jagg["kl_loss"]) == 4 * 3  # three groups (0-3, 4-7 through JAGG, 8 exact) per micro-batch
    first_exact, first_jagg = per_step["grads"][0], jagg["grads"][0]  # the same weights and data
    cos = float(torch.nn.functional.cosine_similarity(first_jagg, first_exact, dim=0))
    print(f"JAGG (W = 4) vs exact, first update: cos {cos:.4f}, norm ratio "
          f"{float(first_jagg.norm() / first_exact.norm()):.4f}")
    assert 0.9 < cos < 1.0


def test_a_grad_scaler_steps_as_without_one_and_skips_an_inf_step(per_step, monkeypatch):
    scaled = run(per_step=True, grad_scaler=True, **SETTING)
    assert scaled["skipped"] == [False, False] and scaled["scale"] == [2.0**10, 2.0**10]
    assert torch.equal(scaled["weights"], per_step["weights"])  # scale 2^10, unscaled exactly
    build = example.build_transformer

    def poisoned(config):  # an inf gradient in the first update's backward passes only
        model = build(config)
        first = next(p for p in model.parameters() if p.requires_grad)
        first.register_hook(lambda g: g * float("inf") if not config.log["optimizer_steps_after"] else g)
        return model

    monkeypatch.setattr(example, "build_transformer", poisoned)
    jagg = run(window=4, grad_scaler=True, **SETTING)
    assert jagg["skipped"] == [True, False] and jagg["scale"] == [2.0**9, 2.0**9]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_ddp_processes_make_one_allreduce_per_micro_batch_and_the_one_process_gradient(tmp_path):
    """accelerate launch, 2 processes on gloo: each process's 4 images in 2 micro-batches, one optimizer step each;
    JAGG's 3 groups per micro-batch make 3 backward calls and exactly one gradient sync (accumulate's no_sync)."""
    out = tmp_path / "log.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
           "--multi_gpu", "--main_process_port", str(_free_port()), str(EXAMPLE), "--cpu", "--window", "4",
           "--train-batch-size", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1)]
    for log in logs:
        assert log["optimizer_steps_after"] == [0, 1]
        assert len(log["allreduces"]) == 2  # one per micro-batch: 6 backward calls, 2 synced
    one = run(window=4, train_batch_size=2, gradient_accumulation_steps=2)
    for synced, alone in zip(logs[0]["grads"], one["grads"]):
        synced = torch.tensor(synced)
        assert float((synced - alone).norm() / alone.norm()) < 1e-5
    assert torch.equal(torch.tensor(logs[0]["weights"]), torch.tensor(logs[1]["weights"]))
