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

from .common import add_common_args, cli, layout, load, parse_overrides

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
    p = plan(params, utilisation=util, given=_given(args), eval_prompts=_eval_prompts(params))
    print(json.dumps(p, indent=1) if args.json else format_plan(p))
    return 0


def _given(args: argparse.Namespace) -> str:
    """What the plan was asked with beyond the profile, for the commands it prints: ``--params`` and each ``--set``
    (shell-quoted; a secret's value redacted). A command printed without them ran the project's params instead."""
    import shlex

    from jagg_core.setup.redact import redact

    parts = (["--params", args.params] if args.params else []) + [a for o in args.overrides for a in ("--set", o)]
    return "".join(" " + shlex.quote(redact(a)) for a in parts)


def _eval_prompts(params) -> int | None:  # noqa: ANN001  (Params)
    """The test set's prompts as the evaluation would read them (eval.protocol, eval.benchmark, eval.subset), or None
    where they cannot be read here (not downloaded): the plan then counts the protocol's published size."""
    from jagg_core.errors import UserError
    from jagg_core.evaluation.evaluate import test_prompts

    try:
        return sum(len(p) for p in test_prompts(params, layout(params)).values())
    except (UserError, OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
