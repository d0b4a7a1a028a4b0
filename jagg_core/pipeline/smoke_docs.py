"""The "GPU smoke test" section of ``docs/benchmarks.md``: what `jagg smoke` runs and checks, and its figures (a
result rendered as markdown: :func:`render_table`), between markers that regenerating the page keeps
(:mod:`jagg_core.pipeline.bench_docs`)."""

from __future__ import annotations

import math
from typing import Any, Mapping

from jagg_core.pipeline.report_pages import markdown_table

__all__ = ["SMOKE_END", "SMOKE_START", "render_table", "replace_smoke_block", "smoke_section"]


# The smoke test's figures live between these markers: `jagg smoke --write-docs` fills them in, and regenerating the
# page (write_markdown) keeps what is there.
SMOKE_START, SMOKE_END = "<!-- smoke:start -->", "<!-- smoke:end -->"


def smoke_section(result: dict | None = None) -> list[str]:
    """The page's "GPU smoke test" section: what `jagg smoke` runs and checks, then its figures (``result``, from
    a GPU run) or the statement that they are not measured yet."""
    lines = [
        "## GPU smoke test", "",
        "`scripts/gpu_smoke.sh` (= `.venv/bin/jagg smoke`) needs one GPU and nothing downloaded: it builds a random "
        "tiny Flux (FLUX.1-dev's pipeline classes and folder layout; 256 px, the 36 M-parameter shape of the `large` "
        "model; bfloat16 weights under bf16 autocast) and trains it through the real trainer for 4 iterations of "
        "each method of the `flux` profile — baseline, JAGG, ablate and JAGG with rollout-velocity reuse — with every "
        "group routed (jagg_frac 1, every group trained). It checks that the PPO ratio is exactly 1 at the first "
        "optimizer step (iteration 1's `approx_kl` and `clipfrac` exactly 0; exit status 1 otherwise) and reports "
        "per method the peak GPU memory (`torch.cuda.max_memory_allocated`) and the update stage's median time over "
        "iterations 2–4 with its speedup over the baseline, in `reports/smoke/flux-cuda.json` and as a table. "
        "`scripts/gpu_smoke.sh --device cpu` runs the same code at a reduced size (64 px, 8 steps, a one-block "
        "transformer, no memory figures): `tests/test_gpu_smoke.py` runs it in CI. "
        "`scripts/gpu_smoke.sh --write-docs docs/benchmarks.md` puts a GPU run's table here.", "",
        SMOKE_START,
    ]
    if result is None:
        lines += ["**Not yet run on a GPU** (no GPU was available when it was written): no figures yet."]
    else:
        lines += [f"Measured on {result['created'][:10]} by `scripts/gpu_smoke.sh` (torch "
                  f"{result['machine'].get('torch', '?')}, diffusers {result['machine'].get('diffusers', '?')}):", "",
                  render_table(result).rstrip()]
    return lines + [SMOKE_END, ""]


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def render_table(result: Mapping[str, Any]) -> str:
    """The result as markdown: a settings line, the per-method table, and the verdict."""
    c, m, rec = result["config"], result["model"], result["recipe"]
    gpu = f" ({result['machine']['gpu']})" if "gpu" in result["machine"] else ""
    trained = "—" if m["trainable_params"] is None else f"{m['trainable_params'] / 1e6:.2f} M"
    head = (f"Smoke test of profile `{c['profile']}` on `{c['device']}`{gpu}: a random tiny "
            f"{'Wan' if 'num_frames' in m.get('geometry', {}) else 'Flux'} ({trained} trained "
            f"parameters, {m['resolution']} px = {m['image_tokens']} image tokens, {m['text_tokens']} text tokens), "
            f"{m['dtype']} weights under {m['mixed_precision']} autocast; {rec['recipe']} with {rec['num_steps']} "
            f"steps ({rec['trained_steps']} trained), W = {rec['window']}, jagg_frac {rec['jagg_frac']:g}, "
            f"{rec['images_per_iteration']} images per iteration in micro-batches of {rec['micro_batch']}, "
            f"gradient checkpointing {'on' if rec['gradient_checkpointing'] else 'off'}; {c['iterations']} "
            f"iterations per method. Times are medians over iterations 2–{c['iterations']}.")
    rows = [["method", "first-step approx_kl", "first-step clipfrac", "ratio = 1", "peak memory MiB",
             "update s", "update speedup", "ideal speedup", "iteration s", "iteration speedup"]]
    for r in result["methods"]:
        fs = r["first_step"]
        rows.append([
            r["method"], _num(fs["approx_kl"], ".3g"), _num(fs["clipfrac"], ".3g"),
            "PASS" if r["ratio_is_one"] else "FAIL",
            "n/a (CPU)" if r["peak_memory_mb"] is None else f"{r['peak_memory_mb']:.0f}",
            _num(r["update_s"], ".3g"), _num(r["update_speedup"], ".2f") + ("×" if r["update_speedup"] else ""),
            _num(r["ideal_update_speedup"], ".2f") + "×", _num(r["iteration_s"], ".3g"),
            _num(r["iteration_speedup"], ".2f") + ("×" if r["iteration_speedup"] else ""),
        ])
    checks = result["checks"]
    verdict = ("All checks passed: the PPO ratio is exactly 1 at the first optimizer step for every method."
               if checks["passed"] else "FAILED: " + " ".join(checks["failures"]))
    notes = ("Speedups are over the first method's medians; *ideal* is the cost model's (forward 1, backward 2) "
             "from the forwards the trainer counted. Peak memory: `torch.cuda.max_memory_allocated` over the "
             "method's run (weights, optimizer state, the update's graphs), reset before each method.")
    if not c["device"].startswith("cuda"):
        notes += (" On a CPU at the reduced size the times are mostly per-call overhead and the machine's other "
                  "load, not the work JAGG saves: read the speedups of a GPU run.")
    return "\n".join([head, "", markdown_table(rows), notes, "", verdict, ""])


def replace_smoke_block(text: str, block: str) -> str | None:
    """``text`` with its smoke block (markers included) replaced by ``block``; None if ``text`` has none."""
    start, end = text.find(SMOKE_START), text.find(SMOKE_END)
    if start < 0 or end < start:
        return None
    return text[:start] + block + text[end + len(SMOKE_END):]


def _smoke_block(text: str) -> str | None:
    start, end = text.find(SMOKE_START), text.find(SMOKE_END)
    return text[start:end + len(SMOKE_END)] if 0 <= start < end else None
