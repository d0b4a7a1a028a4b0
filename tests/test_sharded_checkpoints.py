"""Sharded checkpoints under FSDP2 (gloo, 2 CPU processes): each rank writes its own shards, no rank holds the full
state while saving, a killed run resumes to the same weights, and `jagg export` turns the shards into a diffusers
transformer folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import REPO, run_module
from tasks.common import free_port
from jagg_core.setup.paths import Layout
from jagg_core.trainer.checkpoint import latest_checkpoint, list_checkpoints, verify_checkpoint

# A Flux transformer big enough (~36 M parameters; ~0.58 GB of weights, Adam state and EMA in float32) that the
# state's size stands out of the process's allocator noise, small enough to build in a second.
FLUX = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=64,
            num_attention_heads=8, joint_attention_dim=256, pooled_projection_dim=128, axes_dims_rope=(16, 24, 24))


def _status(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux ≥ 4.0)


def _local_bytes(tensors) -> int:
    return sum(getattr(t, "_local_tensor", t).numel() * t.element_size() for t in tensors)


def _worker(rank: int, folder: str) -> None:
    from diffusers import FluxTransformer2DModel

    from jagg_core.trainer.sharded import load_sharded_state, save_sharded_checkpoint
    from jagg_core.trainer.distributed import shard_transformer

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    out = Path(folder)
    try:
        torch.manual_seed(0)
        model = shard_transformer(FluxTransformer2DModel(**FLUX))
        params = [p for p in model.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-3)
        g = torch.Generator().manual_seed(1)
        for p in params:  # one optimizer step with made-up gradients: Adam's state exists and differs from zero
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            p.grad = torch.distributed.tensor.distribute_tensor(p.grad, p.device_mesh, p.placements)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = {n: p.detach().float().clone() * 0.5 for n, p in model.named_parameters()}
        full_bytes = 4 * sum(p.numel() * p.element_size() for p in params)  # weights + exp_avg + exp_avg_sq + EMA
        local = _local_bytes(params) * 4
        state = {"run_key": "test", "policy_version": 1}

        # The sharded save, its peak resident memory above what the process held before.
        dist.barrier()
        before = _status("VmRSS")
        _reset_peak()
        save_sharded_checkpoint(out / "ckpts", 1, module=model, optimizer=opt, state=state, ema=ema)
        sharded_peak = _status("VmHWM") - before
        # For comparison, what a full-state save gathers on every rank (what the trainer did before).
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        from jagg_core.policies.lora import trainable_state_dict

        dist.barrier()
        before = _status("VmRSS")
        _reset_peak()
        full_weights = trainable_state_dict(model)
        full_opt = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                                 cpu_offload=True))
        full_ema = {n: t.full_tensor() for n, t in ema.items()}
        gathered_peak = _status("VmHWM") - before

        # Resume into a freshly built, differently initialised sharded model: the same shards, the same Adam state.
        torch.manual_seed(1)
        model2 = shard_transformer(FluxTransformer2DModel(**FLUX))
        opt2 = torch.optim.AdamW(list(model2.parameters()), lr=1e-3)
        ema2 = {n: torch.zeros_like(t) for n, t in ema.items()}
        ckpt = list_checkpoints(out / "ckpts")[-1]
        load_sharded_state(ckpt, model2, opt2, ema2)
        same = all(torch.equal(a._local_tensor, b._local_tensor)
                   for a, b in zip(model.parameters(), model2.parameters()))
        same_opt = all(torch.equal(opt.state[a][k]._local_tensor, opt2.state[b][k]._local_tensor)
                       for a, b in zip(model.parameters(), model2.parameters()) for k in ("exp_avg", "exp_avg_sq"))
        same_ema = all(torch.equal(ema[n]._local_tensor, ema2[n]._local_tensor) for n in ema)
        if rank == 0:
            from safetensors.torch import save_file

            save_file(full_weights, out / "full.safetensors")
            save_file(full_ema, out / "full_ema.safetensors")
            step = {k: v for k, v in full_opt["state"].items()}
            (out / "result.json").write_text(json.dumps({
                "sharded_peak": sharded_peak, "gathered_peak": gathered_peak, "full_bytes": full_bytes,
                "local_bytes": local, "same": same, "same_opt": same_opt, "same_ema": same_ema,
                "opt_entries": len(step)}))
        else:
            (out / "result1.json").write_text(json.dumps({"sharded_peak": sharded_peak, "local_bytes": local,
                                                          "same": same, "same_opt": same_opt, "same_ema": same_ema}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_save_holds_one_shard_per_rank_and_resumes_exactly(tmp_path):
    """2 gloo ranks, a 36 M-parameter Flux: the save's peak host memory per rank stays near its own half of the state
    (the full-state gather the trainer used to do is measured beside it), the files read back as the full tensors,
    and loading into a fresh sharded model restores every shard and Adam's state bit for bit."""
    from safetensors.torch import load_file

    mp.spawn(_worker, args=(str(tmp_path),), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "result.json").read_text())
    r1 = json.loads((tmp_path / "result1.json").read_text())
    full = r0["full_bytes"]
    assert full > 500e6, full  # the state is large beside the allocator's noise
    for r in (r0, r1):
        assert r["same"] and r["same_opt"] and r["same_ema"], r
        # ≤ 1/N of the full state + slack (DCP's per-tensor staging and metadata): 10% of the full state.
        assert r["sharded_peak"] <= full / 2 + 0.1 * full, (r["sharded_peak"] / full, r)
    assert r0["gathered_peak"] >= 0.5 * full, r0  # the old way holds (at least) the full weights and Adam state
    print(f"\npeak host memory of a rank while saving, as a share of the full state ({full / 1e6:.0f} MB): sharded "
          f"{r0['sharded_peak'] / full:.2f} / {r1['sharded_peak'] / full:.2f}, full gather "
          f"{r0['gathered_peak'] / full:.2f}")
    ckpt = latest_checkpoint(tmp_path / "ckpts")
    assert ckpt is not None and ckpt.sharded and verify_checkpoint(ckpt.path) is None
    files = sorted(p.name for p in (ckpt.path / "dcp").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # every rank wrote its own file
    manifest = json.loads((ckpt.path / "manifest.json").read_text())
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "state.json"} == set(manifest)
    for name, want in (("trainable", load_file(tmp_path / "full.safetensors")),
                       ("ema", load_file(tmp_path / "full_ema.safetensors"))):
        got = ckpt.tensors(name)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), name
    # A shard that does not match its checksum makes the checkpoint unusable (resume falls back past it).
    with open(ckpt.path / "dcp/__1_0.distcp", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    assert "dcp/__1_0.distcp does not match its recorded checksum" == verify_checkpoint(ckpt.path)
    assert latest_checkpoint(tmp_path / "ckpts") is None


FSDP = ["--profile", "ci", "--method", "jagg", "--seed", "0", "--set", "reward.weights={toy_background: 1.0}",
        "--set", "train.iterations=4", "--set", "train.checkpoint_every=1", "--set", "resources.distributed=fsdp"]


def _env(root: Path, extra: dict | None = None) -> dict:
    return {**os.environ, "JAGG_ROOT": str(root), "PYTHONPATH": str(REPO), **(extra or {})}


def _launch_fsdp(root: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           "-m", "tasks.train", "--worker", *FSDP]
    return subprocess.run(cmd, cwd=root, env=_env(root, env), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def fsdp_run(ci_base, tmp_path_factory) -> Path:
    """A project root where jagg-s0 trained 4 iterations under FSDP2 on 2 gloo processes of one machine."""
    root = tmp_path_factory.mktemp("fsdp") / "project"
    shutil.copytree(ci_base, root)
    done = _launch_fsdp(root)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.mark.slow
def test_fsdp_training_killed_mid_checkpoint_resumes_to_identical_weights_and_exports(ci_base, fsdp_run, tmp_path):
    """The trainer under FSDP2 on 2 gloo processes: out of space while writing checkpoint 2, it stops with one
    sentence and leaves checkpoint 1 and nothing else; started again and killed while writing checkpoint 3, then
    started again, it resumes from checkpoint 2 and ends bit for bit where an uninterrupted run ends; `jagg export`
    reads the shards back into a transformer folder diffusers loads."""
    from diffusers import FluxTransformer2DModel

    two = tmp_path / "two"
    shutil.copytree(ci_base, two)
    run_dir = Layout(two, "ci").checkpoints("jagg-s0")
    full = _launch_fsdp(two, {"JAGG_FAULT": "checkpoint@2:oserror"})
    assert full.returncode != 0
    assert (f"jagg: error: could not write checkpoint 2 under {run_dir} (No space left on device (injected)); "
            f"earlier checkpoints are intact.") in full.stdout + full.stderr
    assert "Traceback" not in full.stdout.split("jagg: error:")[0]
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint-000001"]  # no partial folder left
    killed = _launch_fsdp(two, {"JAGG_FAULT": "checkpoint@3:kill"})
    assert killed.returncode != 0
    assert [c.iteration for c in list_checkpoints(run_dir)] == [1, 2]
    assert (run_dir / ".tmp-checkpoint-000003-sharded").is_dir()  # the interrupted write, never mistaken for one
    resumed = _launch_fsdp(two)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming jagg-s0 from" in resumed.stdout + resumed.stderr
    assert "checkpoint-000002 (iteration 2)" in resumed.stdout + resumed.stderr
    a = latest_checkpoint(Layout(fsdp_run, "ci").checkpoints("jagg-s0"))
    b = latest_checkpoint(run_dir)
    assert a.iteration == b.iteration == 4 and a.sharded and b.sharded
    assert not (b.path / "trainable.safetensors").exists()  # nothing was gathered into one file
    wa, wb = a.tensors(), b.tensors()
    assert wa and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not (run_dir / ".tmp-checkpoint-000003-sharded").exists()
    rows = Layout(two, "ci").curve("jagg-s0").read_text().splitlines()
    assert [r.split("\t")[0] for r in rows[1:]] == ["1", "2", "3", "4"]

    out = run_module("tasks.export", "--profile", "ci", "--run", "jagg-s0", root=two)
    assert out.returncode == 0, out.stderr[-2000:]
    got = FluxTransformer2DModel.from_pretrained(two / "exports/ci/jagg-s0-step4/transformer").state_dict()
    assert all(torch.equal(got[k], v) for k, v in wb.items())


@pytest.mark.slow
def test_one_run_on_two_machines_over_loopback(ci_base, fsdp_run, tmp_path):
    """Two "machines" × 1 process on 127.0.0.1: each started with `jagg train`, machine 0 by --machine-rank and
    --main-process-ip, machine 1 by JAGG_MACHINE_RANK / JAGG_MAIN_PROCESS_IP; they train one run together, each
    writing its own shards into the shared checkpoint folder, and end bit for bit where 2 processes of one machine
    end. Started again, machine 1 sees the run is trained and does nothing."""
    root = tmp_path / "project"
    shutil.copytree(ci_base, root)
    args = [sys.executable, "-m", "tasks.train", *[a for a in FSDP], "--set", "resources.num_machines=2"]
    port = str(free_port())
    m0 = subprocess.Popen([*args, "--machine-rank", "0", "--main-process-ip", "127.0.0.1", "--main-process-port",
                           port], cwd=root, env=_env(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    env1 = {"JAGG_MACHINE_RANK": "1", "JAGG_MAIN_PROCESS_IP": "127.0.0.1", "JAGG_MAIN_PROCESS_PORT": port}
    m1 = subprocess.run(args, cwd=root, env=_env(root, env1), capture_output=True, text=True, timeout=600)
    out0 = m0.communicate(timeout=600)[0]
    assert m0.returncode == 0, out0[-3000:]
    assert m1.returncode == 0, (m1.stdout + m1.stderr)[-3000:]
    assert "launching jagg-s0 as machine 0 of 2 (rank 0 at 127.0.0.1)" in out0
    assert "launching jagg-s0 as machine 1 of 2 (rank 0 at 127.0.0.1)" in m1.stdout + m1.stderr
    ckpt = latest_checkpoint(Layout(root, "ci").checkpoints("jagg-s0"))
    assert ckpt.iteration == 4 and ckpt.state()["world_size"] == 2
    assert sorted(p.name for p in (ckpt.path / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    want = latest_checkpoint(Layout(fsdp_run, "ci").checkpoints("jagg-s0")).tensors()
    got = ckpt.tensors()
    assert all(torch.equal(got[k], want[k]) for k in want)
    again = subprocess.run(args, cwd=root, env=_env(root, env1), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "jagg-s0 is trained (4 iterations); nothing to do on machine 1" in (
        again.stdout + again.stderr)


@pytest.mark.parametrize("argv,env,message", [
    (["--machine-rank", "2"], {}, "machine rank 2 must be in 0..1 (resources.num_machines is 2)."),
    (["--machine-rank", "1"], {}, "resources.num_machines is 2: give every machine the rank-0 machine's address with "
                                  "--main-process-ip or JAGG_MAIN_PROCESS_IP."),
    ([], {"JAGG_MACHINE_RANK": "one"}, "JAGG_MACHINE_RANK='one' must be a whole number (or pass --machine-rank)."),
    (["--set", "resources.machine_rank=1"], {}, "machine_rank differs per machine and is not read from params.yaml: "
                                                "pass --machine-rank to `jagg train` or set JAGG_MACHINE_RANK."),
])
def test_machine_settings_come_from_the_command_line_or_environment(ci_project, argv, env, message):
    out = run_module("tasks.train", "--profile", "ci", "--method", "jagg", "--set", "resources.num_machines=2", *argv,
                     root=ci_project, env=env)
    assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_on_another_number_of_processes(fsdp_run, tmp_path):
    """Checkpoint 2 of the 2-process FSDP run, resumed in one process (DCP reshards on load): iterations 3 and 4 end
    where the 2-process run ends, up to float32 reduction order."""
    root = tmp_path / "project"
    shutil.copytree(fsdp_run, root)
    run_dir = Layout(root, "ci").checkpoints("jagg-s0")
    for it in (3, 4):
        shutil.rmtree(run_dir / f"checkpoint-00000{it}")
    out = run_module("tasks.train", "--worker", *FSDP, root=root)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "checkpoint-000002 (iteration 2)" in out.stdout + out.stderr
    want = latest_checkpoint(Layout(fsdp_run, "ci").checkpoints("jagg-s0")).tensors()
    got = latest_checkpoint(run_dir)
    assert got.iteration == 4 and not got.sharded  # one process writes the full state
    tensors = got.tensors()
    moved = max(float((want[k] - load_base(root)[k]).abs().max()) for k in want)
    # Reduction order alone: a few float32 ulps of the weights (1 ulp at |w| ~ 1 is 6e-8; measured 1.5e-8 with torch's
    # default threads, 6e-8 single-threaded), 1e-3 of what four iterations move them, far below any change of method.
    assert max(float((tensors[k] - want[k]).abs().max()) for k in want) <= 1e-3 * moved


def load_base(root: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(root / "models/ci/base/transformer/diffusion_pytorch_model.safetensors")


@pytest.mark.slow
def test_a_full_checkpoint_with_ema_resumes_under_fsdp(ci_base, tmp_path):
    """Checkpoints written by one process (full tensors, EMA on) resume under FSDP2 on 2 processes: the EMA is sharded
    like its parameters and keeps averaging; the next checkpoint is sharded and holds both."""
    root = tmp_path / "project"
    shutil.copytree(ci_base, root)
    ema = ["--set", "train.ema_decay=0.9"]
    one = run_module("tasks.train", "--worker", *FSDP, *ema, "--set", "train.iterations=2", root=root)
    assert one.returncode == 0, one.stderr[-2000:]
    run_dir = Layout(root, "ci").checkpoints("jagg-s0")
    before = latest_checkpoint(run_dir)
    assert before.iteration == 2 and not before.sharded and before.has("ema")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(free_port()), "-m", "tasks.train", "--worker", *FSDP, *ema, "--set", "train.iterations=3"]
    two = subprocess.run(cmd, cwd=root, env=_env(root), capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    after = latest_checkpoint(run_dir)
    assert after.iteration == 3 and after.sharded and after.has("ema")
    old, new, weights = before.tensors("ema"), after.tensors("ema"), after.tensors()
    k = next(iter(weights))
    # EMA(3) = 0.9 EMA(2) + 0.1 W(3): it kept averaging from the loaded EMA.
    torch.testing.assert_close(new[k], 0.9 * old[k] + 0.1 * weights[k].float(), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_machines_started_with_other_params_stop_with_one_sentence(ci_base, tmp_path):
    """Two "machines" whose params differ (here one extra --set on machine 1): every process stops with the same
    sentence naming the difference; none is left waiting."""
    root = tmp_path / "project"
    shutil.copytree(ci_base, root)
    args = [sys.executable, "-m", "tasks.train", *FSDP, "--set", "resources.num_machines=2",
            "--main-process-ip", "127.0.0.1", "--main-process-port", str(free_port())]
    m0 = subprocess.Popen([*args, "--machine-rank", "0"], cwd=root, env=_env(root), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    m1 = subprocess.run([*args, "--machine-rank", "1", "--set", "train.lr=0.5"], cwd=root, env=_env(root),
                        capture_output=True, text=True, timeout=600)
    out0 = m0.communicate(timeout=600)[0]
    sentence = "process 1 was started with other settings than process 0 (train.lr "
    assert m0.returncode == 1 and sentence in out0, out0[-3000:]
    assert m1.returncode == 1 and sentence in m1.stdout + m1.stderr, (m1.stdout + m1.stderr)[-3000:]
