"""`jagg run`: the reproduction flow end to end on one profile (Prefect in-process; no server needed)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from jagg_core.config import ParamsError
from tasks.common import ROOT, add_common_args, cli, layout, load

from .reproduce import reproduce


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg run", description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--parallel-runs", type=int, default=1, help="training runs at a time (GPU partitions)")
    args = ap.parse_args(argv)
    if args.parallel_runs < 1:
        raise ParamsError(f"--parallel-runs {args.parallel_runs} must be at least 1.")
    if args.overrides:
        raise SystemExit("jagg run: --set is not supported here; edit params.yaml or add a profile.")
    params = load(args.profile, args.params)  # fail on bad params before Prefect starts
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("JAGG_SWEEP", f"run-{time.strftime('%Y%m%d-%H%M%S')}")
    t0 = time.perf_counter()
    reproduce(profile=params.profile, parallel_runs=args.parallel_runs)
    lay = layout(params)
    print(f"\njagg: profile {params.profile} done in {time.perf_counter() - t0:.0f} s; report: "
          f"{(lay.report_dir / 'index.html').relative_to(ROOT)} (MLflow UI: `jagg ui`)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
