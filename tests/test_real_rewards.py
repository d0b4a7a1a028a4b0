"""HPSv2.1, PickScore and CLIPScore on tiny random models saved in the real on-disk formats.

The tests build an open_clip model from a tiny registered config and save it as HPS's ``{'state_dict': ...}``
checkpoint, and a tiny ``transformers`` CLIPModel and CLIP processor (locally built byte-level BPE tokenizer) with
``save_pretrained``; the rewards load them through the same code as the real weights (local path, or a hub id found
in a fake local HF cache). Scores are checked against a float64 reference computed one piece at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

from jagg_core.evaluation import score_image_folder
from jagg_core.rewards import RewardError, available_rewards, make_reward
from jagg_core.rewards.clipscore import make_clipscore
from jagg_core.rewards.hps import hps_pixels, make_hps
from jagg_core.rewards.pickscore import make_pickscore

TINY_OPEN_CLIP = "jagg-test-tiny-clip"
PROMPTS = ["a red circle on blue", "anime girl, concept art", "a photo of a cat", "x", "two green squares at night"]


def smooth_images(n: int, h: int = 40, w: int = 48, seed: int = 0) -> torch.Tensor:
    """(n, 3, h, w) in [0, 1]: upsampled low-resolution noise, so JPEG error stays small."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 5, 6, generator=g)
    return torch.nn.functional.interpolate(low, size=(h, w), mode="bilinear", align_corners=False).clamp(0, 1)


def fake_hub_cache(cache: Path, repo: str, files: dict[str, Path], repo_type: str = "model") -> None:
    """Lay ``files`` out as huggingface_hub's cache does: ``<type>s--org--name/{refs/main, snapshots/<sha>/...}``."""
    sha = "0" * 40
    repo_dir = cache / f"{repo_type}s--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(sha)
    for name, src in files.items():
        dst = repo_dir / "snapshots" / sha / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty local HF cache for this test (huggingface_hub reads the constant at call time)."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


# --- Tiny models ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hps_checkpoint(tmp_path_factory) -> Path:
    """A tiny open_clip model (~3.5 M params, mostly the 49408-token embedding) saved as HPS saves HPSv2.1."""
    import open_clip

    folder = tmp_path_factory.mktemp("open_clip")
    config = {
        "embed_dim": 32,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
    }
    (folder / f"{TINY_OPEN_CLIP}.json").write_text(json.dumps(config))
    open_clip.add_model_config(folder / f"{TINY_OPEN_CLIP}.json")
    torch.manual_seed(0)
    model = open_clip.create_model(TINY_OPEN_CLIP, pretrained=None)
    path = folder / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": model.state_dict()}, path)
    return path


def byte_level_vocab() -> dict[str, int]:
    """CLIP's BPE vocabulary without merges: the 256 byte symbols, each also as word end, then the specials."""
    from tokenizers.pre_tokenizers import ByteLevel

    chars = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab


@pytest.fixture(scope="module")
def hf_clip(tmp_path_factory) -> dict[str, Path]:
    """A tiny transformers CLIPModel folder and CLIP processor folder (and one folder holding both, as OpenAI's)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    root = tmp_path_factory.mktemp("hf_clip")
    tokenizer = CLIPTokenizer(vocab=byte_level_vocab(), merges=[])
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, **ids),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2),
        projection_dim=16,
    )
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    model.save_pretrained(root / "model")
    processor.save_pretrained(root / "processor")
    model.save_pretrained(root / "both")
    processor.save_pretrained(root / "both")
    return {"model": root / "model", "processor": root / "processor", "both": root / "both"}


# --- References, one piece at a time in float64 ---------------------------------------------------------------------


def to_pil(images: torch.Tensor) -> list:
    from PIL import Image

    pixels = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a) for a in pixels]


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's, which hpsv2 normalises with
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def hps_reference_pixels(im, size: int) -> torch.Tensor:
    """hpsv2's ``preprocess_val`` on one PIL image, step by step: (3, size, size) float32.

    ToTensor; resize the float tensor (bicubic, antialiased) so that the longest side is ``size``, new sides
    ``round(side * size / longest)``; pad with 0 to a square, ``pad // 2`` left/top and the rest right/bottom (hpsv2
    skips the pad when no resize is needed, which only a non-square image with longest side ``size`` notices; the
    reward pads it); normalise with CLIP's mean/std.
    """
    from torchvision.transforms import InterpolationMode, ToTensor
    from torchvision.transforms import functional as TF

    x = ToTensor()(im)  # (3, H, W) float32, uint8 / 255
    h, w = x.shape[1:]
    scale = size / max(h, w)
    new_h, new_w = round(h * scale), round(w * scale)
    if scale != 1:
        x = TF.resize(x, [new_h, new_w], InterpolationMode.BICUBIC, antialias=True)
    canvas = torch.zeros(3, size, size)
    top, left = (size - new_h) // 2, (size - new_w) // 2
    canvas[:, top : top + new_h, left : left + new_w] = x
    mean, std = torch.tensor(CLIP_MEAN)[:, None, None], torch.tensor(CLIP_STD)[:, None, None]
    return (canvas - mean) / std


def hps_reference(checkpoint: Path, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    import open_clip

    model = open_clip.create_model(TINY_OPEN_CLIP, pretrained=None)
    model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"])
    model = model.double().eval()
    tokenizer = open_clip.get_tokenizer(TINY_OPEN_CLIP)
    out = []
    with torch.no_grad():
        for im, prompt in zip(to_pil(images), prompts):
            f_img = model.encode_image(hps_reference_pixels(im, 32)[None].double())[0]
            f_txt = model.encode_text(tokenizer([prompt]))[0]
            out.append(f_img @ f_txt / (f_img.norm() * f_txt.norm()))
    return torch.stack(out)


def hf_clip_reference(folders: dict[str, Path], images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, float]:
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(folders["model"]).double().eval()
    processor = CLIPProcessor.from_pretrained(folders["processor"])
    out = []
    with torch.no_grad():
        for im, prompt in zip(to_pil(images), prompts):
            pixels = processor.image_processor(images=[im], return_tensors="pt")["pixel_values"].double()
            ids = processor.tokenizer([prompt], return_tensors="pt")["input_ids"]
            f_img = model.get_image_features(pixel_values=pixels).pooler_output[0]
            f_txt = model.get_text_features(input_ids=ids).pooler_output[0]
            out.append(f_img @ f_txt / (f_img.norm() * f_txt.norm()))
    return torch.stack(out), float(model.logit_scale.detach().exp())


# --- HPSv2.1 ---------------------------------------------------------------------------------------------------------


def test_registered():
    assert {"clipscore", "hpsv2.1", "pickscore"} <= set(available_rewards())


def test_hps_is_the_cosine_of_the_model_features(hps_checkpoint):
    fn = make_reward("hpsv2.1", checkpoint=str(hps_checkpoint), model_name=TINY_OPEN_CLIP)
    images = smooth_images(len(PROMPTS))  # 40 x 48: not square, so the longest-side resize pads
    rewards, info = fn(images, PROMPTS, [{}] * len(PROMPTS))
    assert rewards.dtype == torch.float32 and rewards.shape == (len(PROMPTS),) and info == {}
    assert bool(((rewards >= -1) & (rewards <= 1)).all())
    torch.testing.assert_close(rewards.double(), hps_reference(hps_checkpoint, images, PROMPTS), atol=1e-5, rtol=0)
    again, _ = fn(images, PROMPTS, [{}] * len(PROMPTS))
    assert torch.equal(rewards, again)  # deterministic


def test_hps_batched_equals_one_by_one(hps_checkpoint):
    images = smooth_images(len(PROMPTS), seed=1)
    batched, _ = make_hps(checkpoint=str(hps_checkpoint), model_name=TINY_OPEN_CLIP, batch_size=16)(images, PROMPTS, [])
    single, _ = make_hps(checkpoint=str(hps_checkpoint), model_name=TINY_OPEN_CLIP, batch_size=1)(images, PROMPTS, [])
    torch.testing.assert_close(batched, single, atol=1e-6, rtol=0)  # float32 matmul blocking differs, nothing else


# (H, W) for an input size of 32: shrunk, wide and tall, with odd padding (40 x 48 -> 27 x 32); halves rounded to
# even as Python's round does (37 * 32/64 = 18.5 -> 18, 39 * 32/64 = 19.5 -> 20); enlarged (13 x 20 -> 21 x 32);
# longest side already 32 (padded only, where hpsv2 would not pad); square 32 (as is).
HPS_SIZES = [(40, 48), (50, 31), (37, 64), (39, 64), (13, 20), (24, 32), (32, 19), (32, 32), (96, 96)]


@pytest.mark.parametrize("size", HPS_SIZES, ids=[f"{h}x{w}" for h, w in HPS_SIZES])
def test_hps_pixels_are_hpsv2_preprocess_val_step_by_step(size):
    images = smooth_images(3, *size, seed=2)
    pixels = hps_pixels(images, 32)
    assert pixels.dtype == torch.float32 and pixels.shape == (3, 3, 32, 32)
    reference = torch.stack([hps_reference_pixels(im, 32) for im in to_pil(images)])
    assert torch.equal(pixels, reference), (pixels - reference).abs().max()


@pytest.mark.parametrize("size", [(37, 64), (24, 32), (50, 31)], ids=["37x64", "24x32", "50x31"])
def test_hps_scores_other_sizes(hps_checkpoint, size):
    fn = make_hps(checkpoint=str(hps_checkpoint), model_name=TINY_OPEN_CLIP)
    images = smooth_images(len(PROMPTS), *size, seed=4)
    rewards, _ = fn(images, PROMPTS, [])
    torch.testing.assert_close(rewards.double(), hps_reference(hps_checkpoint, images, PROMPTS), atol=1e-5, rtol=0)


def test_hps_checkpoint_formats_and_hub_cache(hps_checkpoint, tmp_path, hub_cache):
    images = smooth_images(3, seed=2)
    reference, _ = make_hps(checkpoint=str(hps_checkpoint), model_name=TINY_OPEN_CLIP)(images, PROMPTS[:3], [])
    state_dict = torch.load(hps_checkpoint, weights_only=True)["state_dict"]
    torch.save(state_dict, tmp_path / "plain.pt")
    torch.save({"state_dict": {f"module.{k}": v for k, v in state_dict.items()}}, tmp_path / "ddp.pt")
    fake_hub_cache(hub_cache, "xswu/HPSv2", {"HPS_v2.1_compressed.pt": hps_checkpoint})
    for checkpoint in (tmp_path / "plain.pt", tmp_path / "ddp.pt", hps_checkpoint.parent, "xswu/HPSv2"):
        scores, _ = make_hps(checkpoint=str(checkpoint), model_name=TINY_OPEN_CLIP)(images, PROMPTS[:3], [])
        assert torch.equal(scores, reference), checkpoint


def test_hps_missing_weights_errors_word_for_word(tmp_path, hub_cache):
    fix = (
        "download HPS_v2.1_compressed.pt from the Hugging Face repo xswu/HPSv2 and set "
        "reward.options.hpsv2.1.checkpoint"
    )
    missing = tmp_path / "nowhere" / "HPS_v2.1_compressed.pt"
    with pytest.raises(RewardError) as e:
        make_hps(checkpoint=str(missing), model_name=TINY_OPEN_CLIP)
    assert str(e.value) == f"the HPSv2.1 checkpoint '{missing}' does not exist: {fix} to its local path."
    with pytest.raises(RewardError) as e:
        make_hps(model_name=TINY_OPEN_CLIP)  # the default: the hub id, which this empty cache lacks
    assert str(e.value) == (
        f"the HPSv2.1 checkpoint 'xswu/HPSv2' is neither a local file nor in the local Hugging Face cache: "
        f"{fix} to its local path."
    )
    with pytest.raises(RewardError) as e:
        make_hps(checkpoint=str(tmp_path), model_name=TINY_OPEN_CLIP)
    assert str(e.value) == (
        f"the HPSv2.1 checkpoint '{tmp_path}' has no HPS_v2.1_compressed.pt: {fix} to its local path."
    )
    with pytest.raises(RewardError) as e:
        make_hps(checkpoint="", model_name=TINY_OPEN_CLIP)  # not the working directory
    assert str(e.value) == f"the HPSv2.1 checkpoint '' is not a path: {fix} to its local path."
    with pytest.raises(RewardError) as e:
        make_hps(checkpoint=str(missing), model_name="no-such-model")
    assert str(e.value) == (
        "reward.options.hpsv2.1.model_name 'no-such-model' is not an open_clip model config; "
        "register it with open_clip.add_model_config or use one of open_clip.list_models()."
    )


class NotATensor:
    pass


def test_hps_refuses_bad_checkpoints_instead_of_random_weights(hps_checkpoint, tmp_path):
    state_dict = torch.load(hps_checkpoint, weights_only=True)["state_dict"]
    bad = {
        "partial.pt": {"state_dict": dict(list(state_dict.items())[:-3])},
        "pickled-object.pt": {"state_dict": state_dict, "extra": NotATensor()},  # weights_only=True refuses it
        "empty.pt": {"state_dict": {}},
        "truncated.pt": None,
    }
    for name, content in bad.items():
        if content is None:
            (tmp_path / name).write_bytes(hps_checkpoint.read_bytes()[:1000])
        else:
            torch.save(content, tmp_path / name)
        with pytest.raises(RewardError, match=f"^the HPSv2.1 checkpoint '.*{name}' could not be loaded into open_clip"):
            make_hps(checkpoint=str(tmp_path / name), model_name=TINY_OPEN_CLIP)


def test_hps_tensors_and_jpeg_files_score_the_same(hps_checkpoint, tmp_path):
    fn = make_hps(checkpoint=str(hps_checkpoint), model_name=TINY_OPEN_CLIP, batch_size=2)
    images = smooth_images(4, h=48, w=48, seed=3)
    prompts = {"photo": PROMPTS[:4]}
    (tmp_path / "photo").mkdir()
    for i, im in enumerate(to_pil(images)):
        im.save(tmp_path / "photo" / f"{i:05d}.jpg", quality=95)
    from_files = torch.tensor(score_image_folder(tmp_path, prompts, {"hpsv2.1": fn}, batch_size=3)["hpsv2.1"]["photo"])
    from_tensors, _ = fn(images, prompts["photo"], [])
    # JPEG at quality 95 moves pixels by ~1/255; on this tiny random model that moves the cosine by < 0.01.
    torch.testing.assert_close(from_files, from_tensors, atol=1e-2, rtol=0)


def test_bad_options():
    with pytest.raises(RewardError) as e:
        make_hps(dtype="float64")
    assert str(e.value) == "reward.options.hpsv2.1.dtype must be one of float32, bfloat16, float16, got 'float64'."
    with pytest.raises(RewardError) as e:
        make_pickscore(batch_size=0)
    assert str(e.value) == "reward.options.pickscore.batch_size must be a positive integer, got 0."


# --- PickScore -------------------------------------------------------------------------------------------------------


def test_pickscore_is_logit_scale_times_cosine(hf_clip):
    fn = make_reward("pickscore", model=str(hf_clip["model"]), processor=str(hf_clip["processor"]))
    images = smooth_images(len(PROMPTS), seed=4)
    rewards, info = fn(images, PROMPTS, [{}] * len(PROMPTS))
    cos, logit_scale = hf_clip_reference(hf_clip, images, PROMPTS)
    assert rewards.dtype == torch.float32 and rewards.shape == (len(PROMPTS),) and set(info) == {"score", "cos"}
    assert bool(((info["cos"] >= -1) & (info["cos"] <= 1)).all())
    torch.testing.assert_close(info["cos"].double(), cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(info["score"].double(), logit_scale * cos, atol=1e-4, rtol=0)  # logit scale 1/0.07
    torch.testing.assert_close(rewards, info["score"] / 26)
    again, _ = fn(images, PROMPTS, [{}] * len(PROMPTS))
    assert torch.equal(rewards, again)


def test_pickscore_batched_equals_one_by_one(hf_clip, hub_cache):
    # Prompts of different lengths: batching pads them, which must not change any score.
    images = smooth_images(len(PROMPTS), seed=5)
    fake_hub_cache(hub_cache, "yuvalkirstain/PickScore_v1", {p.name: p for p in hf_clip["model"].iterdir()})
    processor_files = {p.name: p for p in hf_clip["processor"].iterdir()}
    fake_hub_cache(hub_cache, "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", processor_files)
    batched, _ = make_pickscore(batch_size=16)(images, PROMPTS, [])  # both found in the (fake) local HF cache
    single, _ = make_pickscore(str(hf_clip["model"]), str(hf_clip["processor"]), batch_size=1)(images, PROMPTS, [])
    torch.testing.assert_close(batched, single, atol=1e-6, rtol=0)


def test_pickscore_bfloat16_runs_close_to_float32(hf_clip):
    images = smooth_images(3, seed=6)
    folders = dict(model=str(hf_clip["model"]), processor=str(hf_clip["processor"]))
    full, _ = make_pickscore(**folders)(images, PROMPTS[:3], [])
    half, _ = make_pickscore(**folders, dtype="bfloat16")(images, PROMPTS[:3], [])
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, atol=0.05, rtol=0)


def test_pickscore_missing_weights_errors_word_for_word(hf_clip, tmp_path, hub_cache):
    model_fix = "download the Hugging Face repo yuvalkirstain/PickScore_v1 and set reward.options.pickscore.model"
    proc_fix = (
        "download the Hugging Face repo laion/CLIP-ViT-H-14-laion2B-s32B-b79K and set "
        "reward.options.pickscore.processor"
    )
    processor = str(hf_clip["processor"])

    def message(**options) -> str:
        with pytest.raises(RewardError) as e:
            make_pickscore(**options)
        return str(e.value)

    assert message(processor=processor) == (
        f"the PickScore model 'yuvalkirstain/PickScore_v1' is neither a local folder nor in the local Hugging Face "
        f"cache: {model_fix} to its local path."
    )
    missing = tmp_path / "PickScore_v1"
    assert message(model=str(missing), processor=processor) == (
        f"the PickScore model '{missing}' does not exist: {model_fix} to its local path."
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert message(model=str(empty), processor=processor) == (
        f"the PickScore model '{empty}' has no config (config.json): {model_fix} to its local path."
    )
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_bytes((hf_clip["model"] / "config.json").read_bytes())
    assert message(model=str(tmp_path / "config-only"), processor=processor) == (
        f"the PickScore model '{tmp_path / 'config-only'}' has no weights (model.safetensors or "
        f"model.safetensors.index.json or pytorch_model.bin or pytorch_model.bin.index.json): {model_fix} to its "
        f"local path."
    )
    assert message(model=str(hf_clip["model"]), processor=str(empty)) == (
        f"the PickScore processor '{empty}' has no image processor config (preprocessor_config.json or "
        f"processor_config.json): {proc_fix} to its local path."
    )


def test_pickscore_refuses_an_empty_tokenizer(hf_clip, tmp_path):
    from transformers import CLIPImageProcessor, CLIPProcessor, CLIPTokenizer

    # What offline transformers hands back for a hub id it cannot fetch: specials only.
    empty = CLIPTokenizer()
    CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=empty).save_pretrained(tmp_path / "proc")
    with pytest.raises(RewardError) as e:
        make_pickscore(model=str(hf_clip["model"]), processor=str(tmp_path / "proc"))
    assert str(e.value) == (
        f"the PickScore processor '{tmp_path / 'proc'}' has an empty tokenizer ({len(empty)} tokens): download the "
        f"Hugging Face repo laion/CLIP-ViT-H-14-laion2B-s32B-b79K and set reward.options.pickscore.processor to its "
        f"local path."
    )


def test_pickscore_refuses_weights_that_would_be_randomly_initialised(hf_clip, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "partial"
    folder.mkdir()
    (folder / "config.json").write_bytes((hf_clip["model"] / "config.json").read_bytes())
    weights = load_file(hf_clip["model"] / "model.safetensors")
    del weights["visual_projection.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RewardError) as e:
        make_pickscore(model=str(folder), processor=str(hf_clip["processor"]))
    assert str(e.value) == (
        f"the PickScore model '{folder}' lacks 1 CLIPModel weights (e.g. 'visual_projection.weight'): download the "
        f"Hugging Face repo yuvalkirstain/PickScore_v1 and set reward.options.pickscore.model to its local path."
    )


# --- CLIPScore -------------------------------------------------------------------------------------------------------


def test_clipscore_is_the_cosine_and_hessels_clip_s(hf_clip):
    images = smooth_images(len(PROMPTS), seed=7)
    rewards, info = make_reward("clipscore", model=str(hf_clip["both"]))(images, PROMPTS, [])  # processor = model's
    cos, _ = hf_clip_reference(hf_clip, images, PROMPTS)
    torch.testing.assert_close(rewards.double(), cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(info["clipscore"], 2.5 * rewards.clamp(min=0))
    assert bool((rewards < 0).any()), "a random model should give some negative cosines, clipped to 0 in CLIP-S"
    prefixed, _ = make_clipscore(model=str(hf_clip["both"]), prefix="A photo depicts")(images, PROMPTS, [])
    reference, _ = hf_clip_reference(hf_clip, images, [f"A photo depicts {p}" for p in PROMPTS])
    torch.testing.assert_close(prefixed.double(), reference, atol=1e-5, rtol=0)


def test_clipscore_missing_model_word_for_word(hub_cache):
    with pytest.raises(RewardError) as e:
        make_clipscore()
    assert str(e.value) == (
        "the CLIPScore model 'openai/clip-vit-base-patch32' is neither a local folder nor in the local Hugging Face "
        "cache: download the Hugging Face repo openai/clip-vit-base-patch32 and set reward.options.clipscore.model to "
        "its local path."
    )


def test_reward_networks_leave_the_gpu_while_generation_needs_it(hps_checkpoint):
    """Each network reward exposes its model as fn.modules; rewards_off_device moves the ones on an accelerator to
    the CPU for the block and back (on this CPU-only machine: a no-op that leaves the scores unchanged)."""
    from jagg_core.rewards import rewards_off_device

    fn = make_hps(checkpoint=str(hps_checkpoint), model_name=TINY_OPEN_CLIP)
    (model,) = fn.modules
    assert isinstance(model, torch.nn.Module) and next(model.parameters()).device.type == "cpu"
    images = torch.rand(2, 3, 24, 40, generator=torch.Generator().manual_seed(0))
    before, _ = fn(images, PROMPTS[:2], [])
    with rewards_off_device([fn]):
        assert next(model.parameters()).device.type == "cpu"
    after, _ = fn(images, PROMPTS[:2], [])
    assert torch.equal(before, after)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_reward_networks_on_the_gpu_are_parked_on_the_cpu_and_brought_back(hps_checkpoint):
    from jagg_core.rewards import rewards_off_device

    fn = make_hps(checkpoint=str(hps_checkpoint), model_name=TINY_OPEN_CLIP, device="cuda")
    (model,) = fn.modules
    images = torch.rand(2, 3, 24, 40, generator=torch.Generator().manual_seed(0))
    before, _ = fn(images, PROMPTS[:2], [])
    with rewards_off_device([fn]):
        assert next(model.parameters()).device.type == "cpu"
    assert next(model.parameters()).device.type == "cuda"
    after, _ = fn(images, PROMPTS[:2], [])
    assert torch.equal(before, after)
