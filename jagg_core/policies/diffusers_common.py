"""What the diffusers backbones share: finding and checking a model folder offline, loading its frozen parts, the
pipeline's sampling schedule from its scheduler config, the trained transformer (LoRA or full) and VAE output.

Every failure a user can cause (a wrong ``model.path``, a half-finished download, an empty offline tokenizer, an
unknown option) becomes one :class:`PolicyError` sentence saying what is missing and what to download.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ..setup.json_read import read_json
from .base import PolicyError
from .lora import DEFAULT_TARGET_MODULES, apply_lora

if TYPE_CHECKING:
    import torch

    from ..schedules import Schedule

__all__ = [
    "MODEL",
    "SCHEDULER",
    "TOKENIZER",
    "check_image_size",
    "check_model_dir",
    "check_scheduler_config",
    "check_tokenizer",
    "freeze",
    "load_component",
    "load_scheduler_config",
    "load_text_encoders",
    "parse_dtype",
    "pipeline_schedule",
    "prepare_transformer",
    "read_config",
    "read_options",
    "resolve_model_dir",
    "to_unit_images",
]

# A component folder holds a model, a tokenizer or a scheduler config; each kind is checked differently.
MODEL, TOKENIZER, SCHEDULER = "model", "tokenizer", "scheduler"

_DTYPES = {  # name -> torch's (torch is imported where a dtype is made)
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` → ``torch.bfloat16`` (likewise fp16, fp32)."""
    import torch

    if isinstance(value, torch.dtype):
        return value
    key = str(value).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise PolicyError(f"unknown dtype {value!r}; use one of {', '.join(_DTYPES)}.")
    return getattr(torch, _DTYPES[key])


def _download_hint(hub_id: str) -> str:
    return f"download {hub_id} (`hf download {hub_id}`) and set model.path to its folder"


def resolve_model_dir(path: str | Path | None, *, hub_id: str) -> Path:
    """The local folder of ``path``: a folder as given, or a hub id from the HF cache (never downloads).

    ``None`` means the backbone's usual hub id ``hub_id``.
    """
    path = hub_id if path is None else path
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists():
        raise PolicyError(
            f"model.path {str(path)!r} is a file, not a diffusers model folder; {_download_hint(hub_id)}."
        )
    text = str(path)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(repo_id=text, local_files_only=True))
        except Exception:  # noqa: BLE001 - any failure means "not in the cache"; say so in one sentence
            raise PolicyError(
                f"model.path {text!r} is neither a folder nor in the Hugging Face cache (offline); "
                f"{_download_hint(text)}."
            ) from None
    raise PolicyError(f"model.path {text!r} does not exist; {_download_hint(hub_id)}.")


def _missing(folder: Path, what: str, hub_id: str) -> PolicyError:
    return PolicyError(f"model.path {str(folder)!r} is missing {what}; {_download_hint(hub_id)}.")


def _check_weights(folder: Path, name: str, hub_id: str) -> None:
    sub = folder / name
    if not (sub / "config.json").is_file():
        raise _missing(folder, f"the {name} config ({name}/config.json)", hub_id)
    # A sharded checkpoint: every shard its index names must be there. Variant indexes ("model.fp16.…") are not
    # what from_pretrained reads without a variant.
    indexes = [p for p in sorted(sub.glob("*.index.json")) if p.name.count(".") == 3]
    for index in indexes:
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        absent = [s for s in shards if not (sub / s).is_file()]
        if absent:
            raise _missing(folder, f"{len(absent)} of {len(shards)} {name} weight shards ({name}/{absent[0]})", hub_id)
    if not indexes and not any(p.is_file() for pattern in ("*.safetensors", "*.bin") for p in sub.glob(pattern)):
        raise _missing(folder, f"the {name} weights ({name}/*.safetensors)", hub_id)


def check_model_dir(folder: Path, components: Mapping[str, str], *, hub_id: str) -> None:
    """Check ``folder`` is a complete diffusers model: model_index.json and each component's config and files."""
    if not (folder / "model_index.json").is_file():
        raise _missing(folder, "model_index.json (it is not a diffusers model folder)", hub_id)
    for name, kind in components.items():
        sub = folder / name
        if not sub.is_dir():
            raise _missing(folder, f"the {name} component ({name}/)", hub_id)
        if kind == SCHEDULER and not (sub / "scheduler_config.json").is_file():
            raise _missing(folder, f"the scheduler config ({name}/scheduler_config.json)", hub_id)
        if kind == TOKENIZER and not any(sub.iterdir()):
            raise _missing(folder, f"the {name} files ({name}/ is empty)", hub_id)
        if kind == MODEL:
            _check_weights(folder, name, hub_id)


def check_tokenizer(tokenizer: Any, name: str, *, folder: Path, hub_id: str) -> None:
    """Raise if ``tokenizer`` knows no words (what offline transformers returns for a tokenizer it could not find)."""
    ids = tokenizer("a photo of a cat", add_special_tokens=False).input_ids
    skip = {getattr(tokenizer, "unk_token_id", None), *tokenizer.all_special_ids}
    # A T5 tokenizer that has only its extra ids still yields the word-boundary piece "▁": that is no word.
    tokens = tokenizer.convert_ids_to_tokens(ids)
    words = [t for i, t in zip(ids, tokens) if i not in skip and t.replace("</w>", "").strip("▁Ġ ")]
    if not words:
        raise PolicyError(
            f"the tokenizer in {str(folder / name)!r} is empty (vocabulary of {len(tokenizer)}, every word unknown); "
            f"{_download_hint(hub_id)}."
        )


def _unreadable(folder: Path, what: str, error: Exception, hub_id: str) -> PolicyError:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return PolicyError(f"model.path {str(folder)!r} has an unreadable {what} ({reason}); {_download_hint(hub_id)}.")


def load_component(cls: Any, folder: Path, name: str, *, dtype: torch.dtype, hub_id: str) -> Any:
    """``cls.from_pretrained(folder, subfolder=name)``; a broken file becomes a PolicyError naming the component."""
    try:
        return cls.from_pretrained(folder, subfolder=name, dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise _unreadable(folder, name, e, hub_id) from e


def freeze(module: torch.nn.Module) -> torch.nn.Module:
    """Eval mode and no gradients: text encoders and the VAE never train."""
    return module.eval().requires_grad_(False)


def load_text_encoders(
    pipeline_cls: Any,
    folder: Path,
    *,
    tokenizers: tuple[str, ...],
    device: torch.device,
    dtype: torch.dtype,
    hub_id: str,
) -> Any:
    """The diffusers pipeline without transformer and VAE: its tokenizers, frozen text encoders and ``encode_prompt``.

    Encoding through the pipeline's own ``encode_prompt`` keeps templates, truncation and pooling exactly as
    diffusers samples.
    """
    import torch

    try:
        pipe = pipeline_cls.from_pretrained(folder, transformer=None, vae=None, dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise _unreadable(folder, "text encoder or tokenizer", e, hub_id) from e
    for name in tokenizers:
        check_tokenizer(getattr(pipe, name), name, folder=folder, hub_id=hub_id)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            freeze(component)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def read_options(options: Mapping[str, Any], defaults: Mapping[str, Any], *, backbone: str) -> dict[str, Any]:
    """``defaults`` overridden by ``options``; an unknown key (or ``lora`` key) is a typo, not something to ignore."""
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise PolicyError(
            f"unknown model option(s) {', '.join(unknown)} for backbone {backbone!r}; "
            f"known: {', '.join(sorted(defaults))}."
        )
    merged = {**defaults, **options}
    lora = merged.get("lora")
    known = {"rank", "alpha", "target_modules", "dropout"}
    if lora and set(lora) - known:  # checked here, before minutes of loading
        unknown = ", ".join(sorted(set(lora) - known))
        raise PolicyError(f"unknown model.lora key(s) {unknown}; known: {', '.join(sorted(known))}.")
    return merged


def read_config(folder: Path, name: str) -> dict[str, Any]:
    """A component's config.json, read before any weights load (to validate options cheaply)."""
    return _read_json(folder / name / "config.json")


def _read_json(path: Path) -> Any:
    """A model folder's JSON file, bounded, regular, finite and shallow (:func:`read_json`), or one
    :class:`PolicyError` sentence."""
    return read_json(path, PolicyError, limit=64 << 20,
                     fix="download the model again or point model.path at a whole model folder")


def check_image_size(height: int, width: int, multiple: int) -> None:
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or value < multiple or value % multiple:
            raise PolicyError(f"model.{name} must be a positive multiple of {multiple} pixels, got {value!r}.")


def prepare_transformer(
    transformer: torch.nn.Module, *, lora: Mapping[str, Any] | None, gradient_checkpointing: bool
) -> torch.nn.Module:
    """The trained module: LoRA adapters on a frozen base (``lora`` with rank > 0) or every weight (full fine-tune)."""
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if not lora or not lora.get("rank"):
        return transformer.requires_grad_(True)
    return apply_lora(
        transformer,
        rank=int(lora["rank"]),
        alpha=lora.get("alpha"),
        target_modules=tuple(lora.get("target_modules") or DEFAULT_TARGET_MODULES),
        dropout=float(lora.get("dropout", 0.0)),
    )


def check_scheduler_config(config: Mapping[str, Any], *, folder: Path) -> None:
    """Refuse scheduler settings :func:`pipeline_schedule` does not reproduce, rather than sample off-schedule."""
    flags = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas")
    unsupported = [k for k in flags if config.get(k)]
    if config.get("time_shift_type", "exponential") != "exponential":
        unsupported.append(f"time_shift_type={config['time_shift_type']}")
    if unsupported:
        raise PolicyError(
            f"{str(folder / 'scheduler' / 'scheduler_config.json')!r} sets {', '.join(unsupported)}, which jagg's "
            "flow-matching schedule does not reproduce; use the scheduler config the model was released with."
        )


def load_scheduler_config(folder: Path) -> dict[str, Any]:
    """The model's ``FlowMatchEulerDiscreteScheduler`` config with diffusers' defaults filled in, checked."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = dict(FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler").config)
    check_scheduler_config(config, folder=folder)
    return config


def pipeline_schedule(config: Mapping[str, Any], num_steps: int, *, image_seq_len: int, spacing: str) -> Schedule:
    """The schedule the diffusers pipeline samples with, from its ``FlowMatchEulerDiscreteScheduler`` config.

    Dynamic (resolution) shifting when ``use_dynamic_shifting``, else the static ``shift``; then, where the config
    sets ``shift_terminal`` (Qwen-Image: 0.02), diffusers' ``stretch_shift_to_terminal``.
    """
    from ..schedules import Schedule, flow_match_schedule, resolution_mu
    import torch

    mu = None
    if config.get("use_dynamic_shifting"):
        mu = resolution_mu(
            image_seq_len,
            base_seq_len=config.get("base_image_seq_len", 256),
            max_seq_len=config.get("max_image_seq_len", 4096),
            base_shift=config.get("base_shift", 0.5),
            max_shift=config.get("max_shift", 1.15),
        )
    n_train = config.get("num_train_timesteps", 1000)
    schedule = flow_match_schedule(
        num_steps, shift=config.get("shift", 1.0), mu=mu, spacing=spacing, num_train_timesteps=n_train
    )
    terminal = config.get("shift_terminal")
    if not terminal:
        return schedule
    if num_steps < 2:  # the stretch divides by 1 − σ_first = 0 (diffusers returns NaN)
        raise ValueError(f"a schedule with shift_terminal needs at least 2 steps, got {num_steps}.")
    sigmas = schedule.sigmas[:-1].to(torch.float32)  # stretched in float32, as diffusers does
    one_minus = 1 - sigmas
    sigmas = (1 - one_minus / (one_minus[-1] / (1 - terminal))).to(torch.float64)
    return Schedule(sigmas=torch.cat([sigmas, sigmas.new_zeros(1)]), timesteps=sigmas * n_train)


def to_unit_images(decoded: torch.Tensor) -> torch.Tensor:
    """VAE output in [-1, 1] → float32 images in [0, 1] (VaeImageProcessor's denormalize)."""
    return (decoded.float() / 2 + 0.5).clamp(0, 1)
