"""`jagg export`: a training checkpoint as files diffusers loads.

    jagg export --profile flux --run jagg-s0 [--step N] [--out DIR]

A full fine-tune becomes a transformer folder (`FluxTransformer2DModel.from_pretrained(DIR / "transformer")`, likewise
for SD3 and Qwen-Image; the toy's loads the same way); a LoRA run becomes `DIR/pytorch_lora_weights.safetensors` for
`pipe.load_lora_weights(DIR)`. The default DIR is exports/<profile>/<run>-step<N>/; an existing, non-empty DIR is
never overwritten.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import ROOT, add_common_args, cli, layout, load, parse_overrides
from jagg_core.setup.paths import inside, parse_run_name

__all__ = ["export", "main"]


def export(params, run: str, *, step: int | None = None, out=None, root=ROOT):
    """Export checkpoint ``step`` (default: the newest verified one) of ``run``; returns the folder written."""
    import torch

    # loads torch: imported when the stage runs, so --help and a refused input answer without it
    from jagg_core.build import policy_from_params
    from jagg_core.pipeline.export import ExportError, export_transformer
    from jagg_core.policies.lora import load_trainable_state_dict
    from jagg_core.trainer.checkpoint import list_checkpoints

    parse_run_name(run)  # one reading of a run name: `../../esc/x-s0` names no run (it exported from outside)
    lay = layout(params, root)
    if out:
        inside(root, out, "--out", kind="dir")
    else:  # the default folder: a link on its way out of the project is refused before any work, naming no --out
        default = Path(root) / "exports" / lay.outputs
        if not default.resolve().is_relative_to(Path(root).resolve()):
            raise ExportError(f"the default export folder {default} (no --out was given) leads outside the project "
                              f"through a link ({default.resolve()}); remove the link, or pass --out DIR inside the "
                              f"project.")
    found = list_checkpoints(lay.checkpoints(run))
    if not found:
        raise ExportError(f"run {run!r} of profile {params.profile!r} has no complete checkpoint under "
                          f"{lay.checkpoints(run)}; train it first (jagg train / jagg run).")
    if step is None:
        ckpt = found[-1]
    else:
        ckpt = next((c for c in found if c.iteration == step), None)
        if ckpt is None:
            raise ExportError(f"run {run!r} has no checkpoint at step {step}; its checkpoints: "
                              f"{', '.join(str(c.iteration) for c in found)}.")
    dest = root / out if out else root / "exports" / lay.outputs / f"{run}-step{ckpt.iteration}"
    if not dest.resolve().is_relative_to(Path(root).resolve()):
        what = f"--out {out!r}" if out else f"the default export folder {dest} (no --out was given)"
        raise ExportError(f"{what} leads outside the project ({dest.resolve()}); pass a folder inside it.")
    policy = policy_from_params(params, lay, torch.device("cpu"))
    load_trainable_state_dict(policy.transformer, ckpt.tensors())
    card = {"profile": params.profile, "run": run, "iteration": ckpt.iteration, "checkpoint": str(ckpt.path),
            "base_model": params.model.path or str(lay.base_model)}
    return export_transformer(policy.transformer, dest, backbone=params.model.backbone, card=card)


class _Terminated(KeyboardInterrupt):
    def __init__(self, signum: int):
        super().__init__("interrupted by SIGTERM")
        self.signum = signum


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jagg export", description=__doc__.splitlines()[0],
                                 epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--run", required=True, help="the training run, <method>-s<seed>, e.g. jagg-s0")
    ap.add_argument("--step", type=int, default=None, help="checkpoint iteration (default: the newest)")
    ap.add_argument("--out", default=None, help="output folder, repository-relative (default exports/<profile>/...)")
    args = ap.parse_args(argv)
    params = load(args.profile, args.params, parse_overrides(args.overrides))
    import signal

    def _stop(signum, frame):  # noqa: ANN001  (SIGTERM as Ctrl-C: the temporary folder is removed, exit 143)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise _Terminated(signum)

    signal.signal(signal.SIGTERM, _stop)
    print(export(params, args.run, step=args.step, out=args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
