"""Stage `speed`: every method's update stage timed side by side on the run's own model and batch.

    jagg speed [--profile toy] [--rounds N]       (default resources.speed_rounds)

Each training run times its own iterations at its own time; on a shared machine that lets the machine's load tilt a
comparison of methods. This stage times the update stage of every method of ``run.methods`` interleaved — each round
every method (and the rollout) once, in a shuffled order; medians over rounds — on one stored rollout of the profile's
base model with the profile's batch, and writes ``runs/<outputs>/speed.json``, which the report's speed table reads
(jagg_core/bench/side_by_side.py; docs/results.md, "Speed, side by side").
"""

from __future__ import annotations

import argparse
import sys

from jagg_core.setup.config import Params
from jagg_core.setup.paths import Layout

from .common import add_common_args, cli, layout, load, parse_overrides, stage_logger
from jagg_core.errors import UserError

def speed(params: Params, lay: Layout, *, rounds: int | None = None) -> dict | None:
    """Time every method of ``run.methods`` side by side (``rounds``, default ``resources.speed_rounds``; 0: not at
    all); returns the result (also ``runs/<outputs>/speed.json``)."""
    import torch

    # loads torch: imported when the stage runs, so --help and a refused input answer without it
    from jagg_core.bench.side_by_side import side_by_side, write_result
    from jagg_core.build import pick_device, policy_from_params

    log = stage_logger("speed")
    rounds = params.resources.speed_rounds if rounds is None else rounds
    if not rounds:
        log.info("resources.speed_rounds is 0: no side-by-side timing (the report shows each run's own times)")
        return None
    device = pick_device(params)
    # On the CPU one thread unless resources.num_threads says otherwise: a multi-threaded torch on cores another job
    # also wants spins at every barrier, and how much depends on the number of kernels, not on their work, which
    # tilts methods of different shapes unequally; one thread is slowed by a load in proportion.
    threads = torch.get_num_threads()
    torch.set_num_threads(params.resources.num_threads or 1 if device.type == "cpu" else threads)
    try:
        policy = policy_from_params(params, lay, device)
        result = side_by_side(params, lay, params.run.methods, policy=policy, rounds=rounds, progress=log.info)
    finally:
        torch.set_num_threads(threads)  # the flow runs this stage in its own process: leave its threads as found
    where = write_result(result, lay.speed)
    if where != lay.speed:
        log.warning("side by side: this measurement cannot be trusted (%s); %s keeps the trusted one of the same "
                    "settings, and this one is in %s", result["untrusted"], lay.speed, where)
        return result
    disturbed = ", ".join(str(d["round"]) for d in result["disturbed_rounds"])
    log.info("side by side: timed by the %s clock; rounds the machine's load disturbed: %s", result["clock"],
             disturbed or "none")
    if not result["trusted"]:
        log.warning("side by side: no figures: %s", result["untrusted"])
        return result
    for row in result["table"]:
        log.info("side by side: %s update %.3f s (fastest half of %d rounds)%s", row["method"], row["update_s"], rounds,
                 f", {row['speedup']:.2f}x the exact baseline (ideal {row['ideal']:.2f}x)" if "speedup" in row else "")
    return result


def speed_stage(params: Params) -> dict:
    return speed(params, layout(params))




@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg speed", description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default resources.speed_rounds)")
    args = ap.parse_args(argv)
    params = load(args.profile, args.params, parse_overrides(args.overrides))
    if args.rounds is not None and not 3 <= args.rounds <= 1000:
        raise UserError(f"--rounds {args.rounds} must be between 3 and 1000.")
    speed(params, layout(params), rounds=args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
