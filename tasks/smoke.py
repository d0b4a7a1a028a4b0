"""`jagg smoke`: the one-command GPU smoke test — a tiny random Flux, every method a few iterations in bf16.

    jagg smoke [--device cuda|cpu] [--profile flux] [--methods baseline,jagg,ablate,jagg-reuse] [--iterations 4]
               [--resolution PX] [--steps T] [--threads N] [--out PATH] [--write-docs docs/benchmarks.md]
               [--set KEY=VALUE]

Builds a FLUX.1-dev-shaped pipeline with random weights (nothing is downloaded) and trains each method through the
real trainer (`train`) of a Flux profile, its weights swapped for the tiny ones, under bf16 mixed precision. It checks
that the PPO ratio is exactly 1 at the first optimizer step (iteration 1's approx_kl and clipfrac exactly 0) and
reports, per method, peak GPU memory and the update stage's time and speedup over the baseline. Exit status 1 if a
check fails. On a GPU (the default) the model is 256 px with the bench's 36 M-parameter Flux shape; `--device cpu`
runs the same code at a reduced size (64 px, 8 steps, a one-block transformer) in 15–60 s on 2 cores, without
memory figures. The result is written as JSON to --out (default reports/smoke/<profile>-<device>.json) with the
printed markdown table beside it (.md); `--write-docs` also puts a GPU run's table into the "GPU smoke test" section
of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from jagg_core.setup.paths import inside
from jagg_core.setup.storage import atomic_write_text, read_regular

from jagg_core.pipeline.smoke_docs import SMOKE_START, render_table, replace_smoke_block, smoke_section
from .common import ROOT, add_common_args, cli, parse_overrides, stage_logger
from jagg_core.smoke.run import DEFAULT_METHODS, SIZES, SmokeConfig, SmokeError, run_smoke, write_result

__all__ = ["main", "smoke"]


def smoke(cfg: SmokeConfig, *, params_path: str | Path | None = None, out: str | Path | None = None,
          root: Path = ROOT, progress: bool = True) -> tuple[dict, Path]:
    """Run the smoke test, write its JSON (and the markdown beside it); returns the result and the JSON's path."""
    log = stage_logger("smoke")
    path = Path(out) if out else Path("reports") / "smoke" / f"{cfg.profile}-{cfg.device}.json"
    path = path if path.is_absolute() else root / path
    with _quiet_loaders():
        result = run_smoke(cfg, params_path=params_path or root / "params.yaml",
                           progress=log.info if progress else None)
    write_result(result, path)
    atomic_write_text(path.with_suffix(".md"), render_table(result))
    return result, path


def _docs_target(path: str | Path, cfg: SmokeConfig, root: Path = ROOT) -> Path:
    """The page whose smoke block --write-docs replaces: GPU figures only, into a page that has the block."""
    if cfg.device != "cuda" or (cfg.size or "gpu") != "gpu":
        raise SmokeError("--write-docs records the GPU figures: run it on cuda at the GPU size (no --device cpu, no "
                         "--size cpu).")
    path = Path(path) if Path(path).is_absolute() else root / path
    text = read_regular(path, SmokeError).decode("utf-8", "replace") if path.exists() else ""
    if replace_smoke_block(text, "") is None:
        raise SmokeError(f"{path} has no GPU smoke test section (its <!-- smoke:start --> and <!-- smoke:end --> "
                         "markers); regenerate it with `jagg bench --write-docs` first.")
    return path


def write_docs(result: dict, path: Path) -> Path:
    """Replace the page's smoke block with this run's table."""
    section = "\n".join(smoke_section(result))
    block = section[section.index(SMOKE_START):].rstrip("\n")
    atomic_write_text(path, replace_smoke_block(read_regular(path, SmokeError).decode("utf-8", "replace"), block))
    return path


@contextlib.contextmanager
def _quiet_loaders():
    """No per-component loading bars while it runs: each method loads the pipeline once, and the bars would bury
    the table. Put back as they were after."""
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    was = dlog.is_progress_bar_enabled(), tlog.is_progress_bar_enabled()
    dlog.disable_progress_bar()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        for enabled, lib in zip(was, (dlog, tlog)):
            if enabled:
                lib.enable_progress_bar()


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg smoke", description=__doc__.splitlines()[0],
                                 epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda (default: the GPU size) or cpu (the reduced size, for CI)")
    ap.add_argument("--size", default=None, choices=tuple(SIZES),
                    help="model and rollout size (default: the device's)")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"methods of the profile, comma-separated; the first is the baseline of the speedups "
                         f"(default {','.join(DEFAULT_METHODS)})")
    ap.add_argument("--iterations", type=int, default=4, help="iterations per method; the first is warm-up (default 4)")
    ap.add_argument("--resolution", type=int, default=None, help="pixels, a multiple of 16 (default: 256 on cuda, 64 "
                    "on cpu)")
    ap.add_argument("--steps", type=int, default=None,
                    help="denoising steps (default: the profile's on cuda, 8 on cpu)")
    ap.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default=None, metavar="PATH",
                    help="the JSON result, repository-relative (default reports/smoke/<profile>-<device>.json)")
    ap.add_argument("--write-docs", default=None, metavar="PAGE",
                    help="put a GPU run's table into this page's GPU smoke test section, e.g. docs/benchmarks.md")
    args = ap.parse_args(argv)

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    cfg = SmokeConfig(device=args.device, size=args.size, profile=args.profile or "flux", methods=methods,
                      iterations=args.iterations, resolution=args.resolution, num_steps=args.steps, seed=args.seed,
                      threads=args.threads, overrides=parse_overrides(args.overrides))
    cfg.validate()  # one sentence before minutes of building
    # the project's one rule for path arguments, before the work: `--out /x.json` wrote anywhere
    out = inside(ROOT, args.out, "--out", kind="file") if args.out else None
    docs = _docs_target(inside(ROOT, args.write_docs, "--write-docs", kind="file"), cfg) if args.write_docs else None
    result, path = smoke(cfg, params_path=args.params, out=out)
    print(render_table(result))
    print(f"Written: {path} and {path.with_suffix('.md')}" + (f"; the table in {write_docs(result, docs)}"
                                                               if docs else ""))
    if not result["checks"]["passed"]:
        raise SmokeError(f"the smoke test failed: {result['checks']['failures'][0]}"
                         + (f" ({len(result['checks']['failures']) - 1} more above)"
                            if len(result["checks"]["failures"]) > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
