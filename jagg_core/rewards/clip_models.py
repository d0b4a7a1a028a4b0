"""Loading CLIP-family reward models offline, and handing them images: shared by HPSv2.1, PickScore and CLIPScore.

Weights are found without the network: an option's value is a local path, or a Hugging Face hub id looked up
only in the local HF cache (``local_files_only``). Anything missing or incomplete -- a file that is not there, a
folder without its config or weights, a tokenizer that loaded empty (offline ``transformers`` silently returns one
for a hub id it cannot fetch) -- raises :class:`RewardError` with one sentence that names the path, the option to
set and where the weights are published. Nothing ever falls back to random weights.

Images reach every model rounded to 8 bits: (B, 3, H, W) floats in [0, 1] become 8-bit RGB PIL images (HPSv2.1 takes
the same 8-bit values as a tensor, see hps.py), as Flow-GRPO and DDPO do before their scorers, so a batch of tensors
and the same images saved and reloaded as files score the same (exactly for lossless files, within JPEG error
otherwise).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from ..setup.storage import open_regular
from .base import RewardError, RewardFn

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPES",
    "MIN_TOKENIZER_SIZE",
    "Published",
    "check_batch_size",
    "check_inputs",
    "check_tokenizer",
    "chunks",
    "hf_clip_cosine",
    "load_hf_clip",
    "load_open_clip",
    "parse_dtype",
    "resolve_file",
    "resolve_folder",
    "to_pil_images",
    "hf_clip_reward",
]

DTYPES = ("float32", "bfloat16", "float16")  # torch's names (torch is imported where a dtype is made)

# CLIP's BPE is byte-level: any real vocabulary holds at least its 256 byte symbols. The empty tokenizer offline
# transformers returns for a hub id it cannot fetch has 2 tokens.
MIN_TOKENIZER_SIZE = 256

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_MODEL_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_PROCESSOR_CONFIGS = ("preprocessor_config.json", "processor_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json")


@dataclass(frozen=True)
class Published:
    """Where a weight file or folder comes from, so that an error can tell the user how to get it.

    Attributes:
        what: the thing, as the start of a sentence ("the HPSv2.1 checkpoint").
        option: the params key to set ("reward.options.hpsv2.1.checkpoint").
        download: what to download, from where ("HPS_v2.1_compressed.pt from the Hugging Face repo xswu/HPSv2").
    """

    what: str
    option: str
    download: str

    def error(self, value: Any, problem: str) -> RewardError:
        return RewardError(
            f"{self.what} {str(value)!r} {problem}: download {self.download} and set {self.option} to its local path."
        )


# --- Finding weights offline -----------------------------------------------------------------------------------------


def _is_hub_id(value: str) -> bool:
    return _HUB_ID.fullmatch(value) is not None and not value.startswith((".", "~"))


def _check_given(value: Any, published: Published) -> None:
    if value is None or not str(value).strip():  # Path("") would silently mean the working directory
        raise published.error(value if value is not None else "", "is not a path")


def resolve_file(value: str | Path, *, filename: str, published: Published) -> Path:
    """A weight file: ``value`` is the file, a folder holding ``filename``, or a hub repo id whose ``filename`` is in
    the local HF cache."""
    from huggingface_hub import try_to_load_from_cache

    _check_given(value, published)
    path = Path(value).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / filename).is_file():
            return path / filename
        raise published.error(value, f"has no {filename}")
    if _is_hub_id(str(value)):
        try:
            cached = try_to_load_from_cache(str(value), filename)
        except (OSError, ValueError):  # an id the hub's validator refuses
            cached = None
        if isinstance(cached, str) and Path(cached).is_file():
            return Path(cached)
        raise published.error(value, "is neither a local file nor in the local Hugging Face cache")
    raise published.error(value, "does not exist")


def resolve_folder(value: str | Path, *, published: Published) -> Path:
    """A weight folder: ``value`` is the folder, or a hub repo id whose snapshot is in the local HF cache."""
    from huggingface_hub import snapshot_download

    _check_given(value, published)
    path = Path(value).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise published.error(value, "is a file, not a folder")
    if _is_hub_id(str(value)):
        try:
            return Path(snapshot_download(str(value), local_files_only=True))
        except (OSError, ValueError):  # LocalEntryNotFoundError is an OSError; a refused id a ValueError
            raise published.error(value, "is neither a local folder nor in the local Hugging Face cache") from None
    raise published.error(value, "does not exist")


def _require_any(folder: Path, names: Sequence[str], value: Any, what: str, published: Published) -> None:
    if not any((folder / name).is_file() for name in names):
        raise published.error(value, f"has no {what} ({' or '.join(names)})")


def check_tokenizer(n_tokens: int, value: Any, published: Published) -> None:
    """Refuse a tokenizer that loaded (nearly) empty instead of failing."""
    if n_tokens < MIN_TOKENIZER_SIZE:
        raise published.error(value, f"has an empty tokenizer ({n_tokens} tokens)")


# --- Options ---------------------------------------------------------------------------------------------------------


def parse_dtype(dtype: str | torch.dtype, option: str) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype) and str(dtype).removeprefix("torch.") in DTYPES:
        return dtype
    if dtype not in DTYPES:
        raise RewardError(f"{option} must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    return getattr(torch, dtype)


def check_batch_size(batch_size: Any, option: str) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise RewardError(f"{option} must be a positive integer, got {batch_size!r}.")
    return batch_size


# --- Loading ---------------------------------------------------------------------------------------------------------


class _QuietRandomInit(logging.Filter):
    """Drop open_clip's "Model initialized randomly" warning while building a model whose weights load next."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "initialized randomly" not in record.getMessage()


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    # Our own torch.load: open_clip's loader retries *without* weights_only when the restricted unpickler raises a
    # TypeError, which a malformed (or malicious) file can provoke.
    import torch

    with open_regular(path, RewardError, limit=1 << 40) as f:  # a regular file: a FIFO blocked the load for ever
        checkpoint = torch.load(f, map_location="cpu", weights_only=True)
    state_dict = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else checkpoint
    if not isinstance(state_dict, dict) or not state_dict:
        raise ValueError("no state dict in the checkpoint")
    if all(k.startswith("module.") for k in state_dict):  # saved from a DDP-wrapped model
        state_dict = {k.removeprefix("module."): v for k, v in state_dict.items()}
    return state_dict


def load_open_clip(
    model_name: str, checkpoint: str | Path, *, filename: str, published: Published, model_name_option: str
) -> tuple[torch.nn.Module, Any, Path]:
    """An open_clip model built from its registered config and strictly loaded from a local checkpoint.

    The checkpoint may be a plain state dict or wrapped as ``{'state_dict': ...}`` (as HPSv2's), with or without
    DDP's ``module.`` prefix; it is read with ``weights_only=True``.

    Returns:
        (model in eval mode on CPU in float32, its tokenizer, the checkpoint path).
    """
    import open_clip

    if model_name not in open_clip.list_models():
        raise RewardError(
            f"{model_name_option} {model_name!r} is not an open_clip model config; "
            f"register it with open_clip.add_model_config or use one of open_clip.list_models()."
        )
    path = resolve_file(checkpoint, filename=filename, published=published)
    try:
        state_dict = _read_state_dict(path)
        quiet = _QuietRandomInit()
        logging.getLogger().addFilter(quiet)  # open_clip logs on the root logger
        try:
            model = open_clip.create_model(model_name, pretrained=None)
        finally:
            logging.getLogger().removeFilter(quiet)
        model.load_state_dict(state_dict, strict=True)
    except RewardError:  # the storage door's sentence (not a regular file, too large)
        raise
    except Exception as e:  # unpickling refused, truncated file, missing or unexpected keys, wrong shapes
        raise published.error(path, f"could not be loaded into open_clip {model_name} ({type(e).__name__})") from e
    tokenizer = open_clip.get_tokenizer(model_name)
    encoder = getattr(tokenizer, "encoder", None)  # the bundled SimpleTokenizer; an HF-backed one has its own size
    check_tokenizer(len(encoder) if encoder is not None else len(tokenizer.tokenizer), path, published)
    return model.eval().requires_grad_(False), tokenizer, path


def load_hf_clip(
    model: str | Path, processor: str | Path, *, model_published: Published, processor_published: Published
) -> tuple[torch.nn.Module, Any, Any]:
    """A ``transformers`` CLIPModel and its tokenizer and image processor, from local folders or the HF cache.

    Returns:
        (model in eval mode on CPU in float32, tokenizer, image processor).
    """
    from transformers import CLIPImageProcessor, CLIPModel, CLIPTokenizer

    model_dir = resolve_folder(model, published=model_published)
    _require_any(model_dir, ("config.json",), model_dir, "config", model_published)
    _require_any(model_dir, _MODEL_WEIGHTS, model_dir, "weights", model_published)
    processor_dir = resolve_folder(processor, published=processor_published)
    _require_any(processor_dir, _PROCESSOR_CONFIGS, processor_dir, "image processor config", processor_published)
    _require_any(processor_dir, _TOKENIZER_FILES, processor_dir, "tokenizer", processor_published)

    try:
        clip, loading = CLIPModel.from_pretrained(model_dir, local_files_only=True, output_loading_info=True)
    except Exception as e:  # a config of another architecture, corrupt weights
        raise model_published.error(model_dir, f"could not be loaded as a CLIPModel ({type(e).__name__})") from e
    # from_pretrained initialises absent weights at random with a mere warning: refuse instead.
    mismatched = {k[0] if isinstance(k, tuple) else k for k in loading["mismatched_keys"]}  # (key, shape, shape)
    absent = sorted(set(loading["missing_keys"]) | mismatched)
    if absent:
        raise model_published.error(model_dir, f"lacks {len(absent)} CLIPModel weights (e.g. {absent[0]!r})")
    try:
        tokenizer = CLIPTokenizer.from_pretrained(processor_dir, local_files_only=True)
        image_processor = CLIPImageProcessor.from_pretrained(processor_dir, local_files_only=True)
    except Exception as e:
        problem = f"could not be loaded as a CLIP processor ({type(e).__name__})"
        raise processor_published.error(processor_dir, problem) from e
    check_tokenizer(len(tokenizer), processor_dir, processor_published)
    return clip.eval().requires_grad_(False), tokenizer, image_processor


# --- Feeding images --------------------------------------------------------------------------------------------------


def check_inputs(images: torch.Tensor, prompts: Sequence[str]) -> None:
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be (B, 3, H, W), got {tuple(images.shape)}.")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts.")


def to_pil_images(images: torch.Tensor) -> list:
    """(B, 3, H, W) floats in [0, 1] -> B 8-bit RGB PIL images (rounded, as an image file would store them)."""
    import torch
    from PIL import Image

    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)  # (B, 3, H, W)
    return [Image.fromarray(a) for a in pixels.permute(0, 2, 3, 1).cpu().numpy()]


def _features(out: Any) -> torch.Tensor:
    # transformers 5 returns a model output whose pooler_output is the projected embedding; 4.x the tensor itself.
    import torch

    return out if isinstance(out, torch.Tensor) else out.pooler_output


def hf_clip_cosine(
    clip: torch.nn.Module, tokenizer: Any, image_processor: Any, pil: Sequence[Any], prompts: Sequence[str]
) -> torch.Tensor:
    """Cosine of each image's and its own prompt's L2-normalised CLIP embeddings, as PickScore's reference code.

    Returns:
        (b,) float32 on the model's device.
    """
    import torch

    device, dtype = clip.logit_scale.device, next(clip.vision_model.parameters()).dtype
    max_length = clip.config.text_config.max_position_embeddings  # 77 for CLIP
    text = tokenizer(list(prompts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    pixels = image_processor(images=list(pil), return_tensors="pt")["pixel_values"]  # (b, 3, S, S)
    f_img = _features(clip.get_image_features(pixel_values=pixels.to(device, dtype)))  # (b, D)
    ids, mask = text["input_ids"].to(device), text["attention_mask"].to(device)  # (b, T)
    f_txt = _features(clip.get_text_features(input_ids=ids, attention_mask=mask))  # (b, D)
    # Normalise and sum in float32: in bf16 the cosine itself would be rounded to ~3 significant digits.
    f_img = torch.nn.functional.normalize(f_img.float(), dim=-1)
    f_txt = torch.nn.functional.normalize(f_txt.float(), dim=-1)
    return (f_img * f_txt).sum(-1)


def chunks(n: int, size: int) -> Iterator[slice]:
    """Consecutive slices of ``range(n)`` of at most ``size`` items."""
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def hf_clip_reward(
    name: str,
    label: str,
    model: str,
    processor: str,
    *,
    model_hub: str,
    processor_hub: str,
    device: str,
    dtype: str,
    batch_size: int,
    finish: Callable[[torch.nn.Module], Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]],
    prefix: str = "",
) -> RewardFn:
    """The scorer base of the ``transformers`` CLIP rewards (CLIPScore, PickScore): the cosine of each image's and its
    own prompt's embeddings, batched, turned into the reward and its info by ``finish(clip)(cos)``.

    ``name`` is the reward's registered name (its options are ``reward.options.<name>``), ``label`` what a sentence
    calls it; ``model_hub`` and ``processor_hub`` are what a missing-weights sentence says to download; ``prefix`` is
    put before every prompt (a space after it).
    """
    import torch

    option = f"reward.options.{name}"
    torch_dtype = parse_dtype(dtype, f"{option}.dtype")
    batch_size = check_batch_size(batch_size, f"{option}.batch_size")
    clip, tokenizer, image_processor = load_hf_clip(
        model,
        processor,
        model_published=Published(
            what=f"the {label} model", option=f"{option}.model", download=f"the Hugging Face repo {model_hub}"
        ),
        processor_published=Published(
            what=f"the {label} processor", option=f"{option}.processor",
            download=f"the Hugging Face repo {processor_hub}",
        ),
    )
    clip = clip.to(device=device, dtype=torch_dtype)
    lead = prefix.rstrip() + " " if prefix.strip() else ""
    rewards = finish(clip)

    @torch.no_grad()
    def fn(
        images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        check_inputs(images, prompts)
        pil = to_pil_images(images)
        texts = [lead + p for p in prompts]
        cos = torch.empty(len(pil), dtype=torch.float32)
        for part in chunks(len(pil), batch_size):
            cos[part] = hf_clip_cosine(clip, tokenizer, image_processor, pil[part], texts[part]).cpu()
        return rewards(cos)

    fn.modules = (clip,)  # type: ignore[attr-defined]  (rewards_off_device moves it)
    return fn
