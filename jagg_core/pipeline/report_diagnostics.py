"""The report's training diagnostics: what practitioners watch beside the reward, one curve each.

- ``train/kl_ref``: KL(policy ‖ reference) of the trained steps, logged even at β = 0 (``train.kl_ref``);
- per reward ``reward/<name>/group_std``: the mean within-group standard deviation of the reward, and
  ``reward/<name>/zero_std_frac``: the share of groups whose rewards are all equal (they carry no gradient).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..setup.config import Params
from .report_figures import plot_curves

__all__ = ["diagnostic_figures"]


def diagnostic_figures(params: Params, runs: Sequence[Any], out: Path) -> dict[str, str]:
    """Draw each diagnostic some run logged into ``out``; returns {figure title: file name} for the report."""
    curves = [("train/kl_ref", "KL(policy ‖ reference) of the trained steps (train/kl_ref)", "kl_ref.png")]
    for name in params.reward.weights:
        curves += [(f"reward/{name}/group_std", f"{name}: mean within-group std of the rollouts' reward",
                    f"group_std-{name}.png"),
                   (f"reward/{name}/zero_std_frac", f"{name}: share of groups with all rewards equal (no gradient)",
                    f"zero_std_frac-{name}.png")]
    figures = {}
    for key, title, name in curves:
        if plot_curves(runs, key, title, out / name):
            figures[key] = name
    return figures
