"""Measurements behind docs/toy_rl.md, from the toy base model (`models/toy/base`), written to a JSON file.

    python scripts/toy_rl_diagnostics.py snr --out docs/toy_rl/snr.json
    python scripts/toy_rl_diagnostics.py kl --out docs/toy_rl/kl.json
    python scripts/toy_rl_diagnostics.py step --reward toy_fidelity --out docs/toy_rl/step-toy_fidelity.json
    python scripts/toy_rl_diagnostics.py signal --out docs/toy_rl/signal.json

- ``snr``: how aligned the GRPO gradients of independent rollouts are, against the images per optimizer step and
  the prompts they come from: cos(g_a, g_b) for two rollouts of the same prompts (other SDE noise) and of different
  prompts. For a gradient g = μ + noise, E[cos] ≈ ‖μ‖² / (‖μ‖² + σ²/N): the cosine tells the signal-to-noise ratio.
- ``kl``: where the large log-ratios come from once the policy moves: after k optimizer steps on a rollout (as
  ``train.optimizer_steps_per_epoch`` does), the log-ratio of every (image, trained step) of that rollout, summarised
  per SDE step, with the share of ½·mean(log_ratio²) carried by the largest 1% of the samples.
- ``signal``: the per-image gradient signal-to-noise ratio of each reward (``jagg_core.snr.gradient_snr``) from K
  independent rollouts of random training prompts, every reward on the same images; and, for the profile's reward
  mix, the exact and the JAGG gradient of each rollout: their spread across rollouts, their cosine with the
  reference gradient (the mean exact gradient of the other K − 1 rollouts) and the size of Adam's first step.
- ``step``: one step of norm r along minus the normalised loss gradient (or its sign, as Adam's first step) and
  the reverse, judged by fresh rollouts with common random numbers on the trained prompts and on others.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from jagg_core.advantages import group_advantages  # noqa: E402
from jagg_core.build import policy_from_params, reward_from_params  # noqa: E402
from jagg_core.jagg import plan_groups  # noqa: E402
from jagg_core.setup.params_io import load_params  # noqa: E402
from jagg_core.setup.paths import Layout  # noqa: E402
from jagg_core.trainer.distributed import NoSync  # noqa: E402
from jagg_core.setup.storage import read_prompts  # noqa: E402
from jagg_core.trainer.rollout import rollout  # noqa: E402
from jagg_core.trainer.update import ImageSteps, UpdateContext, accumulate_gradients  # noqa: E402


def _setup(overrides):
    params = load_params(ROOT / "params.yaml", "toy", overrides)
    lay = Layout(ROOT, "toy")
    policy = policy_from_params(params, lay, torch.device("cpu"))
    return params, policy, read_prompts(lay.train_prompts), reward_from_params(params)


def _rollout(params, policy, prompts, reward_fn, ids, seed, iteration):
    traj = rollout(policy, [prompts[i] for i in ids], list(range(len(ids))), params.sample, seed=seed,
                   iteration=iteration)
    texts = traj.image_prompts()
    rewards, info = reward_fn(traj.images, texts, [{} for _ in texts])
    adv = group_advantages(rewards, traj.group_ids, eps=params.train.adv_eps, clip=params.train.adv_clip,
                           global_std=params.train.global_std)
    return traj, adv, info


def _grad(params, policy, traj, adv, rows=None, method_name="baseline"):
    method = params.method(method_name)
    rows = torch.arange(traj.batch_size) if rows is None else rows
    jagg_frac = 0.0 if method.mode == "exact" else float(method.jagg_frac)
    fraction = params.sample.timestep_fraction if params.sample.recipe == "dance_grpo" else 1.0  # as the trainer
    groups = plan_groups(traj.train_steps, method.window, jagg_frac, mode=method.mode, fraction=fraction,
                         subset="random", generator=torch.Generator().manual_seed(0))
    policy.transformer.zero_grad(set_to_none=True)
    ctx = UpdateContext(policy, method, params.sample, params.train, NoSync(), contextlib.nullcontext)
    accumulate_gradients(ctx, traj, adv, rows, groups, reuse=False)
    return torch.cat([p.grad.reshape(-1) for p in policy.trainable_parameters()]).clone()


def _cos(a, b) -> float:
    return float(a @ b / (a.norm() * b.norm() + 1e-30))


def snr(args) -> dict:
    out = {"rows": []}
    for n_prompts, g in [(4, 16), (16, 4), (16, 16), (32, 8)]:
        params, policy, prompts, reward_fn = _setup({"sample.prompts_per_iteration": n_prompts,
                                                     "sample.group_size": g})
        gen = torch.Generator().manual_seed(args.seed)
        for rep in range(args.repeats):
            perm = torch.randperm(len(prompts), generator=gen).tolist()
            a_ids = [perm[i % len(perm)] for i in range(n_prompts)]
            b_ids = [perm[(i + n_prompts) % len(perm)] for i in range(n_prompts)]
            ga = _grad(params, policy, *_rollout(params, policy, prompts, reward_fn, a_ids, args.seed, 100 + rep)[:2])
            gs = _grad(params, policy, *_rollout(params, policy, prompts, reward_fn, a_ids, args.seed, 200 + rep)[:2])
            gd = _grad(params, policy, *_rollout(params, policy, prompts, reward_fn, b_ids, args.seed, 300 + rep)[:2])
            row = {"prompts": n_prompts, "group_size": g, "images": n_prompts * g, "repeat": rep,
                   "cos_same_prompts": _cos(ga, gs), "cos_other_prompts": _cos(ga, gd)}
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    return out


def signal(args) -> dict:
    """Per-image SNR by reward, and exact vs JAGG gradients of the profile's mix, from ``--repeats`` rollouts."""
    from jagg_core.advantages import mixed_advantages
    from jagg_core.rewards import make_reward
    from jagg_core.snr import gradient_snr

    n_prompts, g_size = args.prompts, args.group_size
    params, policy, prompts, reward_fn = _setup({"sample.prompts_per_iteration": n_prompts,
                                                 "sample.group_size": g_size})
    names = args.rewards.split(",")
    fns = {n: make_reward(n) for n in names}
    tcfg, rcfg = params.train, params.reward
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    mix: dict[str, list[torch.Tensor]] = {"baseline": [], "jagg": []}
    gen = torch.Generator().manual_seed(args.seed)
    for rep in range(args.repeats):
        ids = torch.randperm(len(prompts), generator=gen)[:n_prompts].tolist()
        traj = rollout(policy, [prompts[i] for i in ids], list(range(n_prompts)), params.sample, seed=args.seed,
                       iteration=500 + rep)
        texts = traj.image_prompts()
        scores = {n: fn(traj.images, texts, [{} for _ in texts])[0] for n, fn in fns.items()}
        for n in names:
            adv = group_advantages(scores[n], traj.group_ids, eps=tcfg.adv_eps, clip=tcfg.adv_clip,
                                   global_std=tcfg.global_std)
            grads[n].append(_grad(params, policy, traj, adv))
        mixed = {k: scores[k] if k in scores else make_reward(k)(traj.images, texts, [{} for _ in texts])[0]
                 for k in rcfg.weights}
        adv = mixed_advantages(mixed, rcfg.weights, traj.group_ids, normalize=rcfg.normalize, eps=tcfg.adv_eps,
                               clip=tcfg.adv_clip, global_std=tcfg.global_std)
        for m in mix:
            mix[m].append(_grad(params, policy, traj, adv, method_name=m))
        print(json.dumps({"repeat": rep, **{n: float(scores[n].mean()) for n in names}}), flush=True)
    n_img = n_prompts * g_size
    out = {"prompts": n_prompts, "group_size": g_size, "repeats": args.repeats,
           "rewards": {n: gradient_snr(grads[n], n_img) for n in names}, "mix": {"weights": rcfg.weights,
                                                                                 "normalize": rcfg.normalize}}
    k = args.repeats
    for m, gs in mix.items():
        cos_ref = []
        for i in range(k):  # the reference: the mean exact gradient of the other rollouts (independent of g_i)
            ref = sum(mix["baseline"][j] for j in range(k) if j != i) / (k - 1)
            cos_ref.append(_cos(gs[i], ref))
        stack = torch.stack(gs).double()
        out["mix"][m] = {**gradient_snr(gs, n_img), "cos_to_reference": cos_ref,
                         "mean_norm": float(stack.norm(dim=1).mean()),
                         "spread": float(((stack - stack.mean(0)) ** 2).sum(1).mean().sqrt()),
                         # Adam's first step is lr · sign(g): its overlap with the reference direction
                         "sign_cos_to_reference": [_cos(torch.sign(gs[i]),
                                                        sum(mix["baseline"][j] for j in range(k) if j != i))
                                                   for i in range(k)]}
    out["mix"]["cos_jagg_exact_same_rollout"] = [_cos(a, b) for a, b in zip(mix["jagg"], mix["baseline"])]
    print(json.dumps({n: out["rewards"][n]["snr_per_image"] for n in names}), flush=True)
    return out


def kl(args) -> dict:
    overrides = {"sample.prompts_per_iteration": 16, "sample.group_size": 8, "train.lr": args.lr}
    params, policy, prompts, reward_fn = _setup(overrides)
    ids = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(args.seed))[:16].tolist()
    traj, adv, _ = _rollout(params, policy, prompts, reward_fn, ids, args.seed, 0)
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=args.lr, weight_decay=0.0)
    out = {"lr": args.lr, "sigmas": traj.sigmas.tolist(), "train_steps": traj.train_steps, "after": []}
    chunks = torch.randperm(traj.batch_size, generator=torch.Generator().manual_seed(1)).tensor_split(4)
    for k, chunk in enumerate(chunks):
        # log-ratio of every (image, trained step) of the rollout under the current policy
        rows = torch.arange(traj.batch_size)
        with torch.no_grad():
            per_step = {}
            for step in traj.train_steps:
                fns = ImageSteps(UpdateContext(policy, params.method("baseline"), params.sample, params.train),
                                    traj, rows, adv, [step], scale=1.0)
                from jagg_core.sde import sde_step_with_logprob

                v = fns.velocity(0)
                res = sde_step_with_logprob(traj.latents[:, step], v, float(traj.sigmas[step]),
                                            float(traj.sigmas[step + 1]), noise_level=params.sample.noise_level,
                                            kind=params.sample.sde_kind, prev_sample=traj.latents[:, step + 1])
                per_step[step] = (res.log_prob - traj.log_probs[:, step]).double()
        lr_all = torch.stack([per_step[s] for s in traj.train_steps], 1)  # (B, steps)
        sq = lr_all.flatten() ** 2
        top = sq.sort(descending=True).values
        n1 = max(1, sq.numel() // 100)
        out["after"].append({
            "optimizer_steps": k,
            "approx_kl": float(0.5 * sq.mean()),
            "top1pct_share": float(top[:n1].sum() / sq.sum()) if sq.sum() > 0 else 0.0,
            "per_step": {str(s): {"approx_kl": float(0.5 * (per_step[s] ** 2).mean()),
                                  "max_abs": float(per_step[s].abs().max()),
                                  "mean": float(per_step[s].mean())} for s in traj.train_steps},
        })
        print(json.dumps(out["after"][-1]), flush=True)
        # one optimizer step on this chunk, as train.optimizer_steps_per_epoch = 4 does
        _grad(params, policy, traj, adv, chunk)
        torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), params.train.max_grad_norm)
        opt.step()
    return out


def step(args) -> dict:
    """The expected reward of fresh rollouts after one step of norm r along ±(the normalised loss gradient).

    The gradient comes from 2 rollouts of 16 training prompts × 16 images under ``--reward``; every evaluation uses
    the same noise (common random numbers) on the same 16 prompts and on 16 others.
    """
    from jagg_core.rewards import make_reward

    weights = {name: 1.0 for name in args.reward.split("+")}
    params, policy, prompts, reward_fn = _setup({"sample.prompts_per_iteration": 16, "sample.group_size": 16,
                                                 "reward.weights": weights})
    ids = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(args.seed))[:16].tolist()
    other = [i for i in range(len(prompts)) if i not in ids][:16]
    g = sum(_grad(params, policy, *_rollout(params, policy, prompts, reward_fn, ids, args.seed, i)[:2])
            for i in range(2))
    theta = [p.detach().clone() for p in policy.trainable_parameters()]
    judges = {name: make_reward(name) for name in ("toy_preference", "toy_fidelity", "jpeg_compressibility")}

    def measure(idset):
        out: dict[str, list[float]] = {}
        for it in (11, 12):
            traj = _rollout(params, policy, prompts, reward_fn, idset, 7, it)[0]
            texts = traj.image_prompts()
            for name, fn in judges.items():
                r, info = fn(traj.images, texts, [{} for _ in texts])
                out.setdefault(name, []).append(float(r.mean()))
                for k, v in info.items():
                    if k != "kb":
                        out.setdefault(k, []).append(float(v.mean()))
        return {k: sum(v) / len(v) for k, v in out.items()}

    rows = []
    for kind, direction in (("gradient", g / g.norm()), ("sign", torch.sign(g) / torch.sign(g).norm())):
        for r in (0.0, 0.1, 0.3, -0.1):
            if kind == "sign" and r == 0.0:
                continue
            with torch.no_grad():
                off = 0
                for p, t0 in zip(policy.trainable_parameters(), theta):
                    p.copy_(t0 - r * direction[off : off + t0.numel()].view_as(t0))
                    off += t0.numel()
            rows.append({"direction": kind, "r": r, "same_prompts": measure(ids), "other_prompts": measure(other)})
            print(json.dumps(rows[-1]), flush=True)
    return {"reward": weights, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["snr", "kl", "step", "signal"])
    ap.add_argument("--rewards", default="toy_preference,toy_fidelity", help="signal: the rewards compared")
    ap.add_argument("--prompts", type=int, default=8, help="signal: prompts per rollout")
    ap.add_argument("--group-size", type=int, default=16, help="signal: images per prompt")
    ap.add_argument("--reward", default="toy_fidelity", help="step: the training reward, e.g. toy_precision+toy_background")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"snr": snr, "kl": kl, "step": step, "signal": signal}[args.what](args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
