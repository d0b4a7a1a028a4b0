"""`jagg smoke`, the one-command GPU smoke test: the same code on CPU at its reduced size (the GPU size where a GPU
is visible). A random tiny Flux trained by the real trainer for every method under bf16 autocast: the first PPO
ratio is exactly 1, and the table and the JSON have a row per method."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import REPO, run_module

METHODS = ["baseline", "jagg", "ablate", "jagg-reuse"]


def _table_rows(text: str) -> dict[str, list[str]]:
    """method -> the cells of its row in the printed markdown table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in METHODS:
            rows[cells[0]] = cells
    return rows


def _check_result(result: dict, *, cuda: bool) -> None:
    assert result["checks"] == {"passed": True, "failures": []}
    assert [r["method"] for r in result["methods"]] == METHODS
    for r in result["methods"]:
        assert r["first_step"]["approx_kl"] == 0.0 and r["first_step"]["clipfrac"] == 0.0, r["method"]
        assert r["ratio_is_one"] and r["update_s"] > 0 and len(r["history"]) == result["config"]["iterations"]
        assert (r["peak_memory_mb"] > 0) if cuda else (r["peak_memory_mb"] is None)
    by = {r["method"]: r for r in result["methods"]}
    assert by["baseline"]["update_speedup"] == 1.0
    # The work each method did is the trainer's counted forwards: JAGG's ideal at W = 4 is 3W/(W + 4) = 1.5,
    # reuse W/2 = 2 (every group routed).
    assert by["jagg"]["ideal_update_speedup"] == pytest.approx(1.5)
    assert by["jagg-reuse"]["ideal_update_speedup"] == pytest.approx(2.0)
    assert result["model"]["dtype"] == "bfloat16" and result["model"]["mixed_precision"] == "bf16"


def _jagg_smoke(tmp_path, *args: str):
    """`jagg smoke ARGS` through the `jagg` entry point, in a process of its own as a user runs it (the trainer's
    accelerate state is process-wide: bf16 here would refuse the float32 trainings of later tests)."""
    out = tmp_path / "smoke.json"
    proc = run_module("flows.cli", "smoke", "--params", str(REPO / "params.yaml"), "--out", str(out), *args,
                      root=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, out


@pytest.mark.slow  # every method through the trainer in a process of its own (~30 s)
def test_smoke_on_cpu_passes_and_writes_its_table(tmp_path):
    """`jagg smoke --device cpu` end to end: exit 0, every method PASS in the printed table, and the JSON (strict:
    no NaN) and markdown written."""
    printed, out = _jagg_smoke(tmp_path, "--device", "cpu")
    rows = _table_rows(printed)
    assert list(rows) == METHODS
    assert all(r[3] == "PASS" and r[4] == "n/a (CPU)" for r in rows.values()), rows
    assert "All checks passed" in printed and "profile `flux` on `cpu`" in printed
    result = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    _check_result(result, cuda=False)
    assert result["model"]["resolution"] == 64 and result["recipe"]["num_steps"] == 8
    assert out.with_suffix(".md").read_text().strip() in printed


def _fake_result(firsts, *, device="cpu", peak=None) -> dict:
    """A result as run_smoke returns it, with the given (method, approx_kl, clipfrac) at the first step."""
    from jagg_core.smoke.run import check

    rows = [{"method": m, "first_step": {"approx_kl": kl, "clipfrac": clip, "kept_fraction": 1.0},
             "ratio_is_one": kl == 0.0 and clip == 0.0, "peak_memory_mb": peak, "update_s": 1.0,
             "update_speedup": 1.0, "ideal_update_speedup": 1.0, "iteration_s": 2.0, "iteration_speedup": 1.0}
            for m, kl, clip in firsts]
    result = {"created": "2026-12-01T00:00:00+00:00", "config": {"profile": "flux", "device": device, "iterations": 4},
              "machine": {"torch": "2.14.1", "diffusers": "0.42.1", **({"gpu": "NVIDIA H200"} if peak else {})},
              "model": {"trainable_params": 1000, "resolution": 64, "image_tokens": 16, "text_tokens": 32,
                        "dtype": "bfloat16", "mixed_precision": "bf16"},
              "recipe": {"recipe": "dance_grpo", "num_steps": 8, "trained_steps": 8, "window": 4, "jagg_frac": 1.0,
                         "images_per_iteration": 4, "micro_batch": 2, "gradient_checkpointing": True},
              "methods": rows}
    result["checks"] = check(result)
    return result


def test_a_failed_check_exits_1_with_one_sentence(monkeypatch, tmp_path, capsys):
    """A ratio that is not 1 (or no update at all) fails the command with the reason, after the table."""
    from tasks import smoke as smoke_task

    firsts = (("baseline", 0.0, 0.0), ("jagg", 3e-9, 0.25), ("ablate", math.nan, math.nan))
    monkeypatch.setattr(smoke_task, "run_smoke", lambda cfg, **_kw: _fake_result(firsts))
    monkeypatch.setattr(smoke_task, "ROOT", tmp_path)  # --out follows the path rule: inside the project
    rc = smoke_task.main(["--device", "cpu", "--out", str(tmp_path / "s.json")])
    cap = capsys.readouterr()
    assert rc == 1
    assert [r[3] for r in _table_rows(cap.out).values()] == ["PASS", "FAIL", "FAIL"]
    assert cap.err.strip() == ("jagg: error: the smoke test failed: jagg: the PPO ratio is not 1 at the first "
                               "optimizer step (approx_kl 3e-09, clipfrac 0.25; both must be exactly 0): the rollout "
                               "and the update computed different velocities under bf16. (1 more above)")
    assert "ablate: no update ran at iteration 1" in cap.out
    assert json.loads((tmp_path / "s.json").read_text())["methods"][2]["first_step"]["approx_kl"] is None


def test_write_docs_fills_the_section_and_bench_regeneration_keeps_it(monkeypatch, tmp_path):
    """docs/benchmarks.md is generated by `jagg bench`: its GPU smoke test section says the figures are not measured
    until `jagg smoke --write-docs` puts a GPU run's table there, and regenerating the page keeps that table."""
    from jagg_core.pipeline import bench_docs as markdown
    from tasks.smoke import write_docs

    page = tmp_path / "benchmarks.md"
    monkeypatch.setattr(markdown, "_plot_iteration", lambda r, path: False)
    monkeypatch.setattr(markdown, "render_markdown",
                        lambda results, figures=None: "# bench\n\n" + "\n".join(markdown.smoke_section()))
    markdown.write_markdown([{"model": {"name": "toy"}}], page)
    assert "## GPU smoke test" in page.read_text() and "**Not yet run on a GPU**" in page.read_text()
    gpu = _fake_result([("baseline", 0.0, 0.0), ("jagg", 0.0, 0.0)], device="cuda", peak=123.0)
    write_docs(gpu, page)
    filled = page.read_text()
    assert "Not yet run" not in filled and "Measured on 2026-12-01" in filled and "(NVIDIA H200)" in filled
    assert [r[4] for r in _table_rows(filled).values()] == ["123", "123"]
    markdown.write_markdown([{"model": {"name": "toy"}}], page)  # `jagg bench --write-docs` again
    assert page.read_text() == filled


def test_bench_regeneration_keeps_every_section_measured_by_hand(monkeypatch, tmp_path):
    """A study's section of docs/benchmarks.md (issue 63's joint vs sequential, measured by hand) was dropped by the
    next `jagg bench --write-docs`, which rewrites the page: blocks between the kept markers stay, in order, before
    "## Reproduce", once each however often the page is regenerated."""
    from jagg_core.pipeline import bench_docs as markdown

    page = tmp_path / "benchmarks.md"
    monkeypatch.setattr(markdown, "_plot_iteration", lambda r, path: False)
    monkeypatch.setattr(markdown, "render_markdown", lambda results, figures=None: "# bench\n\n## Reproduce\n\nx\n")
    blocks = [f"{markdown.KEPT_START}\n## Study {k}\n\nfigures {k}\n{markdown.KEPT_END}" for k in (1, 2)]
    page.write_text("# old\n\n" + blocks[0] + "\n\nold table\n\n" + blocks[1] + "\n\n## Reproduce\n\nx\n")
    markdown.write_markdown([{"model": {"name": "toy"}}], page)
    once = page.read_text()
    assert once == "# bench\n\n" + blocks[0] + "\n\n" + blocks[1] + "\n\n## Reproduce\n\nx\n"
    markdown.write_markdown([{"model": {"name": "toy"}}], page)
    assert page.read_text() == once


@pytest.mark.parametrize("args, message", [
    (["--profile", "sd3"], "profile 'sd3' has backbone 'sd3' (use flux, flux-fast or wan)"),
    (["--resolution", "40"], "--resolution 40 must be a positive multiple of 16 pixels"),
    (["--methods", "baseline,jag"], "run.methods names 'jag', which is not defined under methods"),
    (["--set", "train.inner_epochs=2"], "train.inner_epochs and train.optimizer_steps_per_epoch must be 1"),
    (["--iterations", "1"], "--iterations 1 must be at least 2"),
    (["--write-docs", "docs/benchmarks.md"], "--write-docs records the GPU figures: run it on cuda"),
])
def test_settings_that_cannot_run_are_one_sentence(monkeypatch, tmp_path, capsys, args, message):
    """Refused before anything is built or trained."""
    from tasks import smoke as smoke_task
    from tasks.smoke import main

    monkeypatch.setattr(smoke_task, "ROOT", tmp_path)  # --out follows the path rule: inside the project

    rc = main(["--device", "cpu", "--params", str(REPO / "params.yaml"), "--out", str(tmp_path / "s.json"), *args])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("jagg: error: ") and message in err, err
    assert not (tmp_path / "s.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_smoke_at_the_gpu_size(tmp_path):
    """The GPU size (256 px, the 36 M-parameter Flux shape, the profile's 16 steps) on cuda: every check passes and
    each method has its peak memory."""
    _printed, out = _jagg_smoke(tmp_path)
    result = json.loads(out.read_text())
    _check_result(result, cuda=True)
    assert result["model"]["resolution"] == 256 and result["recipe"]["num_steps"] == 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_wan_smoke_at_the_gpu_size(tmp_path):
    """The wan case (jagg_core/smoke/wan.py): a tiny random Wan (256 px × 17 frames, 4 blocks) trained by every method
    in bf16 on cuda: the first PPO ratio is exactly 1 and each method has its peak memory."""
    _printed, out = _jagg_smoke(tmp_path, "--profile", "wan")
    result = json.loads(out.read_text())
    _check_result(result, cuda=True)
    assert result["model"]["geometry"]["num_frames"] == 17 and result["recipe"]["num_steps"] == 16
