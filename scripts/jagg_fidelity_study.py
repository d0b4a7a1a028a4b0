"""Why JAGG holds on the toy (docs/jagg_fidelity.md): cos(JAGG, exact) per reading of n images, the error split by
middle step, the linearity of the rollout's own velocities over the window, and a velocity-fitted α rule.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 15 python scripts/jagg_fidelity_study.py \
        --models base,jagg-s0,baseline-s0 --ckpt-root checkpoints/toy-full --rollouts 8

For each model (the shipped toy base, or a run's last checkpoint), ``--rollouts`` rollouts are drawn with the
trainer's own code (``trainer/loop.py``'s ``_rollout`` and ``_advantages`` on a ``RunState`` of the ``toy-full``
profile's ``jagg`` method), and the images with a non-zero advantage (the trainer's ``rows``) are cut into blocks of
``--per-prompt`` images of every prompt. For every image i of a block and the group's steps 0..W−1 the script takes
the monitor's per-step losses (``trainer/update.py:ImageSteps`` with ``scale=1``, the signal ``s_j = ∂L_j/∂v_j``
from ``jagg._upstream``) and the parameter vectors

    A0 = J_0ᵀ s_0,  AW = J_{W−1}ᵀ s_{W−1}                    (the endpoints' own terms)
    E_j = J_jᵀ s_j, L_j = J_0ᵀ s_j, R_j = J_{W−1}ᵀ s_j      (each middle step j)

so that, summed over the images of a reading, exact = A0 + AW + Σ_j E_j, JAGG = A0 + AW + Σ_j [(1−α_j) L_j + α_j R_j]
(Eq. 7), ablate = A0 + AW, and JAGG − exact = Σ_j e_j with e_j = (1−α_j) L_j + α_j R_j − E_j. Only their Gram matrix
over the block is kept, so every reading and every α rule is a quadratic form. Two kinds of reading: ``prompt``
(n consecutive images of one prompt, as the monitor's ``rows[:4]``) and ``spread`` (the same number of images of
every prompt of the rollout). The velocities' W×W Gram per image gives the linearity residual
‖v_j − (1−α_j) v_0 − α_j v_{W−1}‖ / ‖v_j‖ and the velocity-fitted α. Writes ``readings.jsonl``, ``summary.json``
and two figures under ``--out``; ``--summarise-only`` redoes the last two from the first.

``--methods`` (docs/frontier.md) measures instead each named method's whole update gradient against the exact one,
on the same models and the same rollouts: for every reading (``--reading`` images spread over the rollout's
prompts) the trainer's own ``accumulate_gradients`` runs each method's routing over every trained step (its window,
anchors, variant, reuse: two groups of W = 4 count as one gradient over the 8 steps) and the exact backward's, and
``cos(method, exact)`` and the norm ratio are kept. Writes ``methods.jsonl`` and ``methods.json`` (per method: the
mean cosine, a Student-t 95% interval over (model, rollout) units, each unit's readings averaged first)::

    python scripts/jagg_fidelity_study.py --profile toy-w --methods all --ckpt-root checkpoints/toy-w \
        --models base,baseline-s0,jagg-s0 --rollouts 4 --out docs/frontier/fidelity
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from jagg_core.errors import UserError  # noqa: E402
from jagg_core.setup.storage import atomic_write_text  # noqa: E402
from tasks.common import cli  # noqa: E402  (the command line's rules: one sentence, exit 1, no traceback)


class StudyError(UserError, ValueError):
    """An input the study cannot run on."""

RULES = ("t", "fit", "fit_image", "fit2", "oracle")  # α rules: see alpha_rules()


# --- per image: the gradient components and the velocities ------------------------------------------------------


def component_names(w: int) -> list[str]:
    mids = range(1, w - 1)
    return ["A0", "AW"] + [f"E{j}" for j in mids] + [f"L{j}" for j in mids] + [f"R{j}" for j in mids]


def image_components(params: Sequence[torch.nn.Parameter], velocity: Callable[[int], torch.Tensor],
                     step_loss: Callable, w: int,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, np.ndarray]:
    """(K, P) parameter vectors of :func:`component_names` (``dtype``: float32 on the toy, 2 MB each) and the (W, W)
    float64 Gram of the velocities v_0..v_{W−1}.

    ``velocity(j)`` and ``step_loss(j, v)`` are the group's (as for :func:`jagg_core.group_backward`) for the images
    whose components are summed (one image in the study)."""
    from jagg_core.jagg import _upstream

    params = list(params)
    vs = [velocity(j) for j in range(w)]  # with graphs
    s = [_upstream(step_loss, j, v)[0] for j, v in enumerate(vs)]

    def vjp(j: int, k: int) -> torch.Tensor:  # J_jᵀ s_k
        gs = torch.autograd.grad(vs[j], params, grad_outputs=s[k].to(vs[j].dtype), retain_graph=True,
                                 allow_unused=True)
        return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).to(dtype)
                          for g, p in zip(gs, params)])

    last, mids = w - 1, range(1, w - 1)
    comps = [vjp(0, 0), vjp(last, last)] + [vjp(j, j) for j in mids] + [vjp(0, j) for j in mids] + \
            [vjp(last, j) for j in mids]
    flat = torch.stack([v.detach().reshape(-1).double() for v in vs])
    del vs
    return torch.stack(comps), (flat @ flat.T).cpu().numpy()


def block_gram(comps: Sequence[torch.Tensor], chunk: int = 1 << 15) -> np.ndarray:
    """The float64 Gram of the block's component vectors, ordered (image, component): (n·K, n·K)."""
    rows = sum(c.shape[0] for c in comps)
    g = torch.zeros(rows, rows, dtype=torch.float64)
    for i in range(0, comps[0].shape[1], chunk):  # products in the vectors' dtype per chunk of 2^15, summed in float64
        c = torch.cat([x[:, i : i + chunk] for x in comps])
        g += (c @ c.T).double()
    return g.numpy()


# --- readings: quadratic forms on the Gram ----------------------------------------------------------------------


class Reading:
    """The quadratic forms of one reading (images ``idx`` of a block) for a window of W steps."""

    def __init__(self, gram: np.ndarray, vgram: np.ndarray, idx: Sequence[int], w: int,
                 zgram: np.ndarray | None = None):
        self.w, self.k = w, 2 + 3 * (w - 2)
        self.mids = list(range(1, w - 1))
        self.idx = list(idx)
        sel = np.concatenate([np.arange(i * self.k, (i + 1) * self.k) for i in self.idx])
        self.g = gram[np.ix_(sel, sel)]
        self.vg = vgram[self.idx]  # (n, W, W)
        self.zg = None if zgram is None else zgram[self.idx]  # (n, W, W) of the latents z_j, if given

    def _col(self, name: str) -> int:
        names = component_names(self.w)
        return names.index(name)

    def vec(self, coef: dict[str, np.ndarray | float]) -> np.ndarray:
        """Coefficients over (image, component) from {component: scalar or (n,) per image}."""
        n = len(self.idx)
        c = np.zeros((n, self.k))
        for name, x in coef.items():
            c[:, self._col(name)] = x
        return c.reshape(-1)

    def dot(self, a: np.ndarray, b: np.ndarray) -> float:
        return float(a @ self.g @ b)

    def cos(self, a: np.ndarray, b: np.ndarray) -> float:
        na, nb = self.dot(a, a), self.dot(b, b)
        return self.dot(a, b) / math.sqrt(na * nb) if na > 0 and nb > 0 else float("nan")

    # the gradients
    def exact(self) -> np.ndarray:
        return self.vec({"A0": 1.0, "AW": 1.0, **{f"E{j}": 1.0 for j in self.mids}})

    def ablate(self) -> np.ndarray:
        return self.vec({"A0": 1.0, "AW": 1.0})

    def step_error(self, j: int, alpha) -> np.ndarray:
        """e_j = (1 − α_j) L_j + α_j R_j − E_j: the interpolated contribution of middle step j minus its true one."""
        return self.vec({f"L{j}": 1.0 - alpha, f"R{j}": alpha, f"E{j}": -1.0})

    def jagg(self, alphas: dict[int, np.ndarray | float]) -> np.ndarray:
        coef = {"A0": 1.0, "AW": 1.0}
        for j in self.mids:
            coef[f"L{j}"] = 1.0 - alphas[j]
            coef[f"R{j}"] = alphas[j]
        return self.vec(coef)

    def jagg2(self, ab: dict[int, tuple[float, float]]) -> np.ndarray:
        """Two free weights per middle step: a_j L_j + b_j R_j."""
        coef = {"A0": 1.0, "AW": 1.0}
        for j in self.mids:
            coef[f"L{j}"], coef[f"R{j}"] = ab[j]
        return self.vec(coef)

    # the velocities
    def residual(self, j: int, alpha: float) -> float:
        """‖v_j − (1 − α) v_0 − α v_{W−1}‖ / ‖v_j‖ pooled over the reading's images (sums of squares)."""
        return math.sqrt(max(float(np.sum(residual_sq(self.vg, j, alpha))), 0.0) / float(np.sum(self.vg[:, j, j])))

    def z_residual(self, j: int, alpha: float) -> float:
        """The same for the inputs: how far z_j is from the endpoints' segment (Theorem 1 needs it on it)."""
        return math.sqrt(max(float(np.sum(residual_sq(self.zg, j, alpha))), 0.0) / float(np.sum(self.zg[:, j, j])))

    def fitted_alpha(self, j: int, per_image: bool = False):
        """Least squares of v_j onto the endpoints' segment: α = ⟨v_j − v_0, v_L − v_0⟩ / ‖v_L − v_0‖²."""
        num, den = fit_terms(self.vg, j)
        return num / den if per_image else float(num.sum() / den.sum())

    def fitted_two(self, j: int) -> tuple[float, float]:
        """Least squares of v_j onto (v_0, v_{W−1}) with free weights (a, b), pooled over the images."""
        last = self.w - 1
        vg = self.vg.sum(0)
        m = np.array([[vg[0, 0], vg[0, last]], [vg[0, last], vg[last, last]]])
        a, b = np.linalg.solve(m, np.array([vg[j, 0], vg[j, last]]))
        return float(a), float(b)

    def oracle_alpha(self) -> dict[int, float]:
        """The per-step α that minimises ‖JAGG − exact‖ (needs the exact gradient: a ceiling, not a rule)."""
        d = [self.vec({f"R{j}": 1.0, f"L{j}": -1.0}) for j in self.mids]  # ∂ e / ∂ α_j
        f = sum(self.vec({f"L{j}": 1.0, f"E{j}": -1.0}) for j in self.mids)  # e at α = 0
        m = np.array([[self.dot(a, b) for b in d] for a in d])
        rhs = -np.array([self.dot(a, f) for a in d])
        x = np.linalg.lstsq(m, rhs, rcond=None)[0]
        return {j: float(x[i]) for i, j in enumerate(self.mids)}


def residual_sq(vg: np.ndarray, j: int, alpha) -> np.ndarray:
    """(n,) ‖v_j − (1 − α) v_0 − α v_L‖² per image from the velocities' Gram (n, W, W)."""
    last = vg.shape[1] - 1
    a = np.asarray(alpha, dtype=np.float64)
    return (vg[:, j, j] + (1 - a) ** 2 * vg[:, 0, 0] + a**2 * vg[:, last, last]
            - 2 * (1 - a) * vg[:, j, 0] - 2 * a * vg[:, j, last] + 2 * a * (1 - a) * vg[:, 0, last])


def fit_terms(vg: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """(n,) ⟨v_j − v_0, v_L − v_0⟩ and ‖v_L − v_0‖² per image."""
    last = vg.shape[1] - 1
    num = vg[:, j, last] - vg[:, j, 0] - vg[:, 0, last] + vg[:, 0, 0]
    den = vg[:, last, last] - 2 * vg[:, 0, last] + vg[:, 0, 0]
    return num, den


def alpha_rules(r: Reading, alpha_t: Sequence[float]) -> dict[str, np.ndarray]:
    """The JAGG gradient under each α rule: ``t`` (the paper's Eq. 6), ``fit`` (one α per step, least squares of the
    reading's v_j onto the segment v_0 → v_{W−1}), ``fit_image`` (the same per image), ``fit2`` (free weights a_j, b_j
    on v_0 and v_{W−1}) and ``oracle`` (the α minimising the error against the exact gradient: a ceiling)."""
    return {
        "t": r.jagg({j: alpha_t[j] for j in r.mids}),
        "fit": r.jagg({j: r.fitted_alpha(j) for j in r.mids}),
        "fit_image": r.jagg({j: r.fitted_alpha(j, per_image=True) for j in r.mids}),
        "fit2": r.jagg2({j: r.fitted_two(j) for j in r.mids}),
        "oracle": r.jagg(r.oracle_alpha()),
    }


def measure_reading(r: Reading, alpha_t: Sequence[float]) -> dict:
    """Everything one reading yields: cosines (ablate and each α rule), the error split, the velocity residuals."""
    exact = r.exact()
    rules = alpha_rules(r, alpha_t)
    e = rules["t"] - exact
    ee = max(r.dot(e, e), 0.0)  # a quadratic form of a (near-)zero vector may round below 0
    split = {}
    for j in r.mids:
        ej = r.step_error(j, alpha_t[j])
        ctr = r.vec({f"E{j}": 1.0})
        split[str(j)] = {
            "share": r.dot(ej, e) / ee if ee > 0 else float("nan"),  # ⟨e_j, e⟩/‖e‖²: the shares sum to 1
            "norm_ratio": math.sqrt(max(r.dot(ej, ej), 0.0) / ee) if ee > 0 else float("nan"),  # ‖e_j‖ / ‖e‖
            "rel_to_step": math.sqrt(max(r.dot(ej, ej), 0.0) / r.dot(ctr, ctr)),  # ‖e_j‖ / ‖J_jᵀ s_j‖
            "step_share_of_exact": math.sqrt(r.dot(ctr, ctr) / r.dot(exact, exact)),  # ‖J_jᵀ s_j‖ / ‖exact‖
            # how well the endpoints carry step j: cos and norm ratio of (1−α_j) J_0ᵀ s_j + α_j J_Lᵀ s_j to J_jᵀ s_j
            "cos_carried": r.cos(ej + ctr, ctr),
            "norm_carried": math.sqrt(r.dot(ej + ctr, ej + ctr) / r.dot(ctr, ctr)),
        }
    return {
        "cos_ablate": r.cos(r.ablate(), exact),
        **{f"cos_{k}": r.cos(v, exact) for k, v in rules.items()},
        "rel_err": math.sqrt(ee / r.dot(exact, exact)),
        "norm_ratio_jagg": math.sqrt(r.dot(rules["t"], rules["t"]) / r.dot(exact, exact)),
        "split": split,
        "residual_t": {str(j): r.residual(j, alpha_t[j]) for j in r.mids},
        "residual_fit": {str(j): r.residual(j, r.fitted_alpha(j)) for j in r.mids},
        **({"z_residual_t": {str(j): r.z_residual(j, alpha_t[j]) for j in r.mids}} if r.zg is not None else {}),
        "alpha_fit": {str(j): r.fitted_alpha(j) for j in r.mids},
        "alpha_oracle": {str(j): a for j, a in r.oracle_alpha().items()},
    }


# --- the toy: models, rollouts, blocks --------------------------------------------------------------------------


def _run_state(args, work: Path):
    from jagg_core.setup.params_io import load_params
    from jagg_core.setup.paths import Layout
    from jagg_core.trainer.session import setup_run
    from jagg_core.world import make_prompt_splits, write_prompt_splits
    from tasks.pretrain import verify_sums

    base = ROOT / "assets" / "toy-base"
    verify_sums(base)
    from tasks.common import parse_overrides

    params = load_params(Path(args.params), args.profile,
                         {**parse_overrides(getattr(args, "set", [])), "model.path": str(base),
                          "tracking.mlflow_uri": f"sqlite:///{work / 'mlflow.db'}"})
    lay = Layout.of(params, work)
    if not lay.train_prompts.exists():
        w = params.world
        write_prompt_splits(lay.prompts, *make_prompt_splits(w.seed, w.n_train, w.n_test_per_style,
                                                             w.n_validation_per_style))
    method = args.method
    if args.methods:  # the rollout keeps its middle velocities when a method reuses them
        method = next((m for m in method_names(params, args.methods) if params.method(m).reuse_rollout_velocity),
                      method_names(params, args.methods)[0])
    return setup_run(params, method, args.seed, work, None, "jagg-fidelity-study")


def _load_model(r, name: str, ckpt_root: Path) -> str:
    """Load ``name``'s last checkpoint (``base``: the shipped weights as loaded); returns what was loaded."""
    from jagg_core.policies.lora import load_trainable_state_dict
    from jagg_core.trainer.checkpoint import latest_checkpoint

    if name == "base":
        return "assets/toy-base"
    ckpt = latest_checkpoint(ckpt_root / name)
    if ckpt is None:
        raise FileNotFoundError(f"no complete checkpoint under {ckpt_root / name}")
    load_trainable_state_dict(r.policy.transformer, ckpt.tensors())
    return f"{name}/{ckpt.path.name}"


def reading_layouts(n_prompts: int, per: int, sizes: Sequence[int], spread: Sequence[int]):
    """The readings of a block holding ``per`` images of each of ``n_prompts`` prompts (prompt-major order), as
    (layout, n, unit-within-block, indices): ``prompt`` readings are n consecutive images of one prompt (the monitor's
    ``rows[:4]`` is the first), ``spread`` readings take m images of every prompt of the block (n = m · prompts)."""
    for n in sizes:
        for q in range(n_prompts):
            for k in range(per // n):
                yield "prompt", n, q, [q * per + k * n + i for i in range(n)]
    for m in spread:
        for k in range(per // m):
            yield "spread", m * n_prompts, None, [q * per + k * m + i for q in range(n_prompts) for i in range(m)]


def measure_model(r, ctx, name: str, args, out_rows: list, log) -> None:
    from jagg_core.jagg import interpolation_weights
    from jagg_core.trainer.loop import _advantages, _rollout
    from jagg_core.trainer.update import ImageSteps, trajectory_fidelity

    params_list = ctx.policy.trainable_parameters()
    w = ctx.method.window
    per = args.per_prompt
    sizes = [int(x) for x in args.sizes.split(",")]
    spread = [int(x) for x in args.spread.split(",")]
    for it in range(args.rollouts):
        metrics: dict[str, float] = {}
        iteration = it + args.first_iteration
        traj, scoring = _rollout(r, iteration, iteration + 1, metrics)
        scored = _advantages(r, traj, scoring, iteration + 1, metrics)
        rows = scored.rows
        steps = traj.train_steps
        alpha_t = [float(a) for a in interpolation_weights(traj.timesteps[steps])]
        by_prompt: dict[int, list[int]] = {}  # the signal rows of each prompt, in row order
        for i in rows.tolist():
            by_prompt.setdefault(int(traj.prompt_index[i]), []).append(i)
        n_blocks = max((len(v) for v in by_prompt.values()), default=0) // per
        log(f"{name} rollout {iteration}: reward {metrics['reward/mean']:.4f}, {len(rows)}/{traj.batch_size} images "
            f"with a signal ({', '.join(str(len(v)) for v in by_prompt.values())} per prompt), {n_blocks} blocks; "
            f"steps {steps}, t {[round(float(x), 1) for x in traj.timesteps[steps]]}")
        if not len(rows):
            continue
        # the monitor's own reading on rows[:fidelity_batch], to check the Gram arithmetic against it
        mon = trajectory_fidelity(ctx, traj, scored.advantages, rows[: r.params.train.fidelity_batch])
        for b in range(n_blocks):
            t0 = time.perf_counter()
            prompts = [p for p, v in by_prompt.items() if len(v) >= per * (b + 1)]
            block = [i for p in prompts for i in by_prompt[p][b * per : (b + 1) * per]]
            comps, vgs = [], []
            for i in block:
                fns = ImageSteps(ctx, traj, torch.tensor([i]), scored.advantages, steps, scale=1.0)
                c, vg = image_components(params_list, fns.velocity, fns.step_loss, w)
                comps.append(c)
                vgs.append(vg)
            gram = block_gram(comps)
            del comps
            vgram = np.stack(vgs)
            z = traj.latents[block][:, steps].reshape(len(block), w, -1).double()
            zgram = (z @ z.transpose(1, 2)).numpy()
            for layout, n, q, idx in reading_layouts(len(prompts), per, sizes, spread):
                rd = Reading(gram, vgram, idx, w, zgram)
                unit = [iteration, prompts[q]] if layout == "prompt" else [iteration]
                rec = {"model": name, "rollout": iteration, "block": b, "layout": layout, "n": n, "unit": unit,
                       "first_image": block[idx[0]], "steps": steps, "alpha_t": alpha_t,
                       **measure_reading(rd, alpha_t)}
                if block[idx[0]] == int(rows[0]) and layout == "prompt" and n == r.params.train.fidelity_batch:
                    rec["monitor_cos_jagg"] = mon.cos_jagg[0]
                    rec["monitor_cos_ablate"] = mon.cos_ablate[0]
                out_rows.append(rec)
            log(f"  block {b} ({len(block)} images, {len(prompts)} prompts): {time.perf_counter() - t0:.1f} s; "
                f"all: cos jagg {out_rows[-1]['cos_t']:.4f}, ablate {out_rows[-1]['cos_ablate']:.4f}")


# --- every method's whole update gradient against the exact one (docs/frontier.md) ----------------------------


def method_names(params, spec: str) -> list[str]:
    """``all``: the profile's run.methods; else the comma list (each must be defined under methods)."""
    names = list(params.run.methods) if spec == "all" else [m for m in spec.split(",") if m]
    for m in names:
        params.method(m)  # an unknown name is one ParamsError sentence
    return names


def update_gradient(ctx, traj, advantages, rows, method, *, generator=None, draw=None) -> torch.Tensor:
    """The method's gradient over every trained step of ``rows``, as the trainer accumulates it (float64, flat);
    ``generator`` draws a random anchor, ``draw`` fixes it (every group's, every row's)."""
    from jagg_core.jagg import AUTO_FALLBACK_JAGG_FRAC, plan_groups
    from jagg_core.trainer.update import UpdateContext, accumulate_gradients

    frac = AUTO_FALLBACK_JAGG_FRAC if method.jagg_frac == "auto" else float(method.jagg_frac)
    groups = plan_groups(traj.train_steps, method.window, frac, mode=method.mode)
    params = ctx.policy.trainable_parameters()
    for p in params:
        p.grad = None
    mctx = UpdateContext(ctx.policy, method, ctx.sample, ctx.train, autocast=ctx.autocast)
    accumulate_gradients(mctx, traj, advantages, rows, groups, reuse=method.reuse_rollout_velocity,
                         measure_kl_ref=False, generator=generator, draw=draw)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double()
                      for p in params])
    for p in params:
        p.grad = None
    return flat


def spread_readings(rows: Sequence[int], prompt_of: Callable[[int], int], n: int) -> list[list[int]]:
    """Readings of ``n`` signal rows each, the same number from every prompt of the rollout (prompt-major order)."""
    by_prompt: dict[int, list[int]] = {}
    for i in rows:
        by_prompt.setdefault(prompt_of(i), []).append(i)
    per = max(1, n // max(1, len(by_prompt)))
    k = min((len(v) for v in by_prompt.values()), default=0) // per
    return [[i for v in by_prompt.values() for i in v[j * per : (j + 1) * per]] for j in range(k)]


def draw_law(traj, method) -> dict[int, float]:
    """{step of the group: p_r} of a random-anchor method's draw (its one full group of the window)."""
    from jagg_core.jagg import random_anchor_probabilities, resolve_anchors

    w = method.window
    t = traj.timesteps[list(traj.train_steps[:w])]
    pos = resolve_anchors(w, method.anchors, method.anchor_at)
    p = random_anchor_probabilities(t, pos, method.random_anchor_p)
    return {j: float(p[j]) for j in range(w) if float(p[j]) > 0}


def estimator_stats(draws: Sequence[tuple[float, torch.Tensor]], g_exact: torch.Tensor,
                    mean: torch.Tensor | None = None) -> dict:
    """An estimator's readings against the exact gradient g from its draws [(weight, g_d)] (weights summing to 1):
    the expected cosine and relative squared error of ONE draw, E cos(g_d, g) and E‖g_d − g‖²/‖g‖², and its bias:
    ‖E g_d − g‖/‖g‖ and cos(E g_d, g), E taken over ``mean`` when given (an exact enumeration of the law), else over
    the draws. A deterministic estimator is one draw of weight 1 (its MSE is its bias squared).

    And what a step along it does (issue 72): its projection coefficient ⟨E g_d, g⟩/‖g‖² (1: as far along the exact
    direction as the exact gradient; a smaller one takes smaller steps along it at the same learning rate) and the
    share of its squared error orthogonal to g, E‖g_d − ⟨g_d, g⟩/‖g‖² g‖² / E‖g_d − g‖² (1: an error that points
    elsewhere; 0: an error along g only, which a learning rate rescales away)."""
    ne = float(g_exact.norm())
    cos = lambda a: float(a @ g_exact / (a.norm() * ne)) if float(a.norm()) and ne else float("nan")
    along = lambda a: float(a @ g_exact) / ne**2 if ne else float("nan")  # noqa: E731
    e = sum(w * g for w, g in draws) if mean is None else mean
    mse = sum(w * float((g - g_exact).norm() ** 2) for w, g in draws) / ne**2
    orth = sum(w * float((g - along(g) * g_exact).norm() ** 2) for w, g in draws) / ne**2
    return {"cos": sum(w * cos(g) for w, g in draws), "mse": mse,
            "bias": float((e - g_exact).norm()) / ne, "cos_mean": cos(e),
            "norm_ratio": sum(w * float(g.norm()) for w, g in draws) / ne,
            "proj": along(e), "orth_share": orth / mse if mse > 0 else float("nan")}


def rollout_readings(r, iteration: int, args):
    """The trainer's rollout of ``iteration`` and its advantages, and its readings (``--reading`` signal rows spread
    over the prompts, at most ``--max-readings`` of them)."""
    from jagg_core.trainer.loop import _advantages, _rollout

    metrics: dict[str, float] = {}
    traj, scoring = _rollout(r, iteration, iteration + 1, metrics)
    scored = _advantages(r, traj, scoring, iteration + 1, metrics)
    readings = spread_readings(scored.rows.tolist(), lambda i: int(traj.prompt_index[i]), args.reading)
    return traj, scored, readings[: args.max_readings] if args.max_readings else readings


def measure_methods(r, ctx, name: str, names: Sequence[str], args, out_rows: list, log) -> None:
    from jagg_core.sampling import derive_seed
    from jagg_core.setup.config import ResolvedMethod

    methods = {m: r.params.method(m) for m in names}
    first = next(iter(methods.values()))
    exact = ResolvedMethod(**{**first.model_dump(), "name": "exact", "mode": "exact"})
    for it in range(args.rollouts):
        iteration = it + args.first_iteration
        traj, scored, readings = rollout_readings(r, iteration, args)
        t0 = time.perf_counter()
        for k, idx in enumerate(readings):
            rows = torch.tensor(idx)
            g_exact = update_gradient(ctx, traj, scored.advantages, rows, exact)
            enumerated: dict[tuple, list] = {}  # a law's draws, shared by the methods that draw from it
            for m, method in methods.items():
                grad = lambda **kw: update_gradient(ctx, traj, scored.advantages, rows, method, **kw)  # noqa: E731
                if method.mode == "exact":
                    stats = estimator_stats([(1.0, g_exact)], g_exact)
                elif method.random_anchor is None:
                    stats = estimator_stats([(1.0, grad())], g_exact)
                elif not args.enumerate:  # seeded draws only: their mean stands for the expectation (noisier)
                    gens = [torch.Generator().manual_seed(derive_seed(args.seed, iteration, k, d))
                            for d in range(args.draws)]
                    stats = {**estimator_stats([(1 / args.draws, grad(generator=g)) for g in gens], g_exact),
                             "bias_from_draws": args.draws}
                else:  # every draw of the law, weighted: the expectation exactly, and one group-draw's spread
                    law = draw_law(traj, method)
                    key = (tuple(law.items()), method.window, method.anchors, str(method.anchor_at),
                           method.random_anchor_weight)  # λ scales every draw's correction: not shared across λ
                    if key not in enumerated or not args.share_enumeration:
                        # drawn per group or, every row at one step, per image: the same gradient (the rows' draws
                        # are one group draw), so one enumeration serves both
                        enumerated[key] = [(p, grad(draw=j)) for j, p in law.items()]
                    enum = enumerated[key]
                    mean = sum(p * g for p, g in enum)
                    if method.random_anchor == "group":
                        stats = estimator_stats(enum, g_exact, mean)
                    else:  # per image: one draw is --draws seeded draws' average; the expectation is the same
                        gens = [torch.Generator().manual_seed(derive_seed(args.seed, iteration, k, d))
                                for d in range(args.draws)]
                        stats = estimator_stats([(1 / args.draws, grad(generator=g)) for g in gens], g_exact, mean)
                out_rows.append({"model": name, "rollout": iteration, "reading": k, "n": len(idx), "method": m,
                                 **stats})
        log(f"{name} rollout {iteration}: {len(readings)} readings of {args.reading} images, "
            f"{time.perf_counter() - t0:.1f} s; steps {traj.train_steps}")


def alignment_main(args, out: Path, log) -> int:
    """Is an estimator's error the same from one rollout to the next (a bias that adds up over iterations), or new
    each time? For every model, rollout and reading (``--max-readings`` of ``--reading`` images) the exact gradient
    g and each method's error e = g_method − g (a random anchor: one seeded draw); then the mean pairwise cosine of
    the errors of different rollouts of one model (iterations apart), against the same for the exact gradients
    themselves (how much of the signal repeats), and within a rollout between its readings (other images)."""
    from itertools import combinations

    from jagg_core.sampling import derive_seed
    from jagg_core.setup.config import ResolvedMethod
    from jagg_core.trainer.update import UpdateContext

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    vecs: dict[tuple, torch.Tensor] = {}  # (model, method, rollout, reading) -> the error (exact: the gradient)
    names: list[str] = []
    models = args.models.split(",")
    for name in models:
        r = _run_state(args, work)
        names = [m for m in method_names(r.params, args.methods) if r.params.method(m).mode != "exact"]
        log(f"model {name}: {_load_model(r, name, Path(args.ckpt_root))}; methods {', '.join(names)}")
        ctx = UpdateContext(r.policy, r.method, r.params.sample, r.params.train, r.sync, r.autocast)
        exact = ResolvedMethod(**{**r.params.method(names[0]).model_dump(), "name": "exact", "mode": "exact"})
        for it in range(args.rollouts):
            iteration = it + args.first_iteration
            traj, scored, readings = rollout_readings(r, iteration, args)
            for k, idx in enumerate(readings):
                rows = torch.tensor(idx)
                g = update_gradient(ctx, traj, scored.advantages, rows, exact)
                vecs[(name, "exact", it, k)] = g
                for m in names:
                    method = r.params.method(m)
                    gen = torch.Generator().manual_seed(derive_seed(args.seed, iteration, k, 0))
                    vecs[(name, m, it, k)] = update_gradient(ctx, traj, scored.advantages, rows, method,
                                                             generator=gen) - g
            log(f"{name} rollout {iteration}: {len(readings)} readings")

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(a @ b / (a.norm() * b.norm()))

    summary: dict = {"methods": {}, "meta": {"models": models, "rollouts": args.rollouts, "reading": args.reading,
                                             "max_readings": args.max_readings,
                                             "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}}
    for m in ["exact", *names]:
        across, within = [], []
        for name in models:
            keys = sorted(k for k in vecs if k[0] == name and k[1] == m)
            by_roll: dict[int, list[tuple]] = {}
            for key in keys:
                by_roll.setdefault(key[2], []).append(key)
            # across rollouts: reading 0 of each pair of rollouts (one unit per model: their mean)
            firsts = [v[0] for v in by_roll.values()]
            across.append(float(np.mean([cos(vecs[a], vecs[b]) for a, b in combinations(firsts, 2)])))
            within += [float(np.mean([cos(vecs[a], vecs[b]) for a, b in combinations(v, 2)]))
                       for v in by_roll.values() if len(v) > 1]
        mean_a, lo_a, hi_a, n_a = t_interval(across)
        mean_w, lo_w, hi_w, n_w = t_interval(within)
        # the share of the consistent gradient kept: ⟨g_method,i, ḡ_−i⟩ / ⟨g_exact,i, ḡ_−i⟩ summed over the readings
        # i of a model, ḡ_−i the mean exact gradient of the model's OTHER rollouts (their noise independent of i's),
        # so both sums estimate an inner product with the expected gradient, not with i's own noise
        kept = []
        for name in models:
            ex = {k: v for k, v in vecs.items() if k[0] == name and k[1] == "exact"}
            num = den = 0.0
            for k, g in ex.items():
                others = [v for kk, v in ex.items() if kk[2] != k[2]]
                if not others:
                    continue
                ref = torch.stack(others).mean(0)
                own = g if m == "exact" else g + vecs[(name, m, k[2], k[3])]
                num, den = num + float(own @ ref), den + float(g @ ref)
            kept.append(num / den if den else float("nan"))
        mean_k, lo_k, hi_k, n_k = t_interval(kept)
        summary["methods"][m] = {"across_rollouts": {"mean": mean_a, "lo": lo_a, "hi": hi_a, "n": n_a},
                                 "within_rollout": {"mean": mean_w, "lo": lo_w, "hi": hi_w, "n": n_w},
                                 "signal_kept": {"mean": mean_k, "lo": lo_k, "hi": hi_k, "n": n_k,
                                                 "per_model": dict(zip(models, kept))}}
        log(f"{m}: cos across rollouts {mean_a:+.3f} [{lo_a:+.3f}, {hi_a:+.3f}] (models), within a rollout "
            f"{mean_w:+.3f} [{lo_w:+.3f}, {hi_w:+.3f}]; share of the consistent gradient kept {mean_k:.3f} "
            f"[{lo_k:.3f}, {hi_k:.3f}] ({', '.join(f'{x:.2f}' for x in kept)})")
    atomic_write_text(out / "alignment.json", json.dumps(summary, indent=1) + "\n")
    log(f"wrote {out / 'alignment.json'}")
    return 0


def derived_projection(row: dict) -> dict:
    """A reading written before ``proj`` and ``orth_share`` existed, with them where its other figures determine them:
    a deterministic estimator's (its MSE its bias squared: E g_d = g_d), whose projection coefficient is
    cos · norm ratio and whose orthogonal share is norm ratio² (1 − cos²) / MSE. A random anchor's reading is left as
    it is (its second moment along g was not kept)."""
    if "proj" in row or not all(k in row for k in ("cos", "norm_ratio", "mse", "bias")):
        return row
    if abs(row["bias"] ** 2 - row["mse"]) > 1e-9 * max(1.0, row["mse"]):
        return row
    c, nr, mse = row["cos"], row["norm_ratio"], row["mse"]
    return {**row, "proj": c * nr, "orth_share": nr * nr * (1 - c * c) / mse if mse > 0 else float("nan")}


def summarise_methods(rows: list[dict], names: Sequence[str]) -> dict:
    """Per method: mean cos(method, exact) and norm ratio with Student-t 95% intervals over (model, rollout) units."""
    rows = [derived_projection(r) for r in rows]
    out: dict = {"methods": {}, "models": sorted({r["model"] for r in rows})}
    for m in names:
        units: dict[tuple, list[dict]] = {}
        for r in rows:
            if r["method"] == m:
                units.setdefault((r["model"], r["rollout"]), []).append(r)
        entry = {"readings": sum(len(v) for v in units.values()), "units": len(units)}
        for key in ("cos", "norm_ratio", "mse", "bias", "cos_mean", "proj", "orth_share"):
            if not all(key in x for v in units.values() for x in v):
                continue  # readings written before the key existed
            mean, lo, hi, n = t_interval([float(np.mean([x[key] for x in v])) for v in units.values()])
            entry[key] = {"mean": mean, "lo": lo, "hi": hi, "n": n}
        out["methods"][m] = entry
    return out


def methods_main(args, out: Path, log) -> int:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    from jagg_core.trainer.update import UpdateContext

    models = args.models.split(",")
    # --append: the readings of earlier calls on other models are kept (a screen measured model by model)
    # (a (model, method) measured now replaces its earlier readings; the others are kept)
    now = {m for m in args.methods.split(",")} if args.methods != "all" else None
    rows: list[dict] = [x for x in _read_readings(out / "methods.jsonl")
                        if x["model"] not in models or (now is not None and x["method"] not in now)] \
        if args.append else []
    names: list[str] = []
    for name in models:
        r = _run_state(args, work)  # a fresh policy per model
        names = method_names(r.params, args.methods)
        loaded = _load_model(r, name, Path(args.ckpt_root))
        ctx = UpdateContext(r.policy, r.method, r.params.sample, r.params.train, r.sync, r.autocast)
        log(f"model {name}: {loaded}; methods {', '.join(names)}")
        measure_methods(r, ctx, name, names, args, rows, log)
    atomic_write_text(out / "methods.jsonl", "".join(json.dumps(rec) + "\n" for rec in rows))  # whole or not at all
    summary = summarise_methods(rows, list(dict.fromkeys([*(x["method"] for x in rows), *names])))
    summary["meta"] = {"profile": args.profile, "models": ",".join(dict.fromkeys(x["model"] for x in rows)),
                       "rollouts": args.rollouts, "reading": args.reading, "max_readings": args.max_readings,
                       "draws": args.draws, "seed": args.seed, "first_iteration": args.first_iteration,
                       "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       "command": " ".join(["python", "scripts/jagg_fidelity_study.py", *sys.argv[1:]])}
    atomic_write_text(out / "methods.json", json.dumps(summary, indent=1) + "\n")
    log(f"wrote {out / 'methods.jsonl'}, {out / 'methods.json'}")
    return 0


# --- summary ----------------------------------------------------------------------------------------------------


def t_interval(xs: Sequence[float], level: float = 0.95) -> tuple[float, float, float, int]:
    """(mean, lo, hi, n) with Student's t over independent values."""
    from scipy import stats

    x = np.asarray([v for v in xs if np.isfinite(v)], dtype=np.float64)
    m = float(x.mean())
    if len(x) < 2:
        return m, float("nan"), float("nan"), len(x)
    h = float(stats.t.ppf(0.5 + level / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return m, m - h, m + h, len(x)


def _unit(r: dict) -> tuple:
    return (r["model"], *r["unit"])


def unit_means(rows: list[dict], key: Callable[[dict], float]) -> list[float]:
    """One value per independent unit (the mean of its readings): a prompt of a rollout for ``prompt`` readings (its
    G images share z_0), a rollout for ``spread`` ones. The t-intervals are over these."""
    by: dict[tuple, list[float]] = {}
    for r in rows:
        by.setdefault(_unit(r), []).append(key(r))
    return [float(np.mean(v)) for v in by.values()]


def corr_ci(rows: list[dict], x: Callable[[dict], float], y: Callable[[dict], float], draws: int = 2000,
            seed: int = 0) -> dict:
    """Pearson's r of x and y across readings, with a 95% percentile interval from a bootstrap over the units of
    :func:`unit_means` (readings of one unit are not independent: the unit is what is resampled)."""
    by: dict[tuple, list[tuple[float, float]]] = {}
    for r in rows:
        by.setdefault(_unit(r), []).append((x(r), y(r)))
    units = [np.asarray(v) for v in by.values()]
    allv = np.concatenate(units)
    rr = float(np.corrcoef(allv[:, 0], allv[:, 1])[0, 1])
    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(draws):
        pick = np.concatenate([units[i] for i in rng.integers(len(units), size=len(units))])
        if np.std(pick[:, 0]) > 0 and np.std(pick[:, 1]) > 0:
            boot.append(np.corrcoef(pick[:, 0], pick[:, 1])[0, 1])
    lo, hi = (np.percentile(boot, [2.5, 97.5]) if boot else (float("nan"), float("nan")))
    return {"r": rr, "lo": float(lo), "hi": float(hi), "readings": len(allv), "units": len(units)}


def mean_residual(r: dict, key: str = "residual_t") -> float:
    """The reading's velocity residual, averaged over the middle steps."""
    return float(np.mean(list(r[key].values())))


def _stat(rows: list[dict], key: Callable[[dict], float]) -> dict:
    mean, lo, hi, k = t_interval(unit_means(rows, key))
    return {"mean": mean, "lo": lo, "hi": hi, "units": k}


def summarise(rows: list[dict]) -> dict:
    """Per model and reading kind (``layout:n``): means with t-intervals over units, the spread of single readings,
    the error split, the residuals and the α rules."""
    out: dict = {"models": {}}
    for m in dict.fromkeys(r["model"] for r in rows):
        mr = [r for r in rows if r["model"] == m]
        mids = list(mr[0]["split"])
        s: dict = {"rollouts": len({r["rollout"] for r in mr}), "steps": mr[0]["steps"], "alpha_t": mr[0]["alpha_t"],
                   "kinds": {}}
        kinds = sorted({(r["layout"], r["n"]) for r in mr}, key=lambda x: (x[0] != "prompt", x[1]))
        for layout, n in kinds:
            nr = [r for r in mr if r["layout"] == layout and r["n"] == n]
            row: dict = {"layout": layout, "n": n, "readings": len(nr)}
            for key in ("cos_t", "cos_ablate", "cos_fit", "cos_fit_image", "cos_fit2", "cos_oracle", "rel_err",
                        "norm_ratio_jagg"):
                vals = np.asarray([r[key] for r in nr])
                row[key] = {**_stat(nr, lambda r, key=key: r[key]), "sd_reading": float(np.std(vals, ddof=1)),
                            "p2_5": float(np.percentile(vals, 2.5)), "p97_5": float(np.percentile(vals, 97.5)),
                            "min": float(vals.min()), "below_0_5": float(np.mean(vals < 0.5))}
            row["gain_jagg_minus_ablate"] = _stat(nr, lambda r: r["cos_t"] - r["cos_ablate"])
            for rule in ("fit", "fit_image", "fit2", "oracle"):  # paired with the paper's t-weighted rule
                row[f"diff_{rule}_minus_t"] = _stat(nr, lambda r, rule=rule: r[f"cos_{rule}"] - r["cos_t"])
            for j in mids:
                for key in ("share", "norm_ratio", "rel_to_step", "step_share_of_exact", "cos_carried", "norm_carried"):
                    row.setdefault("split", {}).setdefault(j, {})[key] = _stat(
                        nr, lambda r, j=j, key=key: r["split"][j][key])
                for key in ("residual_t", "residual_fit", "z_residual_t", "alpha_fit", "alpha_oracle"):
                    row.setdefault(key, {})[j] = _stat(nr, lambda r, j=j, key=key: r[key][j])
            # does the velocity residual (mean over the middle steps) predict the cosine across readings?
            row["corr_residual_cos"] = corr_ci(nr, mean_residual, lambda r: r["cos_t"])
            row["corr_residual_relerr"] = corr_ci(nr, mean_residual, lambda r: r["rel_err"])
            row["corr_residual_gain"] = corr_ci(nr, mean_residual, lambda r: r["cos_t"] - r["cos_ablate"])
            s["kinds"][f"{layout}:{n}"] = row
        s["monitor_check"] = [{"gram_cos_jagg": r["cos_t"], "monitor_cos_jagg": r["monitor_cos_jagg"],
                               "gram_cos_ablate": r["cos_ablate"], "monitor_cos_ablate": r["monitor_cos_ablate"]}
                              for r in mr if "monitor_cos_jagg" in r]
        out["models"][m] = s
    # pooled over the models: the residual's correlation with the cosine
    out["pooled"] = {}
    for layout, n in sorted({(r["layout"], r["n"]) for r in rows}):
        nr = [r for r in rows if r["layout"] == layout and r["n"] == n]
        out["pooled"][f"{layout}:{n}"] = {"corr_residual_cos": corr_ci(nr, mean_residual, lambda r: r["cos_t"])}
    return out


def figures(rows: list[dict], summary: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    models = list(summary["models"])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mi, m in enumerate(models):
        kinds = summary["models"][m]["kinds"]
        for layout, style in (("prompt", "--"), ("spread", "-")):
            ks = sorted((k for k in kinds.values() if k["layout"] == layout), key=lambda k: k["n"])
            if not ks:
                continue
            ns = np.array([k["n"] for k in ks]) * (1 + 0.03 * (mi - (len(models) - 1) / 2))
            for ax, key in ((axes[0], "cos_t"), (axes[1], "cos_ablate")):
                mean = np.array([k[key]["mean"] for k in ks])
                err = [mean - [k[key]["lo"] for k in ks], np.array([k[key]["hi"] for k in ks]) - mean]
                ax.errorbar(ns, mean, yerr=err, marker="o", ls=style, capsize=3, color=colors[mi % len(colors)],
                            label=f"{m}, {layout}")
            axes[2].plot(ns, [1.96 * k["cos_t"]["sd_reading"] for k in ks], marker="o", ls=style,
                         color=colors[mi % len(colors)], label=f"{m}, {layout}")
    for ax, title in zip(axes, ("cos(JAGG, exact): mean, 95% t-interval", "cos(ablate, exact): mean, 95% t-interval",
                                "one reading's cos(JAGG, exact): 1.96 × SD")):
        ax.set_xscale("log", base=2)
        ticks = sorted({r["n"] for r in rows})
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks])
        ax.set_xlabel("images per reading")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("cosine to the exact group gradient")
    axes[2].set_ylabel("half-width of a single reading")
    axes[2].legend(fontsize=7)
    fig.suptitle("dashed: n images of one prompt (the monitor's rows[:4] layout); solid: n/4 images of each of 4 "
                 "prompts", fontsize=9)
    fig.tight_layout()
    p = out / "cos_vs_images.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    made.append(p.name)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    small = min(r["n"] for r in rows if r["layout"] == "prompt")
    large = max(r["n"] for r in rows)
    for ax, (layout, n) in zip(axes, (("prompt", small), ("spread", large))):
        for mi, m in enumerate(models):
            nr = [r for r in rows if r["model"] == m and r["n"] == n and r["layout"] == layout]
            ax.scatter([mean_residual(r) for r in nr], [r["cos_t"] for r in nr], s=10, alpha=0.6,
                       color=colors[mi % len(colors)], label=m)
        ax.set_xlabel("‖v_j − (1−α_j)v_0 − α_j v_3‖/‖v_j‖, mean of j = 1, 2")
        ax.set_ylabel("cos(JAGG, exact)")
        ax.set_title(f"readings of {n} images ({'one prompt' if layout == 'prompt' else 'all prompts'})",
                     fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    p = out / "residual_vs_cos.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    made.append(p.name)
    return made


def _ci(v: dict, d: int = 3) -> str:
    return f"{v['mean']:.{d}f} [{v['lo']:.{d}f}, {v['hi']:.{d}f}]"


def _r(v: dict) -> str:
    return f"{v['r']:+.2f} [{v['lo']:+.2f}, {v['hi']:+.2f}]"


def markdown_tables(summary: dict, kinds: Sequence[str] = ("prompt:4", "prompt:8", "prompt:16", "spread:4",
                                                            "spread:16", "spread:64"),
                    focus: Sequence[str] = ("prompt:4", "spread:64")) -> str:
    """The tables of docs/jagg_fidelity.md, from summary.json."""
    out = []
    models = summary["models"]

    def kind_label(k: str) -> str:
        layout, n = k.split(":")
        return f"{n}, one prompt" if layout == "prompt" else f"{n}, all prompts"

    out.append("| model | images per reading | readings | cos(JAGG, exact) | SD of one reading | share < 0.5 "
               "| cos(ablate, exact) | SD of one reading | JAGG − ablate |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for m, s in models.items():
        for k in kinds:
            if k not in s["kinds"]:
                continue
            row = s["kinds"][k]
            out.append(f"| {m} | {kind_label(k)} | {row['readings']} | {_ci(row['cos_t'])} | "
                       f"{row['cos_t']['sd_reading']:.3f} | {row['cos_t']['below_0_5']:.3f} | "
                       f"{_ci(row['cos_ablate'])} | {row['cos_ablate']['sd_reading']:.3f} | "
                       f"{_ci(row['gain_jagg_minus_ablate'])} |")
    out.append("")
    out.append("| model | images per reading | ‖JAGG − exact‖/‖exact‖ | middle step | share ⟨e_j, e⟩/‖e‖² "
               "| ‖e_j‖/‖e‖ | ‖J_jᵀs_j‖/‖exact‖ | cos(carried_j, J_jᵀs_j) | ‖carried_j‖/‖J_jᵀs_j‖ |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for m, s in models.items():
        for k in focus:
            row = s["kinds"].get(k)
            if row is None:
                continue
            for i, (j, sp) in enumerate(row["split"].items()):
                lead = f"| {m} | {kind_label(k)} | {_ci(row['rel_err'])} " if i == 0 else "| | | "
                out.append(f"{lead}| {j} | {_ci(sp['share'])} | {_ci(sp['norm_ratio'])} | "
                           f"{_ci(sp['step_share_of_exact'])} | {_ci(sp['cos_carried'])} | {_ci(sp['norm_carried'])} |")
    out.append("")
    out.append("| model | middle step | α_j (Eq. 6) | velocity residual | latent residual | fitted α_j | oracle α_j "
               "| r(residual, cos), 4 of one prompt | r(residual, cos), 64 of all prompts |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for m, s in models.items():
        row = s["kinds"][focus[-1]]
        for i, j in enumerate(row["residual_t"]):
            corr = (f"| {_r(s['kinds'][focus[0]]['corr_residual_cos'])} | {_r(row['corr_residual_cos'])} |"
                    if i == 0 else "| | |")
            out.append(f"| {m} | {j} | {s['alpha_t'][int(j)]:.3f} | {_ci(row['residual_t'][j])} | "
                       f"{_ci(row['z_residual_t'][j])} | {_ci(row['alpha_fit'][j])} | {_ci(row['alpha_oracle'][j])} "
                       f"{corr}")
    out.append("")
    out.append("| model | images per reading | cos, α of Eq. 6 | fitted α − Eq. 6 | fitted per image − Eq. 6 "
               "| free (a_j, b_j) − Eq. 6 | oracle α − Eq. 6 |")
    out.append("|---|---|---|---|---|---|---|")
    for m, s in models.items():
        for k in focus:
            row = s["kinds"].get(k)
            if row is None:
                continue
            out.append(f"| {m} | {kind_label(k)} | {_ci(row['cos_t'])} | {_ci(row['diff_fit_minus_t'])} | "
                       f"{_ci(row['diff_fit_image_minus_t'])} | {_ci(row['diff_fit2_minus_t'])} | "
                       f"{_ci(row['diff_oracle_minus_t'])} |")
    pooled = summary.get("pooled", {})
    if pooled:
        out.append("")
        out.append("Pooled over the models, r(residual, cos): " + "; ".join(
            f"{kind_label(k)}: {_r(v['corr_residual_cos'])}" for k, v in pooled.items() if k in focus) + ".")
    return "\n".join(out) + "\n"


def _check_models(models: Sequence[str], ckpt_root: Path) -> None:
    """Every ``--models`` name is ``base`` or a run name with a complete checkpoint under ``ckpt_root``, before any
    model is measured (a name is a folder under it: ``jagg-s0/../x`` is refused, not followed)."""
    from jagg_core.setup.paths import parse_run_name
    from jagg_core.trainer.checkpoint import latest_checkpoint

    for name in models:
        if name == "base":
            continue
        parse_run_name(name, "--models")
        if latest_checkpoint(ckpt_root / name) is None:
            raise StudyError(f"--models {name}: there is no complete checkpoint under {ckpt_root / name}; train it "
                             f"first or pass --ckpt-root.")


def _read_readings(path: Path) -> list[dict]:
    """The readings of earlier calls (none without the file), or one sentence naming the line that is not whole."""
    from jagg_core.setup.storage import read_regular

    if not path.exists() and not path.is_symlink():
        return []
    rows = []
    for n, line in enumerate(read_regular(path, StudyError).decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("model"), str):
            raise StudyError(f"{path} line {n} is not a whole reading (a write cut short?); measure its model again "
                             f"or restore the file.")
        rows.append(row)
    return rows


def _read_meta(path: Path) -> dict:
    """The ``meta`` of an earlier summary.json (how each model was measured), or one sentence."""
    from jagg_core.setup.storage import read_regular

    if not path.exists() and not path.is_symlink():
        return {}
    try:
        meta = json.loads(read_regular(path, StudyError)).get("meta", {})
    except (ValueError, AttributeError):
        meta = None
    if not isinstance(meta, dict):
        raise StudyError(f"{path} is not a whole summary (a write cut short?); restore it or move it aside (its "
                         f"'meta' says how each model was measured).")
    return meta


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="base", help="comma list: base and/or run names (<method>-s<seed>)")
    ap.add_argument("--ckpt-root", default=str(ROOT / "checkpoints" / "toy-full"))
    ap.add_argument("--profile", default="toy-full")
    ap.add_argument("--method", default="jagg", help="the method whose window, anchors and losses are measured")
    ap.add_argument("--seed", type=int, default=0, help="the rollouts' seed")
    ap.add_argument("--first-iteration", type=int, default=0)
    ap.add_argument("--rollouts", type=int, default=4, help="rollouts per model (each prompts_per_iteration × G)")
    ap.add_argument("--per-prompt", type=int, default=16,
                    help="images of each prompt per block (a rollout's G = 32 images of a prompt make 2 blocks)")
    ap.add_argument("--sizes", default="4,8,16", help="images per one-prompt reading (each divides --per-prompt)")
    ap.add_argument("--spread", default="1,2,4,8,16",
                    help="images of each prompt per all-prompt reading (each divides --per-prompt)")
    ap.add_argument("--work", default="/tmp/jagg_fidelity_work", help="scratch root (prompts, no checkpoints)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "jagg_fidelity"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--summarise-only", action="store_true", help="re-read readings.jsonl, redo summary and figures")
    ap.add_argument("--tables", action="store_true", help="also print the markdown tables of docs/jagg_fidelity.md")
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("--methods", default="", help="'all' (the profile's run.methods) or a comma list: each method's "
                    "whole update gradient against the exact one (methods.json), instead of the Gram study")
    ap.add_argument("--reading", type=int, default=16, help="--methods: images per reading, spread over the prompts")
    ap.add_argument("--max-readings", type=int, default=0, help="--methods: at most this many readings per rollout "
                    "(0: every reading the rollout's signal rows make)")
    ap.add_argument("--enumerate", action=argparse.BooleanOptionalAction, default=True,
                    help="--methods: a random-anchor method's expectation from every draw of its law (else from the "
                         "seeded --draws alone, bias then overstated by their spread)")
    ap.add_argument("--alignment", action="store_true", help="--methods: instead, how alike each method's error is "
                    "from one rollout to the next (alignment.json): a bias adds up over iterations, noise does not")
    ap.add_argument("--append", action="store_true", help="--methods: keep methods.jsonl's readings of other models "
                    "and summarise them with these")
    ap.add_argument("--share-enumeration", action=argparse.BooleanOptionalAction, default=True,
                    help="--methods: methods with one law share its enumerated draws within a reading")
    ap.add_argument("--draws", type=int, default=6, help="--methods: seeded draws per reading of a per-image random "
                    "anchor (its one-draw cosine and MSE; the bias is from the exact enumeration of its law)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a param of the profile (e.g. a method to screen: "
                         "methods.k3at2={mode: jagg, anchor_at: [0, 2, 7]})")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",")] + [int(x) for x in args.spread.split(",")]
    except ValueError:
        ap.error("--sizes and --spread are comma lists of whole numbers, e.g. 4,8,16")
    if any(n < 1 for n in sizes) or args.per_prompt < 1 or any(args.per_prompt % n for n in sizes):
        ap.error("every --sizes and --spread value must be at least 1 and divide --per-prompt")
    out = Path(args.out)
    path = out / "readings.jsonl"
    rows = _read_readings(path)
    meta = _read_meta(out / "summary.json")
    if args.summarise_only and not rows:
        raise StudyError(f"{path} holds no readings to summarise; measure a model first (without --summarise-only, "
                         f"e.g. --models base).")
    if not args.summarise_only:
        _check_models(args.models.split(","), Path(args.ckpt_root))
    torch.set_num_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f} s] {msg}", flush=True)

    if args.methods and args.alignment:
        return alignment_main(args, out, log)
    if args.methods:
        return methods_main(args, out, log)
    if not args.summarise_only:
        # one model at a time, each replacing its earlier readings (models are independent: the same seeds give the
        # same rollouts whether they are measured in one call or several)
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        from jagg_core.trainer.update import UpdateContext

        for name in args.models.split(","):
            t0, c0 = time.perf_counter(), time.process_time()
            r = _run_state(args, work)  # a fresh policy per model
            loaded = _load_model(r, name, Path(args.ckpt_root))
            ctx = UpdateContext(r.policy, r.method, r.params.sample, r.params.train, r.sync, r.autocast)
            log(f"model {name}: {loaded}, {sum(p.numel() for p in ctx.policy.trainable_parameters())} "
                f"trained parameters, W = {r.method.window}")
            new: list[dict] = []
            measure_model(r, ctx, name, args, new, log)
            rows = [x for x in rows if x["model"] != name] + new
            atomic_write_text(path, "".join(json.dumps(rec) + "\n" for rec in rows))  # whole or not at all
            meta.setdefault("models", {})[name] = {
                "loaded": loaded, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
                "rollouts": args.rollouts, "first_iteration": args.first_iteration, "seed": args.seed}
        meta.update({
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                       f"torch {torch.__version__}, {args.threads} thread(s)",
            "command": " ".join(["python", "scripts/jagg_fidelity_study.py", *(argv if argv is not None
                                                                              else sys.argv[1:])]),
            "profile": args.profile, "method": args.method, "per_prompt": args.per_prompt, "sizes": args.sizes,
            "spread": args.spread})
    order = list(dict.fromkeys(m for m in ["base", *args.models.split(",")] if any(x["model"] == m for x in rows)))
    rows = sorted(rows, key=lambda x: (order.index(x["model"]) if x["model"] in order else len(order)))
    summary = summarise(rows)
    summary["meta"] = meta
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    made = figures(rows, summary, out)
    if args.tables:
        print(markdown_tables(summary))
    log(f"wrote {out / 'readings.jsonl'}, {out / 'summary.json'}, {', '.join(made)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
