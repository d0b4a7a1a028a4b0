"""The `speed` stage's timing (jagg_core/bench/side_by_side.py) that a busy machine cannot tilt: every piece timed by
the wall clock and by the thread's CPU time, the ratios from the steadier clock, the rounds a load disturbed named,
and figures too spread to trust withheld (issue 70)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jagg_core.bench.side_by_side import DISTURBED, _summary, disturbed_rounds, speed_rows, steadier_clock


def test_a_round_whose_wall_time_exceeds_its_cpu_time_is_named():
    # (wall, cpu) seconds of each round's pieces: round 2 waited 50% longer than it computed, round 3 just within
    rounds = [(2.00, 2.00), (3.00, 2.00), (2.00 * (1 + DISTURBED) - 0.01, 2.00), (2.30, 2.00)]
    assert disturbed_rounds(rounds, "cpu") == [{"round": 2, "wall_over_cpu": 1.5}, {"round": 4, "wall_over_cpu": 1.15}]
    # on a GPU the host's own time is in the wall clock: against the quietest round's ratio
    assert disturbed_rounds([(1.2, 1.0), (1.3, 1.0), (1.5, 1.0)], "cuda") == [{"round": 3, "wall_over_cuda": 1.5}]
    assert disturbed_rounds(rounds, None) == []  # several threads: no clock of the thread's own


def test_the_ratios_come_from_the_steadier_clock_and_each_figure_from_the_fastest_half_of_the_rounds():
    wall = {"baseline": [4.0, 4.1, 2.2, 6.0, 3.1], "jagg": [1.4, 2.9, 1.5, 4.2, 2.8]}  # a load all along
    cpu = {"baseline": [2.0, 2.02, 1.99, 2.03, 2.0], "jagg": [1.4, 1.41, 1.39, 1.42, 1.4]}
    chosen, spreads = steadier_clock({"wall": wall, "cpu": cpu})
    # each clock's worst method's fastest half (2 of 5 rounds): (max - min) / mean
    assert chosen == "cpu" and spreads["cpu"] == pytest.approx(0.01 / 1.395)  # jagg's: 1.39, 1.4
    assert spreads["wall"] == pytest.approx(0.9 / 2.65)  # baseline's: 2.2, 3.1
    assert steadier_clock({"wall": cpu, "cpu": cpu})[0] == "wall"  # a tie: the wall clock
    result = {"methods": {m: {"mode": mode, "update": _summary(cpu[m]),
                              "counts": {"grad_forwards": 4.0, "nograd_forwards": 0.0, "reused_velocities": 0.0}}
                          for m, mode in (("baseline", "exact"), ("jagg", "jagg"))}}
    rows = {r["method"]: r for r in speed_rows(result)}
    assert rows["jagg"]["update_s"] == pytest.approx((1.39 + 1.4) / 2)  # its fastest half: 2 of 5 rounds
    assert rows["jagg"]["speedup"] == pytest.approx(((1.99 + 2.0) / 2) / ((1.39 + 1.4) / 2))


def test_a_round_run_beside_a_busy_process_on_the_same_core_is_named(ci_base, tmp_path):
    """Three rounds of ci's methods on one core; a busy process shares that core during round 2 only: the round is
    named (its wall time holds the busy process's share, its CPU time does not). The report shows
    them with the clock and the round; had they spread too much to trust, it says so instead of showing them."""
    import torch

    from jagg_core.bench.side_by_side import side_by_side
    from jagg_core.build import policy_from_params
    from jagg_core.setup.params_io import load_params
    from jagg_core.setup.paths import Layout

    params = load_params(ci_base / "params.yaml", "ci")
    lay = Layout(ci_base, "ci")
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    core = min(cpus)
    busy: list[subprocess.Popen] = []

    def beside(line: str) -> None:  # called after each round
        if line.endswith("round 1/3"):  # round 2 shares the core with a busy process, running before it starts
            busy.append(subprocess.Popen(
                [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}}); print('busy', flush=True)\n"
                                       f"while True: pass"], stdout=subprocess.PIPE, text=True))
            assert busy[0].stdout.readline().strip() == "busy"
        elif busy and busy[0].poll() is None:
            busy[0].kill()
            busy[0].wait()

    os.sched_setaffinity(0, {core})  # this thread (and the torch thread) on one core
    torch.set_num_threads(1)
    try:
        policy = policy_from_params(params, lay, torch.device("cpu"))
        result = side_by_side(params, lay, params.run.methods, policy=policy, rounds=3, progress=beside)
    finally:
        for p in busy:
            if p.poll() is None:
                p.kill()
                p.wait()
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)
    named = {d["round"]: d["wall_over_cpu"] for d in result["disturbed_rounds"]}
    assert 2 in named and named[2] > 1.5, result["disturbed_rounds"]  # it had about half the core
    assert set(result["spread"]) == {"wall", "cpu"}  # of 3 rounds the fastest one: a tie, the wall clock's
    for m in result["methods"].values():
        assert m["update"] == m["clocks"][result["clock"]]
        wall, cpu = m["clocks"]["wall"]["samples"], m["clocks"]["cpu"]["samples"]
        assert wall[1] > cpu[1] * (1 + DISTURBED)  # round 2's wall time holds the busy process's share

    import json

    from jagg_core.bench.side_by_side import write_result
    from jagg_core.pipeline.report import read_side_by_side
    from jagg_core.pipeline.report_pages import side_note

    mine = Layout(tmp_path, "ci")
    write_result({**result, "trusted": True}, mine.speed)
    side, _ = read_side_by_side(params, mine)
    assert side is not None and "the steadier of the clocks" in side_note({"side_by_side": side})
    named = side_note({"side_by_side": side}).split("rounds the machine's load disturbed: ")[1].split(".")[0]
    assert "2" in named.split(", "), named
    why = "its rounds spread too much to trust a ratio: (q3 - q1) / median 31% by the steadier clock (cpu)"
    # An untrusted measurement of the same settings does not replace the trusted one: it goes beside it (a `dvc
    # repro` on a busy machine put "cannot be trusted" in place of good figures), and the report still shows them.
    untrusted = {**result, "trusted": False, "untrusted": why}
    assert write_result(untrusted, mine.speed) == mine.speed.with_name("speed.untrusted.json")
    assert read_side_by_side(params, mine)[0] is not None and json.loads(mine.speed.read_text())["trusted"] is True
    assert json.loads(mine.speed.with_name("speed.untrusted.json").read_text())["untrusted"] == why
    # Where there is no trusted one of these settings (none, or one of other settings), the untrusted one is written
    write_result({**result, "trusted": True, "fingerprint": "0" * 16}, mine.speed)  # another settings' figures
    assert write_result(untrusted, mine.speed) == mine.speed
    mine.speed.unlink()
    assert write_result(untrusted, mine.speed) == mine.speed
    side, note = read_side_by_side(params, mine)
    shown = side_note({"side_by_side": side, "side_by_side_note": note})
    assert side is None and shown.startswith(f"The side-by-side measurement is not shown: runs/ci/speed.json cannot "
                                             f"be trusted: {why}.")
