"""Our flow-matching schedules reproduce diffusers' FlowMatchEulerDiscreteScheduler."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from jagg_core import flow_match_schedule, resolution_mu


@pytest.mark.parametrize("steps", [1, 4, 16, 28])
def test_flux_dynamic_shift_matches_diffusers(steps):
    mu = resolution_mu(1024)
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    ours = flow_match_schedule(steps, mu=mu, spacing="flux")
    torch.testing.assert_close(ours.sigmas, sched.sigmas.double(), rtol=0, atol=2.5e-7)  # 2 float32 ulps
    torch.testing.assert_close(ours.timesteps, sched.timesteps.double(), rtol=1e-6, atol=1e-4)
    assert ours.num_steps == steps and float(ours.sigmas[0]) == 1.0 and float(ours.sigmas[-1]) == 0.0


@pytest.mark.parametrize("steps", [4, 10, 40])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_sd3_static_shift_matches_diffusers(steps, shift):
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(steps)
    ours = flow_match_schedule(steps, shift=shift, spacing="sd3")
    torch.testing.assert_close(ours.sigmas, sched.sigmas.double(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.timesteps, sched.timesteps.double(), rtol=1e-6, atol=1e-3)


def test_flux_spacing_with_static_shift_matches_diffusers():
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / 12, 12))
    torch.testing.assert_close(flow_match_schedule(12, shift=3.0).sigmas, sched.sigmas.double(), rtol=0, atol=1e-7)


def test_resolution_mu_is_flux_calculate_shift():
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    for n in (64, 256, 1024, 4096):
        assert resolution_mu(n) == pytest.approx(calculate_shift(n, 256, 4096, 0.5, 1.15))


@pytest.mark.parametrize("kwargs", [dict(num_steps=0), dict(num_steps=4, spacing="karras"), dict(num_steps=4, shift=0.0)])
def test_bad_schedules_are_refused(kwargs):
    with pytest.raises(ValueError):
        flow_match_schedule(**kwargs)


def test_dancegrpo_fixed_shift_schedule_by_hand():
    """DanceGRPO: sigma = linspace(1, 0, T + 1), then s·σ / (1 + (s − 1)·σ); timesteps = 1000·σ[:-1]."""
    from jagg_core.schedules import fixed_shift_schedule

    s = fixed_shift_schedule(4, 3.0)
    want = [3 * x / (1 + 2 * x) for x in (1.0, 0.75, 0.5, 0.25, 0.0)]  # 1, 0.9, 0.75, 0.5, 0
    assert s.sigmas.tolist() == pytest.approx(want, abs=1e-15) and s.sigmas.dtype == torch.float64
    assert s.timesteps.tolist() == pytest.approx([1000 * x for x in want[:-1]])
    with pytest.raises(ValueError, match="shift > 0"):
        fixed_shift_schedule(4, 0.0)
