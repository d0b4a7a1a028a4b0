"""`jagg plan`: what a run of a real profile will cost — parameters, memory per rank, FLOPs, hours on H100/H200.

    jagg plan --profile flux [--set KEY=VALUE] [--utilisation 0.35] [--json]

Arithmetic only (no weights, no GPU): see jagg_core/pipeline/plan.py for the model and docs/scaling.md for its check against
the paper's own wall-clock figures.
"""

from __future__ import annotations

import argparse
import json
import sys

from jagg_core.setup.config import ParamsError

from .common import add_common_args, cli, load, parse_overrides

__all__ = ["main"]


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg plan", description=__doc__.splitlines()[0],
                                 epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--utilisation", type=float, default=None,
                    help="model FLOPs utilisation assumed for the times (default 0.35)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    # loads torch: imported when the stage runs, so --help and a refused input answer without it
    from jagg_core.pipeline.plan import UTILISATION, format_plan, plan

    util = UTILISATION if args.utilisation is None else args.utilisation
    if not 0 < util <= 1:
        raise ParamsError(f"--utilisation {util} must be in (0, 1], e.g. 0.35.")
    params = load(args.profile, args.params, parse_overrides(args.overrides))
    p = plan(params, utilisation=util)
    print(json.dumps(p, indent=1) if args.json else format_plan(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
