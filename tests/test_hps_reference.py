"""HPSv2.1 against the reference package ``hpsv2`` itself (PyPI ``hpsv2x==1.2.0``, installed by ``make setup``).

``hpsv2x`` is the fork of ``hpsv2`` that ships the BPE vocabulary (the ``hpsv2`` wheel lacks it). It pins
``pytest==7.2.0`` and ``protobuf<4``, so the set-up installs it with ``--no-deps`` as a test-only reference; it is
never imported by ``jagg_core``. Of its own code only what the two checks below need is imported (see
:func:`import_hpsv2`). It is a required test dependency: if it is missing these tests fail, they do not skip.

* :func:`test_hps_scores_equal_the_hpsv2_reference`: open_clip ViT-H-14 with random weights (one state dict, saved
  once to a local file) scores the same images and prompts through ``hpsv2.img_score.score`` -- its vendored
  ``open_clip``'s ``create_model_and_transforms`` (exactly ``hpsv2.evaluation.initialize_model``: no pretrained tag),
  its ``preprocess_val``, its tokenizer, its scoring -- and through :func:`jagg_core.rewards.hps.make_hps`.
* :func:`test_benchmark_summary_equals_hpsv2_evaluation`: the same synthetic per-image scores (4 styles x 800
  prompts) go through ``hpsv2.evaluation.evaluate_benchmark`` (the real function: only the model, the image transform
  and the tokenizer are stand-ins that make it produce those scores) and through
  :func:`jagg_core.evaluation.summarize_scores`.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import sys
import types

import numpy as np
import pytest
import torch

from jagg_core.evaluation import HPS_STYLES, summarize_scores
from jagg_core.rewards.hps import make_hps

pytestmark = [
    # hpsv2 scores under torch.cuda.amp.autocast(), deprecated and (without CUDA) disabled with a warning; its
    # vendored open_clip imports timm.models.layers, deprecated in timm. Neither is ours to fix.
    pytest.mark.filterwarnings(r"ignore:`torch\.cuda\.amp\.autocast\(args\.\.\.\)` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings(r"ignore:.*CUDA is not available:UserWarning"),
    pytest.mark.filterwarnings(r"ignore:Importing from timm\.models\.layers is deprecated:FutureWarning"),
]


def import_hpsv2() -> types.SimpleNamespace:
    """hpsv2's ``img_score``, ``evaluation`` and vendored ``open_clip`` modules, importable with our stack.

    Two of hpsv2's module-level imports need packages that ``--no-deps`` leaves out and that none of the code used
    here calls, so stand-ins are put in ``sys.modules`` while hpsv2 is imported, and removed afterwards:

    * ``clint`` (``from clint.textui import progress``): imported by ``hpsv2/__init__.py`` via ``hpsv2/utils.py``,
      i.e. by every ``hpsv2.*`` import; ``progress`` is only used for download progress bars.
    * ``hpsv2.src.training.train`` and ``.data`` (need ``einops``, ``webdataset``, ``braceexpand``): imported by
      ``hpsv2/evaluation.py`` for ``calc_ImageReward``, ``inversion_score``, ``ImageRewardDataset``,
      ``collate_rank`` and ``RankingDataset``, which only its ``ImageReward`` and ``test`` modes use, not
      ``evaluate_benchmark`` or ``initialize_model``.
    """
    if importlib.util.find_spec("hpsv2") is None:
        pytest.fail("the reference package hpsv2x is not installed: run `make setup` (it installs hpsv2x==1.2.0 "
                    "--no-deps).")
    stubs = {
        "clint": {"textui": None},
        "clint.textui": {"progress": None},
        "hpsv2.src.training.train": {"calc_ImageReward": None, "inversion_score": None},
        "hpsv2.src.training.data": {"ImageRewardDataset": None, "collate_rank": None, "RankingDataset": None},
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, attrs in stubs.items():
            stub = types.ModuleType(name)
            stub.__dict__.update(attrs)
            mp.setitem(sys.modules, name, stub)
        sys.modules["clint"].textui = sys.modules["clint.textui"]
        import hpsv2.evaluation
        import hpsv2.img_score
        import hpsv2.src.open_clip
    return types.SimpleNamespace(
        evaluation=hpsv2.evaluation, img_score=hpsv2.img_score, open_clip=hpsv2.src.open_clip
    )


# --- Scores ----------------------------------------------------------------------------------------------------------

# Non-square sizes, to exercise the longest-side resize and the padding: wide, tall (odd padding), smaller than 224.
SIZES = [(320, 512), (600, 231), (97, 150)]
PROMPTS = [
    "a photo of a red fox in the snow",
    "Concept art of a floating city at dusk, highly detailed, trending on artstation, by Greg Rutkowski",
    "oil painting of a lighthouse " * 12,  # > 77 tokens: truncated
]


def reference_images(seed: int = 0) -> list[torch.Tensor]:
    """(3, H, W) uint8 images: upsampled low-resolution noise plus fine noise (detail for the resize to act on)."""
    g = torch.Generator().manual_seed(seed)
    images = []
    for h, w in SIZES:
        low = torch.rand(1, 3, h // 8 + 1, w // 8 + 1, generator=g)
        x = torch.nn.functional.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)[0]
        x = (x + 0.1 * torch.rand(3, h, w, generator=g)).clamp(0, 1)
        images.append((x * 255).round().to(torch.uint8))
    return images


@pytest.mark.slow
def test_hps_scores_equal_the_hpsv2_reference(tmp_path, monkeypatch):
    from PIL import Image

    hps = import_hpsv2()
    # hpsv2 picks CUDA when there is one and then scores under fp16 autocast: compare in float32 on the CPU.
    monkeypatch.setattr(hps.evaluation, "device", "cpu")
    monkeypatch.setattr(hps.img_score, "device", "cpu")
    model_dict: dict = {}
    monkeypatch.setattr(hps.evaluation, "model_dict", model_dict)
    monkeypatch.setattr(hps.img_score, "model_dict", model_dict)
    images = reference_images()

    # The reference model: hpsv2.evaluation.initialize_model() is create_model_and_transforms('ViT-H-14', None,
    # precision='amp', device, ..., light_augmentation=True, output_dict=True) -- no pretrained tag, random init.
    torch.manual_seed(0)
    hps.evaluation.initialize_model()
    # Its random weights, saved once as HPSv2.1 ships them ({'state_dict': ...}); float16 on disk halves the file
    # (2 GB instead of 4), and both sides load these same values into their float32 models.
    checkpoint = tmp_path / "HPS_v2.1_compressed.pt"
    try:
        state_dict = {k: v.half() if v.is_floating_point() else v for k, v in model_dict["model"].state_dict().items()}
        torch.save({"state_dict": state_dict}, checkpoint)
        del state_dict

        # hpsv2.score -> img_score.score: initialize_model() builds nothing when model_dict is already filled (its own
        # would fetch laion2B-s32B-b79K), then it loads `cp` strictly, tokenises with get_tokenizer('ViT-H-14'),
        # preprocesses with preprocess_val and returns the diagonal of image_features @ text_features.T (both
        # L2-normalised).
        reference = [
            float(hps.img_score.score([Image.fromarray(im.permute(1, 2, 0).numpy())], prompt, cp=str(checkpoint))[0])
            for im, prompt in zip(images, PROMPTS)
        ]
        model_dict.clear()
        gc.collect()

        fn = make_hps(checkpoint=str(checkpoint), model_name="ViT-H-14")
        ours = [float(fn(im[None].float() / 255, [prompt], [{}])[0][0]) for im, prompt in zip(images, PROMPTS)]
        del fn
        gc.collect()
    finally:
        checkpoint.unlink(missing_ok=True)  # 2 GB: not left in pytest's kept tmp folders

    diffs = [abs(a - b) for a, b in zip(ours, reference)]
    assert max(diffs) <= 1e-5, f"ours {ours}, hpsv2 {reference}: |diff| {diffs}"
    # Not vacuous: the scores of different images and prompts differ by far more than the tolerance.
    assert max(reference) - min(reference) > 1e-3, reference


# --- Benchmark protocol ----------------------------------------------------------------------------------------------


class RecordingNumpy:
    """Stands in for ``np`` inside ``hpsv2.evaluation``: computes with numpy and records each ``mean``/``std``."""

    def __init__(self):
        self.calls: list[tuple[str, int, float]] = []  # (function, length of its argument, result)

    def mean(self, a):
        return self._record("mean", a, np.mean(a))

    def std(self, a):
        return self._record("std", a, np.std(a))

    def _record(self, name, a, result):
        self.calls.append((name, len(a), float(result)))
        return result


@pytest.mark.parametrize("lengths", [(800, 800, 800, 800), (800, 130, 45, 240)], ids=["benchmark", "uneven-toy"])
def test_benchmark_summary_equals_hpsv2_evaluation(tmp_path, monkeypatch, capsys, lengths):
    from PIL import Image

    hps = import_hpsv2()
    rng = np.random.default_rng(sum(lengths))
    scores = {style: rng.normal(0.27, 0.02, size=n).tolist() for style, n in zip(HPS_STYLES, lengths)}

    # hpsv2's layout: <data_path>/<style>.json (prompts), <img_path>/<style>/<index:05d>.jpg (BenchmarkDataset only
    # checks that the files exist and Image.open()s them lazily). Prompt "<style> <i>" stands for image i's score.
    data_path, img_path = tmp_path / "prompts", tmp_path / "method"
    data_path.mkdir()
    Image.new("RGB", (1, 1)).save(tmp_path / "pixel.jpg")
    jpeg = (tmp_path / "pixel.jpg").read_bytes()
    by_prompt = {}
    for style, values in scores.items():
        prompts = [f"{style} {i}" for i in range(len(values))]
        by_prompt.update(zip(prompts, values))
        (data_path / f"{style}.json").write_text(json.dumps(prompts))
        (img_path / style).mkdir(parents=True)
        for i in range(len(values)):
            (img_path / style / f"{i:05d}.jpg").write_bytes(jpeg)

    # Stand-ins for the model, transform and tokenizer that make evaluate_benchmark's
    # `logits_per_image = image_features @ text_features.T * 100` have diagonal 100 * score (float64, one product).
    def transform(image):
        return torch.ones(1, dtype=torch.float64)

    def tokenizer(prompt):
        return torch.tensor([[by_prompt[prompt]]], dtype=torch.float64)

    def model(images, texts):
        return {"image_features": images, "text_features": texts}

    recorder = RecordingNumpy()
    monkeypatch.setattr(hps.evaluation, "np", recorder)
    hps.evaluation.evaluate_benchmark(str(data_path), str(img_path), model, 20, transform, tokenizer, "cpu")
    printed = capsys.readouterr().out

    # evaluate_benchmark, per style (in os.listdir order), then overall:
    #     avg_score = [np.mean(res[i:i+80]) for i in range(0, len(res), 80)]
    #     all_score.extend(res)
    #     print(model_id, style, '{:.2f}'.format(np.mean(avg_score)), '\t', '{:.4f}'.format(np.std(avg_score)))
    #     print(model_id, 'Average', '{:.2f}'.format(np.mean(all_score)), '\t')
    lines = [line.split() for line in printed.splitlines() if line.startswith("method ")]
    order = [line[1] for line in lines[:-1]]
    assert sorted(order) == sorted(HPS_STYLES) and lines[-1][1] == "Average", printed
    calls = iter(recorder.calls)
    reference = {}
    for style in order:
        n_blocks = -(-len(scores[style]) // 80)
        blocks = [next(calls) for _ in range(n_blocks)]
        sizes = [min(80, len(scores[style]) - 80 * k) for k in range(n_blocks)]
        assert [(f, n) for f, n, _ in blocks] == [("mean", size) for size in sizes]
        (f_mean, n_mean, block_mean), (f_std, n_std, block_std) = next(calls), next(calls)
        assert (f_mean, n_mean, f_std, n_std) == ("mean", n_blocks, "std", n_blocks)
        reference[style] = {"block_mean": block_mean, "block_std": block_std, "n_blocks": n_blocks}
    f_all, n_all, average = next(calls)
    assert (f_all, n_all) == ("mean", sum(lengths)) and next(calls, None) is None

    # hpsv2 prints x100 (the logits); the summary keeps the reward's units.
    summary = summarize_scores({"hpsv2.1": scores})["hpsv2.1"]
    for style, ref in reference.items():
        ours = summary["styles"][style]
        assert ours["n_blocks"] == ref["n_blocks"]
        assert 100 * ours["block_mean"] == pytest.approx(ref["block_mean"], rel=1e-12, abs=0)
        assert 100 * ours["block_std"] == pytest.approx(ref["block_std"], rel=1e-9, abs=0)
    line = {style: line for style, line in zip(order, lines)}
    for style, ours in summary["styles"].items():
        assert line[style][2:] == [f"{100 * ours['block_mean']:.2f}", f"{100 * ours['block_std']:.4f}"]
    # hpsv2's "Average" is the mean over all images pooled; with equal styles (the benchmark's 4 x 800) that is also
    # the average of the per-style means, our "benchmark".
    assert 100 * summary["mean"] == pytest.approx(average, rel=1e-12, abs=0)
    assert lines[-1][2:] == [f"{100 * summary['mean']:.2f}"]
    if len(set(lengths)) == 1:
        assert 100 * summary["benchmark"] == pytest.approx(average, rel=1e-12, abs=0)
