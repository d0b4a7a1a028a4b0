"""What JAGG saves inside a trainer of Flow-GRPO's shape, measured on CPU (docs/trainers.md's table).

1. The backward's cost in forwards, b, on a small random SD3 transformer: a full fine-tune, LoRA (peft, Flow-GRPO's
   targets) and LoRA with gradient checkpointing. The cost model (jagg_core.cost.backward_factor) takes 2, 1 and 2.
2. The update stage of examples/flow_grpo_sd3/train.py (its transformer at the size of 1.), its per-step loop against JAGG (W = 4) at Flow-GRPO's settings
   (9 of 10 steps trained, β 0.04 with its reference forward per step, LoRA, CFG), jagg_frac 1.0 and 0.6, beside
   the cost model's prediction with the measured b.

Each figure is the median of interleaved rounds, one torch thread, timed by the thread's CPU time (a busy machine
slows the wall clock, not the work):

    OMP_NUM_THREADS=1 .venv/bin/python scripts/trainer_costs.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("flow_grpo_sd3_example", REPO / "examples/flow_grpo_sd3/train.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def backward_factors(rounds: int) -> dict[str, float]:
    """b = backward seconds / forward seconds (with a graph) of one batch through a small SD3 transformer."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig, get_peft_model

    def model(kind: str) -> torch.nn.Module:
        torch.manual_seed(0)
        m = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=32,
                                  num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=128,
                                  pooled_projection_dim=64, out_channels=4, pos_embed_max_size=16)
        if kind == "full":
            return m
        m.requires_grad_(False)
        if kind == "lora+ckpt":
            m.enable_gradient_checkpointing()
        targets = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                   "attn.to_out.0", "attn.to_q", "attn.to_v"]
        return get_peft_model(m, LoraConfig(r=8, lora_alpha=16, target_modules=targets))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, 16, 16, generator=g)
    enc, pooled, t = torch.randn(4, 12, 64, generator=g), torch.randn(4, 64, generator=g), torch.full((4,), 500.0)
    models = {k: model(k) for k in ("full", "lora", "lora+ckpt")}
    for m in models.values():
        m.train()
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(rounds + 1):  # the first round warms up
        for kind, m in models.items():
            t0 = time.thread_time()
            out = m(hidden_states=x, timestep=t, encoder_hidden_states=enc, pooled_projections=pooled,
                    return_dict=False)[0]
            t1 = time.thread_time()
            out.backward(torch.ones_like(out))
            t2 = time.thread_time()
            m.zero_grad(set_to_none=True)
            times[kind].append((t2 - t1) / (t1 - t0))
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def update_speedups(rounds: int) -> dict[str, float]:
    """Median seconds of the example's update stage (its micro-batches' training, not the rollout) per setting."""
    example = _example()
    from accelerate.state import AcceleratorState, GradientState

    spent: list[float] = []
    train_micro_batch = example.train_micro_batch

    def timed(*args, **kw):
        t0 = time.thread_time()
        train_micro_batch(*args, **kw)
        spent.append(time.thread_time() - t0)

    example.train_micro_batch = timed
    settings = {"per-step": dict(per_step=True), "jagg W=4, jagg_frac 1.0": dict(window=4, jagg_frac=1.0),
                "jagg W=4, jagg_frac 0.6": dict(window=4, jagg_frac=0.6)}
    times: dict[str, list[float]] = {k: [] for k in settings}
    for _ in range(rounds + 1):
        for name, kw in settings.items():
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            spent.clear()
            example.train(example.Config(cpu=True, train_batch_size=4, num_layers=4, head_dim=32, latent_size=16,
                                         **kw))
            times[name].append(sum(spent))
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def predicted(b: float, grad: int, nograd: int, reference: int = 9, steps: int = 9) -> float:
    """Exact's cost over the method's: graphs cost 1 + b, no-grad and reference forwards 1."""
    return (steps * (1 + b) + reference) / (grad * (1 + b) + nograd + reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    b = backward_factors(args.rounds)
    print("backward / forward (b), medians of", args.rounds, "rounds:")
    for kind, x in b.items():
        print(f"  {kind:<10} {x:.2f}")
    secs = update_speedups(args.rounds)
    base = secs["per-step"]
    # 9 trained steps; W = 4 at jagg_frac 1.0: groups 0-3, 4-7 through JAGG, step 8 exact (5 graphs, 4 no-grad);
    # at 0.6: round(0.6 · 2) = 1 group through JAGG (7 graphs, 2 no-grad)
    counts = {"per-step": (9, 0), "jagg W=4, jagg_frac 1.0": (5, 4), "jagg W=4, jagg_frac 0.6": (7, 2)}
    print("the example's update stage (CPU seconds, medians), its speedup over the per-step loop, and the cost model's "
          f"with b = {b['lora']:.2f} (LoRA, measured) and b = 2 (full fine-tune):")
    for name, s in secs.items():
        print(f"  {name:<26} {s:6.2f} s  {base / s:.2f}x  (model {predicted(b['lora'], *counts[name]):.2f}x; "
              f"b = 2: {predicted(2.0, *counts[name]):.2f}x)")


if __name__ == "__main__":
    main()
