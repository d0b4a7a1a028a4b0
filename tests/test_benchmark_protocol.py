"""The HPSv2.1 benchmark protocol: loading the prompt files, scoring an image folder, the block-mean summary."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import pytest
import torch

from jagg_core.evaluation import (
    HPS_STYLES,
    block_means,
    image_path,
    load_hps_benchmark,
    score_image_folder,
    score_records,
    summarize_scores,
)
from jagg_core.setup.storage import PromptFileError

HINT = (
    "download benchmark/{anime,concept-art,paintings,photo}.json from the Hugging Face dataset zhwang/HPDv2 into the "
    "local Hugging Face cache (hf download zhwang/HPDv2 --repo-type dataset --include 'benchmark/*.json'), or into a "
    "folder and pass the folder that holds benchmark/."
)


def write_benchmark(folder: Path, n: int = 6, styles=HPS_STYLES) -> dict[str, list[str]]:
    prompts = {style: [f"{style} prompt {i}" for i in range(n)] for style in styles}
    (folder / "benchmark").mkdir(parents=True)
    for style, ps in prompts.items():
        (folder / "benchmark" / f"{style}.json").write_text(json.dumps(ps))
    return prompts


# --- Prompts ---------------------------------------------------------------------------------------------------------


def test_load_from_either_folder_with_subset(tmp_path):
    prompts = write_benchmark(tmp_path)
    assert load_hps_benchmark(tmp_path) == prompts
    assert load_hps_benchmark(tmp_path / "benchmark") == prompts
    assert list(load_hps_benchmark(str(tmp_path))) == list(HPS_STYLES)
    assert load_hps_benchmark(tmp_path, subset=2) == {s: ps[:2] for s, ps in prompts.items()}
    assert load_hps_benchmark(tmp_path, styles=["photo"]) == {"photo": prompts["photo"]}


def test_load_from_local_hf_cache_only(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(FileNotFoundError) as e:
        load_hps_benchmark()
    assert str(e.value) == f"the benchmark prompts benchmark/anime.json are not in the local Hugging Face cache: {HINT}"
    sha = "1" * 40
    snapshot = cache / "datasets--zhwang--HPDv2" / "snapshots" / sha
    prompts = write_benchmark(snapshot)
    (cache / "datasets--zhwang--HPDv2" / "refs").mkdir()
    (cache / "datasets--zhwang--HPDv2" / "refs" / "main").write_text(sha)
    assert load_hps_benchmark() == prompts


def test_missing_benchmark_errors_word_for_word(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_hps_benchmark(tmp_path / "nowhere")
    assert str(e.value) == f"the benchmark folder '{tmp_path / 'nowhere'}' does not exist: {HINT}"
    write_benchmark(tmp_path)
    (tmp_path / "benchmark" / "photo.json").unlink()
    with pytest.raises(FileNotFoundError) as e:
        load_hps_benchmark(tmp_path)
    assert str(e.value) == f"the benchmark file {tmp_path / 'benchmark' / 'photo.json'} does not exist: {HINT}"


@pytest.mark.parametrize(
    "content, message",
    [
        ("[\"a\", ", "is not valid JSON (Expecting value at line 1, column 7)."),
        ('{"a": 1}', "must hold a non-empty JSON list of prompt strings."),
        ("[]", "must hold a non-empty JSON list of prompt strings."),
        ('["a", 3]', "must hold a non-empty JSON list of prompt strings."),
        (b"\xff\xfe[]", "is not UTF-8 text (byte 0)."),
    ],
)
def test_bad_prompt_files(tmp_path, content, message):
    write_benchmark(tmp_path)
    path = tmp_path / "benchmark" / "paintings.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError) as e:
        load_hps_benchmark(tmp_path)
    assert str(e.value) == f"{path} {message}"


def test_bad_style_names_and_subset(tmp_path):
    write_benchmark(tmp_path)
    for style in ("../x", "Photo", "a/b", "", "photo "):
        with pytest.raises(PromptFileError) as e:  # a UserError: one sentence, no traceback
            load_hps_benchmark(tmp_path, styles=[style])
        assert str(e.value).startswith(f"benchmark style name {style!r} (a file benchmark/<style>.json) is invalid: "
                                       f"use lowercase letters, digits and dashes only, e.g. rename it to ")
    with pytest.raises(ValueError, match=r"^benchmark style name '../x' \(a file"):
        image_path(tmp_path, "../x", 0)
    for subset in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="^subset must be a positive integer or None"):
            load_hps_benchmark(tmp_path, subset=subset)


def test_a_toy_benchmark_file_with_an_underscore_is_one_sentence(ci_project):
    from conftest import run_module

    bench = ci_project / "data/ci/prompts/benchmark"
    (bench / "my_style.json").write_text((bench / sorted(p.name for p in bench.glob("*.json"))[0]).read_text())
    out = run_module("tasks.evaluate", "--profile", "ci", "--run", "base", root=ci_project, timeout=300)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-2000:]
    assert "'my_style'" in lines[0] and "rename it to my-style.json" in lines[0]


# --- Summary ---------------------------------------------------------------------------------------------------------


def test_summary_by_hand_two_styles_five_images_blocks_of_two():
    scores = {"m": {"a": [1.0, 2.0, 3.0, 4.0, 5.0], "b": [0.0, 0.0, 0.0, 0.0, 10.0]}}
    s = summarize_scores(scores, block_size=2)["m"]
    # a: blocks [1, 2] [3, 4] [5] -> means 1.5, 3.5, 5 (the short last block counts as one block)
    #    block_mean = 10/3; deviations -11/6, 1/6, 5/3 -> variance (121 + 1 + 100)/36/3 = 222/108
    # b: blocks [0, 0] [0, 0] [10] -> means 0, 0, 10; block_mean = 10/3; variance (100/9 * 2 + 400/9)/3 = 200/9
    assert block_means(scores["m"]["a"], 2) == [1.5, 3.5, 5.0]
    assert s["styles"]["a"] == pytest.approx(
        {"mean": 3.0, "block_mean": 10 / 3, "block_std": math.sqrt(222 / 108), "n_images": 5, "n_blocks": 3}
    )
    assert s["styles"]["b"] == pytest.approx(
        {"mean": 2.0, "block_mean": 10 / 3, "block_std": math.sqrt(200 / 9), "n_images": 5, "n_blocks": 3}
    )
    assert s["mean"] == pytest.approx(2.5) and s["n_images"] == 10  # (15 + 10) / 10
    assert s["benchmark"] == pytest.approx(10 / 3)


@pytest.mark.parametrize("n", [160, 800])
def test_summary_matches_hpsv2_formula(n):
    rng = np.random.default_rng(n)
    res = {style: rng.normal(0.27, 0.02, size=n).tolist() for style in HPS_STYLES}
    summary = summarize_scores({"hpsv2.1": res})["hpsv2.1"]
    for style, values in res.items():
        # hpsv2/evaluation.py: avg_score = [np.mean(res[i:i+80]) for i in range(0, len, 80)]; np.mean, np.std (x100)
        avg_score = [np.mean(values[i : i + 80]) for i in range(0, n, 80)]
        assert summary["styles"][style]["n_blocks"] == n // 80
        assert summary["styles"][style]["block_mean"] == pytest.approx(np.mean(avg_score), abs=1e-12)
        assert summary["styles"][style]["block_std"] == pytest.approx(np.std(avg_score), abs=1e-12)
        assert summary["styles"][style]["mean"] == pytest.approx(np.mean(values), abs=1e-12)  # equal blocks
    styles = summary["styles"].values()
    assert summary["benchmark"] == pytest.approx(np.mean([s["block_mean"] for s in styles]), abs=1e-12)
    assert summary["mean"] == pytest.approx(np.mean(sum(res.values(), [])), abs=1e-12)


def test_summary_refuses_empty_and_non_finite():
    with pytest.raises(ValueError, match="^no scores"):
        summarize_scores({})
    with pytest.raises(ValueError, match="^metric 'm' has no scores for style 'a'"):
        summarize_scores({"m": {"a": []}})
    with pytest.raises(ValueError) as e:
        summarize_scores({"m": {"a": [0.1, float("nan")]}})
    assert str(e.value) == "metric 'm', style 'a': image 1 scored nan (not finite)."


# --- Scoring a folder ------------------------------------------------------------------------------------------------


def brightness(images, prompts, metadata):
    """A stand-in metric: mean pixel value, with the prompt length and image index as per-image info."""
    b = images.shape[0]
    info = {
        "length": torch.tensor([float(len(p)) for p in prompts]),
        "index": torch.tensor([float(m["index"]) for m in metadata]),
        "batch": float(b),  # a scalar: not a per-image value, so not recorded
    }
    return images.mean(dim=(1, 2, 3)), info


def write_images(root: Path, prompts: dict[str, list[str]], sizes=None) -> dict[str, list[float]]:
    from PIL import Image

    levels = {}
    for s, (style, ps) in enumerate(prompts.items()):
        levels[style] = []
        for i in range(len(ps)):
            value = 10 * i + 40 * s  # flat grey: JPEG keeps it exactly
            w, h = sizes[i] if sizes else (16, 12)
            path = image_path(root, style, i)
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (w, h), (value, value, value)).save(path, quality=95)
            levels[style].append(value / 255)
    return levels


def test_score_image_folder_in_prompt_order_with_info(tmp_path):
    prompts = {"anime": ["a", "bb", "ccc", "dddd", "e"], "photo": ["x", "yy", "zzz"]}
    levels = write_images(tmp_path, prompts)
    for batch_size in (1, 2, 16):
        scores = score_image_folder(tmp_path, prompts, {"m": brightness}, batch_size=batch_size)
        assert set(scores) == {"m", "m/length", "m/index"}
        for style, ps in prompts.items():
            assert scores["m"][style] == pytest.approx(levels[style], abs=1e-6)
            assert scores["m/length"][style] == [float(len(p)) for p in ps]
            assert scores["m/index"][style] == [float(i) for i in range(len(ps))]
    rows = score_records(prompts, scores)
    assert len(rows) == 8 and rows[6] == {
        "style": "photo", "index": 1, "prompt": "yy", "m": pytest.approx(levels["photo"][1]), "m/length": 2.0,
        "m/index": 1.0,
    }
    summary = summarize_scores(scores, block_size=2)
    assert summary["m/length"]["styles"]["anime"]["mean"] == pytest.approx(11 / 5)


def test_score_image_folder_mixed_sizes(tmp_path):
    prompts = {"photo": ["a", "b", "c", "d"]}
    levels = write_images(tmp_path, prompts, sizes=[(16, 12), (16, 12), (8, 8), (16, 12)])
    scores = score_image_folder(tmp_path, prompts, {"m": brightness}, batch_size=4)
    assert scores["m"]["photo"] == pytest.approx(levels["photo"], abs=1e-6)


def test_score_image_folder_missing_image_word_for_word(tmp_path):
    prompts = {"anime": ["a", "b"], "photo": ["c", "d", "e"]}
    write_images(tmp_path, prompts)
    image_path(tmp_path, "photo", 1).unlink()
    image_path(tmp_path, "photo", 2).unlink()
    calls = []
    with pytest.raises(FileNotFoundError) as e:
        score_image_folder(tmp_path, prompts, {"m": lambda *a: calls.append(a)})
    assert str(e.value) == (
        f"image {tmp_path / 'photo' / '00001.jpg'} is missing (2 of the 5 images under {tmp_path} are missing): "
        f"generate the images first."
    )
    assert calls == []  # checked before any model runs
    image_path(tmp_path, "photo", 1).write_bytes(b"not a jpeg")
    image_path(tmp_path, "photo", 2).write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match=f"^{re.escape(str(image_path(tmp_path, 'photo', 1)))} is not a readable image "
                                         r"\(not a format PIL knows\); remove it"):
        score_image_folder(tmp_path, prompts, {"m": brightness})
