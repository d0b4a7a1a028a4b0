"""The toy rewards: hand-computed cases, a slow reference, ground truth = 1, noise ≈ 0, monotone falls under damage."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

from jagg_core.rewards import RewardError, make_reward
from jagg_core.rewards.toy import fidelity_components
from jagg_core.world import (
    BACKGROUNDS,
    CELLS,
    COLORS,
    FAMILIES,
    SIZES,
    Object,
    Scene,
    cell_assignments,
    cell_boxes,
    object_mask,
    parse_prompt,
    render,
    sample_prompt,
    sample_training_pair,
    scene_for_prompt,
)


def _batch(images: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255  # (B, 3, H, W) in [0, 1]


def _score(images: list[np.ndarray], prompts: list[str]) -> np.ndarray:
    rewards, _ = make_reward("toy_fidelity")(_batch(images), prompts, [{}] * len(prompts))
    return rewards.double().numpy()


def _drawn(scene: Scene, size: int = 32) -> np.ndarray:
    """``scene`` without its objects: its background only."""
    return render(Scene(scene.background, ()), size)


def _paint(image: np.ndarray, obj: Object, color=None, shift=(0, 0)) -> np.ndarray:
    """``image`` with ``obj`` painted on it, in its colour or ``color``, moved by ``shift`` pixels (y, x)."""
    mask = np.roll(object_mask(obj, image.shape[0]), shift, axis=(0, 1))
    out = image.copy()
    out[mask] = COLORS[obj.color] if color is None else color
    return out


def _prompts(seed: int, family: str, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [sample_prompt(rng, family) for _ in range(n)]


def _non_increasing(scores: np.ndarray, tol: float = 1e-9) -> bool:
    return bool((np.diff(scores) <= tol).all())


# Hand-computed cases (default weights: 0.4 objects, 0.3 background, 0.3 precision):

PROMPT = "a large red square at the center on a black background"
SQUARE = Scene("black", (Object("square", "red", "large", "center"),))  # 49 pixels, rows/cols 13..19


def test_by_hand_missing_row_stray_pixel_and_off_colour():
    image = render(SQUARE)
    cut = image.copy()
    cut[13, 13:20] = 0  # one row of the 7×7 square painted black: IoU 42/49, nothing else wrong
    stray = image.copy()
    stray[2, 2] = COLORS["red"]  # one red pixel in another cell: 1 of 975 background pixels, 1 of 50 foreground
    close = image.copy()
    close[object_mask(SQUARE.objects[0])] = (215, 0, 0)  # 40 from red, within tau_full = 50: still fully red
    dim = image.copy()
    dim[object_mask(SQUARE.objects[0])] = (175, 0, 0)  # 80 from red: membership ((120² − 80²)/(120² − 50²))²
    got = _score([image, cut, stray, close, dim], [PROMPT] * 5)
    want = [1.0, 42 / 49, 0.4 + 0.3 * 974 / 975 + 0.3 * 49 / 50, 1.0, (8000 / 11900) ** 2]
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_components_by_hand():
    wrong_background = _paint(render(Scene("white", ())), SQUARE.objects[0])
    parts = fidelity_components(np.stack([wrong_background]), [PROMPT])
    assert parts["objects"][0] == pytest.approx(1.0) and parts["background"][0] == pytest.approx(0.0)
    assert parts["precision"][0] == pytest.approx(49 / 1024)  # all of the white is paint that is not black
    assert _score([wrong_background], [PROMPT])[0] == pytest.approx(0.4 + 0.3 * 49 / 1024)
    # Naming no background, any of them fits.
    parts = fidelity_components(np.stack([wrong_background]), ["a large red square at the center"])
    assert [parts[k][0] for k in ("objects", "background", "precision")] == pytest.approx([1, 1, 1])


def _slow_objects(image: np.ndarray, prompt: str, tau: float = 120.0, tau_full: float = 50.0) -> float:
    """The objects term one placement and one pixel at a time, straight from the definition."""
    spec = parse_prompt(prompt)
    size = image.shape[0]
    boxes = cell_boxes(size)
    best = 0.0
    for cells in cell_assignments(spec).tolist():
        for sizes in itertools.product(SIZES, repeat=len(spec.objects)):
            if any(o.size not in (None, z) for o, z in zip(spec.objects, sizes)):
                continue
            total = 0.0
            for o, k, z in zip(spec.objects, cells, sizes):
                mask = object_mask(Object(o.shape, o.color or "red", z, CELLS[k]), size)
                colors = [COLORS[o.color]] if o.color else list(COLORS.values())
                inter = union = 0.0
                y0, y1, x0, x1 = boxes[k]
                for y, x in itertools.product(range(y0, y1), range(x0, x1)):
                    d2 = [float(((image[y, x].astype(float) - np.array(c)) ** 2).sum()) for c in colors]
                    m = max(min(1.0, max(0.0, (tau**2 - d) / (tau**2 - tau_full**2))) ** 2 for d in d2)
                    inter += m if mask[y, x] else 0.0
                    union += 1.0 if mask[y, x] else m
                total += inter / union
            best = max(best, total / len(spec.objects))
    return best


def test_objects_term_matches_slow_reference():
    rng = np.random.default_rng(0)
    prompts = [
        "a red circle left of a blue square",
        "two green crosses",
        "a small yellow triangle at the top right",
        "a large circle at the bottom",  # colour left open: any object colour
    ]
    images = []
    for p in prompts:
        image = render(scene_for_prompt(p, rng)).astype(np.float64)
        images.append(np.clip(image + rng.normal(0, 40, image.shape), 0, 255))  # partial memberships everywhere
    fast = fidelity_components(np.stack(images), prompts)["objects"]
    slow = [_slow_objects(im, p) for im, p in zip(images, prompts)]
    np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-12)


# Ground truth, noise, blank:


@pytest.mark.parametrize("family", FAMILIES)
def test_ground_truth_scores_one_and_noise_or_blank_about_zero(family):
    rng = np.random.default_rng(1)
    prompts = _prompts(1, family, 60)
    truth = [render(scene_for_prompt(p, rng)) for p in prompts]
    np.testing.assert_allclose(_score(truth, prompts), 1.0, atol=1e-6)
    noise = [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in prompts]
    assert _score(noise, prompts).max() < 0.1
    blank = [_drawn(scene_for_prompt(p, rng)) for p in prompts]  # the right background, no objects
    assert _score(blank, prompts).max() < 0.1


@pytest.mark.parametrize("size", [24, 48])
def test_ground_truth_scores_one_at_other_sizes(size):
    rng = np.random.default_rng(2)
    prompts = [sample_prompt(rng, f) for f in FAMILIES for _ in range(5)]
    truth = [render(scene_for_prompt(p, rng), size) for p in prompts]
    np.testing.assert_allclose(_score(truth, prompts), 1.0, atol=1e-6)


def test_clean_training_pairs_score_one_and_noisy_ones_less():
    rng = np.random.default_rng(3)
    clean = [sample_training_pair(rng, 0.0) for _ in range(40)]
    np.testing.assert_allclose(_score([im for _, im in clean], [c for c, _ in clean]), 1.0, atol=1e-6)
    noisy = [sample_training_pair(rng, 1.0) for _ in range(80)]
    assert _score([im for _, im in noisy], [c for c, _ in noisy]).mean() < 0.8


# Controlled damage makes the score fall monotonically:


def _off_background(a, b) -> bool:
    """Whether the straight RGB path from colour a to colour b stays at least tau = 120 from every background."""
    path = np.linspace(np.array(a, float), np.array(b, float), 101)  # (101, 3)
    backgrounds = np.array(list(BACKGROUNDS.values()), float)
    return np.sqrt(((path[:, None] - backgrounds[None]) ** 2).sum(-1)).min() >= 120


def _score_series(series: list[tuple[str, list[np.ndarray]]]) -> list[np.ndarray]:
    """Scores of each (prompt, images of growing damage) series, all in one batch."""
    prompts = [p for p, images in series for _ in images]
    flat = _score([im for _, images in series for im in images], prompts)
    bounds = np.cumsum([0] + [len(images) for _, images in series])
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("family", FAMILIES)
def test_graded_wrong_colour(family):
    # A blend through a background colour (red → gray → cyan) makes the object vanish midway, which is rightly
    # scored above a wrong-coloured object (stray paint); so blend only toward colours whose path avoids them.
    rng = np.random.default_rng(4)
    series = []
    for prompt in _prompts(4, family, 15):
        scene = scene_for_prompt(prompt, rng)
        obj = scene.objects[0]
        right = np.array(COLORS[obj.color])
        choices = [c for c in COLORS if c != obj.color and _off_background(COLORS[c], right)]
        wrong = np.array(COLORS[choices[rng.integers(len(choices))]])
        base = render(scene)
        blends = [np.round((1 - t) * right + t * wrong) for t in np.linspace(0, 1, 11)]
        series.append((prompt, [_paint(base, obj, color) for color in blends]))
    for (prompt, _), scores in zip(series, _score_series(series)):
        assert _non_increasing(scores) and scores[-1] < scores[0] - 0.1, (prompt, scores)


def _free_neighbour(scene: Scene) -> tuple[int, tuple[int, int]]:
    """An object of ``scene`` and a direction towards a free neighbouring cell (one always exists for ≤ 3 objects)."""
    taken = {CELLS.index(o.cell) for o in scene.objects}
    for i, obj in enumerate(scene.objects):
        row, col = divmod(CELLS.index(obj.cell), 3)
        for dy, dx in ((0, 1), (0, -1), (1, 0), (-1, 0)):
            if 0 <= row + dy < 3 and 0 <= col + dx < 3 and 3 * (row + dy) + col + dx not in taken:
                return i, (dy, dx)
    raise AssertionError(f"no object of {scene} has a free neighbouring cell")


@pytest.mark.parametrize("family", ["single", "scene"])
def test_shifted_position(family):
    rng = np.random.default_rng(5)
    series = []
    for prompt in [p for p in _prompts(5, family, 60) if all(o.cell for o in parse_prompt(p).objects)][:15]:
        scene = scene_for_prompt(prompt, rng)
        # Towards a free neighbouring cell: the object slides over the background, not over another object.
        i, (dy, dx) = _free_neighbour(scene)
        rest = render(Scene(scene.background, scene.objects[:i] + scene.objects[i + 1 :]))
        series.append((prompt, [_paint(rest, scene.objects[i], shift=(d * dy, d * dx)) for d in range(6)]))
    for (prompt, _), scores in zip(series, _score_series(series)):
        assert _non_increasing(scores) and scores[-1] < scores[0] - 0.3, (prompt, scores)


@pytest.mark.parametrize("family", ["pair", "count", "scene"])
def test_missing_objects(family):
    rng = np.random.default_rng(6)
    series = []
    for prompt in _prompts(6, family, 15):
        scene = scene_for_prompt(prompt, rng)
        n = len(scene.objects)
        series.append((prompt, [render(Scene(scene.background, scene.objects[:k])) for k in range(n, -1, -1)]))
    for (prompt, _), scores in zip(series, _score_series(series)):
        assert (np.diff(scores) < 0).all() and scores[-1] < 0.1, (prompt, scores)


def test_wrong_count_too_many():
    rng = np.random.default_rng(7)
    series = []
    for prompt in _prompts(7, "count", 20):
        scene = scene_for_prompt(prompt, rng)
        free = [c for c in CELLS if c not in {o.cell for o in scene.objects}]
        like = scene.objects[0]
        extra = tuple(Object(like.shape, like.color, like.size, c) for c in free[:3])
        series.append((prompt, [render(Scene(scene.background, scene.objects + extra[:k])) for k in range(4)]))
    for (prompt, _), scores in zip(series, _score_series(series)):
        assert (np.diff(scores) < 0).all(), (prompt, scores)


def test_wrong_relation():
    rng = np.random.default_rng(8)
    series, same_color = [], []
    for prompt in _prompts(8, "pair", 30):
        scene = scene_for_prompt(prompt, rng)
        a, b = scene.objects
        swapped = (Object(a.shape, a.color, a.size, b.cell), Object(b.shape, b.color, b.size, a.cell))
        series.append((prompt, [render(scene), render(Scene(scene.background, swapped))]))
        same_color.append(a.color == b.color)
    for (prompt, _), scores, same in zip(series, _score_series(series), same_color):
        # Two objects of one colour can still be half-matched by taking each for the other.
        assert scores[1] < scores[0] - (0.1 if same else 0.3), (prompt, scores)


def test_wrong_background():
    rng = np.random.default_rng(9)
    series = []
    prompts = [p for p in _prompts(9, "single", 80) if parse_prompt(p).background][:15] + _prompts(9, "scene", 15)
    for prompt in prompts:
        scene = scene_for_prompt(prompt, rng)
        wrong = [b for b in BACKGROUNDS if b != scene.background][rng.integers(len(BACKGROUNDS) - 1)]
        truth = render(scene)
        ys, xs = np.nonzero((truth == BACKGROUNDS[scene.background]).all(-1))
        order = rng.permutation(len(ys))
        images = []
        for q in np.linspace(0, 1, 5):  # repaint a growing share of the background pixels
            pick = order[: int(round(q * len(order)))]
            images.append(truth.copy())
            images[-1][ys[pick], xs[pick]] = BACKGROUNDS[wrong]
        series.append((prompt, images))
    for (prompt, _), scores in zip(series, _score_series(series)):
        assert _non_increasing(scores) and scores[-1] < scores[0] - 0.25, (prompt, scores)


# The reward function's interface:


def test_batched_equals_one_by_one_and_metadata_is_ignored():
    rng = np.random.default_rng(10)
    prompts = [sample_prompt(rng, f) for f in FAMILIES for _ in range(4)]
    images = [np.clip(render(scene_for_prompt(p, rng)) + rng.normal(0, 30, (32, 32, 3)), 0, 255) for p in prompts]
    images = [im.astype(np.uint8) for im in images]
    fn = make_reward("toy_fidelity")
    batched, info = fn(_batch(images), prompts, [{"anything": 1}] * len(prompts))
    assert batched.dtype == torch.float32 and batched.shape == (len(prompts),)
    assert set(info) == {"objects", "background", "precision"} and all(v.shape == batched.shape for v in info.values())
    single = torch.cat([fn(_batch([im]), [p], [])[0] for im, p in zip(images, prompts)])
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-6)


def test_scoring_64_images_is_fast():
    rng = np.random.default_rng(11)
    prompts = [sample_prompt(rng, FAMILIES[i % 4]) for i in range(64)]
    images = _batch([rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in prompts])
    fn = make_reward("toy_fidelity")
    fn(images, prompts, [])  # warm the caches
    start = time.perf_counter()
    fn(images, prompts, [])
    assert time.perf_counter() - start < 1.0


def test_bad_inputs_and_options():
    fn = make_reward("toy_fidelity")
    image = _batch([render(SQUARE)])
    with pytest.raises(ValueError, match="is not a prompt of the toy world"):
        fn(image, ["a photo of a cat"], [])
    with pytest.raises(ValueError, match="1 images but 2 prompts"):
        fn(image, [PROMPT, PROMPT], [])
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        fn(image[:, :1], [PROMPT], [])
    with pytest.raises(RewardError, match="tau_full < tau"):
        make_reward("toy_fidelity", tau=40.0)
    with pytest.raises(RewardError, match="tau_full < tau"):
        make_reward("toy_fidelity", tau=130.0)
    with pytest.raises(RewardError, match="sum of at most 1"):
        make_reward("toy_fidelity", w_background=0.7, w_precision=0.7)


def test_jpeg_compressibility():
    rng = np.random.default_rng(12)
    flat = [render(Scene("gray", ())) for _ in range(3)]
    noise = [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(3)]
    rewards, info = make_reward("jpeg_compressibility")(_batch(flat + noise), [""] * 6, [])
    assert rewards.dtype == torch.float32 and rewards.shape == (6,) and (rewards < 0).all()
    assert rewards[3:].max() < rewards[:3].min()
    torch.testing.assert_close(info["kb"], -rewards)
    with pytest.raises(RewardError, match="quality"):
        make_reward("jpeg_compressibility", quality=0)
