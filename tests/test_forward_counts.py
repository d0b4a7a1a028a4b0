"""The transformer forwards a training run really makes, counted call by call, against `jagg plan`'s arithmetic
(jagg_core/pipeline/plan.py:forward_counts), and train/kl_ref's reference forwards at their cadence
(train.kl_ref_every at β = 0; every iteration at β > 0, where the KL is part of the loss)."""

from __future__ import annotations

import math

import pytest
import torch

from jagg_core.setup.params_io import load_params
from jagg_core.pipeline.plan import forward_counts
from jagg_core.policies.toy_flux import ToyFluxPolicy
from jagg_core.trainer import loop, train


class _Tracer:
    """Every ToyFluxPolicy.velocity call as image-step forwards (rows of the call), by iteration, phase (rollout,
    update, fidelity), policy or frozen reference, and with or without a graph."""

    def __init__(self, monkeypatch):
        self.counts: dict[tuple, int] = {}
        self.iteration, self.phase = -1, "update"
        velocity = ToyFluxPolicy.velocity

        def traced(policy, latents, timesteps, embeds):
            ref = policy.transformer is getattr(policy, "_reference", None)
            key = (self.iteration, self.phase, "reference" if ref else "policy",
                   "grad" if torch.is_grad_enabled() else "nograd")
            self.counts[key] = self.counts.get(key, 0) + int(latents.shape[0])
            return velocity(policy, latents, timesteps, embeds)

        def in_phase(name, fn, new_iteration=False):
            def wrapped(*a, **k):
                if new_iteration:
                    self.iteration += 1
                self.phase = name
                try:
                    return fn(*a, **k)
                finally:
                    self.phase = "update"
            return wrapped

        monkeypatch.setattr(ToyFluxPolicy, "velocity", traced)
        monkeypatch.setattr(loop, "rollout", in_phase("rollout", loop.rollout, new_iteration=True))
        monkeypatch.setattr(loop, "trajectory_fidelity", in_phase("fidelity", loop.trajectory_fidelity))

    def get(self, *key) -> int:
        return self.counts.get(key, 0)

    def total(self, phase: str, who: str, grad: str) -> int:
        return sum(self.get(it, phase, who, grad) for it in range(self.iteration + 1))


# the unbiased JAGG's random anchor over one group of the 6 steps: 3 graphs, 3 no-grad forwards per image, whether
# drawn per group or per image (then each middle step is forwarded on the rows that did not draw it)
RANDOM_ANCHOR_METHODS = {"jagg-u6": {"mode": "jagg", "window": 6, "random_anchor": "group"},
                         "jagg-ui6": {"mode": "jagg", "window": 6, "random_anchor": "image"}}


@pytest.mark.parametrize("method,beta", [("jagg", 0.0), ("jagg", 0.04), ("jagg-u6", 0.0), ("jagg-ui6", 0.0)])
def test_traced_forwards_match_the_plan_and_kl_ref_runs_at_its_cadence(ci_project, monkeypatch, method, beta):
    """ci: 6 steps in two groups of W = 3 (the first JAGG), 8 images; 3 iterations, kl_ref and the fidelity monitor
    every 2nd (iterations 1 and 3). β = 0: the reference runs only at those iterations, two endpoint steps per group
    and image; β > 0: every iteration, at every trained step (the loss's KL). The planner's per-image counts, times
    the images and iterations, are the calls the run made. The random-anchor methods train a ci run through the real
    trainer with one group of W = 6 (its endpoints still the steps train/kl_ref reads)."""
    extra = {f"methods.{method}": RANDOM_ANCHOR_METHODS[method]} if method in RANDOM_ANCHOR_METHODS else {}
    params = load_params(ci_project / "params.yaml", "ci", {
        "reward.weights": {"jpeg_compressibility": 1.0}, "train.iterations": 3, "train.kl_ref_every": 2,
        "train.fidelity_every": 2, "train.beta": beta, "train.checkpoint_every": 3, "train.log_images_every": 0,
        **extra})
    groups = 1 if extra else 2
    tracer = _Tracer(monkeypatch)
    res = train(params, method, 0, root=ci_project, progress=False)
    n_it = params.train.iterations
    images = params.sample.prompts_per_iteration * params.sample.group_size
    assert tracer.iteration == n_it - 1
    assert all(h["train/kept_fraction"] == 1.0 for h in res.history)  # every image trained: the plan's assumption

    # The cadence: reference forwards in the update only where train/kl_ref is measured, and logged only there.
    measured = [it for it in range(n_it) if beta > 0 or it % params.train.kl_ref_every == 0]
    assert measured == ([0, 1, 2] if beta > 0 else [0, 2])
    per_group = 3 if beta > 0 else 2  # β > 0: every trained step of a group of W = 3; β = 0: its two endpoints
    for it, h in enumerate(res.history):
        ref = tracer.get(it, "update", "reference", "nograd")
        assert ref == (images * groups * per_group if it in measured else 0), (it, ref)
        assert tracer.get(it, "update", "reference", "grad") == 0  # the reference never records a graph
        assert (("train/kl_ref" in h) and ("time/kl_ref" in h)) == (it in measured), it
        if it in measured:
            assert math.isfinite(h["train/kl_ref"])

    # The planner's counts, per image of the iteration and amortised over the run, against the traced totals.
    u = forward_counts(params, params.method(method))
    total = images * n_it
    assert tracer.total("rollout", "policy", "nograd") == pytest.approx(u["rollout"] * total)
    assert tracer.total("rollout", "policy", "grad") == 0
    assert tracer.total("update", "policy", "grad") == pytest.approx(u["grad"] * total)
    assert tracer.total("update", "policy", "nograd") == pytest.approx(u["nograd"] * total)
    assert tracer.total("update", "reference", "nograd") == pytest.approx((u["reference"] + u["kl_ref"]) * total)
    assert (u["reference"] > 0) == (beta > 0) and (u["kl_ref"] > 0) == (beta == 0)
    assert tracer.total("fidelity", "policy", "grad") == pytest.approx(u["monitor_grad"] * total)
    assert tracer.total("fidelity", "policy", "nograd") == pytest.approx(u["monitor_nograd"] * total)
    assert tracer.total("fidelity", "reference", "nograd") == pytest.approx(u["monitor_reference"] * total)
    assert u["monitor_runs"] == 2 and tracer.get(1, "fidelity", "policy", "grad") == 0
    assert sum(1 for k in tracer.counts if k[1] == "fidelity") > 0
    if extra:  # K = 2 and the random anchor: 3 graphs and 3 no-grad forwards per image, the plan's and the run's
        assert (u["grad"], u["nograd"]) == (3, 3)
        assert all(h["train/grad_forwards"] == 3 and h["train/backward_calls"] == 1 for h in res.history)
        assert all(math.isfinite(h["train/loss"]) for h in res.history)
