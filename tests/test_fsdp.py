"""One JAGG update under FSDP2 (`fully_shard`, gloo, 2 CPU processes) matches the unsharded gradient."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from jagg_core.setup.params_io import load_params

REPO = Path(__file__).resolve().parents[1]


def _flat_grads(policy) -> torch.Tensor:
    out = []
    for p in policy.trainable_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out.append((g.full_tensor() if hasattr(g, "full_tensor") else g).detach().reshape(-1).double())
    return torch.cat(out)


def _worker(rank: int, folder: str, variant_name: str) -> None:
    from jagg_core.bench import bench_method, build_policy, make_experience, model_spec
    from jagg_core.bench.models import run_update, update_groups, zero_grads
    from jagg_core.trainer.distributed import Fsdp2Sync, shard_transformer

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    try:
        params = load_params(REPO / "params.yaml", "ci")
        spec = model_spec("toy", params, device="cpu")
        policy = build_policy(spec)
        exp = make_experience(policy, spec, steps=8, batch=4, seed=3)
        m = bench_method(variant_name, 4)
        groups = update_groups(exp, m)
        halves = [torch.tensor([0, 1]), torch.tensor([2, 3])]
        # The unsharded reference: the mean of the two halves' gradients (what data parallelism must produce).
        ref = []
        for half in halves:
            zero_grads(policy)
            exp.rows = half
            run_update(policy, exp, m, groups)
            ref.append(_flat_grads(policy))
        reference = (ref[0] + ref[1]) / 2
        # The same update sharded: each rank its half, gradient sync (reduce-scatter, averaged) in the last backward.
        zero_grads(policy)
        shard_transformer(policy.transformer)
        exp.rows = halves[rank]
        stats = run_update(policy, exp, m, groups, sync=Fsdp2Sync(policy.transformer))
        sharded = _flat_grads(policy)
        if rank == 0:
            err = float((sharded - reference).norm() / reference.norm())
            (Path(folder) / "result.json").write_text(json.dumps({"rel_err": err, "backward_calls": stats.backward_calls,
                                                                  "norm": float(reference.norm())}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("variant_name,backward_calls", [("jagg-joint", 2), ("jagg-sequential", 4)])
def test_one_jagg_update_under_fsdp2_matches_the_unsharded_gradient(tmp_path, variant_name, backward_calls):
    mp.spawn(_worker, args=(str(tmp_path), variant_name), nprocs=2, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["norm"] > 0
    assert result["backward_calls"] == backward_calls  # 2 groups of W = 4: one (joint) or two (sequential) each
    assert result["rel_err"] <= 1e-5, result
