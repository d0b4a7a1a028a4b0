"""Results say where they came from (jagg_core/setup/provenance.py): speed.json carries what it timed and its
fingerprint, and the report and `jagg run`'s last line show it only at its own settings (or say why not); NaN is a word
and strict JSON; an evaluation of the validation split logs under names that say so, and a re-evaluation logs no point
twice. The evaluations and the side-by-side timing are the real stages on the ci profile's base model (module
fixtures, built once)."""

from __future__ import annotations

import json

from fault_helpers import PARAMS, _one_sentence
from jagg_core.setup.params_io import load_params


# --- the side-by-side speed: shown at its own settings only --------------------------------------------------------


def test_m7_a_sweep_without_the_baseline_says_why_there_is_no_speedup(tmp_path):
    """`jagg run` of methods without the exact baseline ended with "update speedup vs the exact baseline, every method
    timed side by side: " and nothing after it. Now it says there is no baseline and gives the seconds it has."""
    from flows.run import _speed_line
    from jagg_core.bench.side_by_side import speed_rows
    from jagg_core.setup.paths import Layout
    from jagg_core.setup.provenance import fingerprint, speed_made_from

    def measured(params, result):  # speed.json as the speed stage writes it: what it timed, and its fingerprint
        made = speed_made_from(params, list(result["methods"]))
        lay.speed.write_text(json.dumps({**result, "table": speed_rows(result), "made_from": made,
                                         "fingerprint": fingerprint(made)}))

    params = load_params(PARAMS, "ci", {"run.methods": ["jagg", "ablate"]})
    lay = Layout.of(params, tmp_path)
    counts = {"grad_forwards": 2, "nograd_forwards": 2, "reused_velocities": 0}
    timed = {"update": {"median": 0.25, "q1": 0.2, "q3": 0.3}, "counts": counts}
    result = {"methods": {"jagg": {**timed, "mode": "jagg"}, "ablate": {**timed, "mode": "ablate"}}}
    lay.speed.parent.mkdir(parents=True, exist_ok=True)
    measured(params, result)
    line = _one_sentence(_speed_line(params, lay))
    assert "no exact baseline" in line and "jagg 0.250 s" in line and not line.endswith(": "), line
    result["methods"]["baseline"] = {**timed, "mode": "exact"}
    params = load_params(PARAMS, "ci", {"run.methods": ["baseline", "jagg", "ablate"]})
    measured(params, result)
    assert "jagg 1.00x" in _speed_line(params, lay)  # with it, the speedups as before
