"""`jagg run`: the reproduction flow end to end on one profile (Prefect in-process; no server needed).

With ``--set KEY=VALUE`` the flow run is a sweep point: its outputs go to folders of their own (see flows.reproduce).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from jagg_core.pipeline.config import ParamsError
from tasks.common import ROOT, add_common_args, cli, layout, parse_overrides

from .reproduce import flow_params, reproduce


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg run", description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--parallel-runs", type=int, default=1, help="training runs at a time (GPU partitions)")
    ap.add_argument("--restart", action="store_true",
                    help="runs whose checkpoints were written with other params start over (moved aside)")
    args = ap.parse_args(argv)
    if args.parallel_runs < 1:
        raise ParamsError(f"--parallel-runs {args.parallel_runs} must be at least 1.")
    overrides = parse_overrides(args.overrides) or None
    params = flow_params(args.profile, args.params, overrides)  # bad params fail here, before Prefect starts
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    t0 = time.perf_counter()
    reproduce(profile=params.profile, parallel_runs=args.parallel_runs, overrides=overrides, params_file=args.params,
              sweep=f"run-{time.strftime('%Y%m%d-%H%M%S')}", restart=args.restart)
    lay = layout(params)
    print(f"\njagg: profile {params.profile} done in {time.perf_counter() - t0:.0f} s; report: "
          f"{(lay.report_dir / 'index.html').relative_to(ROOT)} (MLflow UI: `jagg ui`)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
