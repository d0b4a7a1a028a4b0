"""The policy base of the diffusers backbones (Flux, SD3, Qwen-Image, Wan) and the decorator that registers one.

A diffusers backbone is a transformer that is trained, text encoders and a VAE that are frozen, all loaded offline from
one model folder. What differs between backbones is small and lives in the subclass: its latent layout (read from the
folder's configs, checked before minutes of loading), how it encodes prompts and calls its transformer, how it
decodes. Everything else (reading ``model.options`` strictly, checking the folder, loading the frozen parts and the
transformer, LoRA or full fine-tune, the negative prompt of true classifier-free guidance encoded once) is here, once.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

from .base import Policy, PromptEmbeds, no_grad, register_backbone
from .diffusers_common import (
    MODEL,
    SCHEDULER,
    TOKENIZER,
    check_model_dir,
    freeze,
    load_component,
    load_text_encoders,
    prepare_transformer,
    read_options,
    resolve_model_dir,
)

if TYPE_CHECKING:
    import torch

__all__ = ["DiffusersPolicy", "diffusers_backbone"]


class DiffusersPolicy(Policy):
    """A diffusers transformer (trained) + its pipeline's text encoders and VAE (frozen).

    Subclasses set the class facts below and implement ``_layout`` (sizes from the folder's configs, before loading),
    ``_encode``, ``latent_shape``, ``schedule``, ``velocity`` and ``decode``; ``_read_transformer`` and ``_loaded`` read
    what they need of the loaded transformer and VAE.
    """

    backbone: ClassVar[str]  # the registered name (set by :func:`diffusers_backbone`)
    hub_id: ClassVar[str]  # where the weights come from (read from the HF cache, offline)
    # sub-folder -> MODEL | TOKENIZER | SCHEDULER (diffusers_common); by default the pipeline's usual folders: the
    # scheduler, transformer and VAE, and a text encoder beside each tokenizer (text_encoder_2 beside tokenizer_2)
    components: ClassVar[Mapping[str, str]]
    defaults: ClassVar[Mapping[str, Any]]  # model.options and their defaults
    pipeline: ClassVar[str]  # the diffusers pipeline: its encode_prompt here, its LoRA format in an export
    transformer_class: ClassVar[str]
    vae_class: ClassVar[str]
    tokenizers: ClassVar[tuple[str, ...]] = ("tokenizer",)
    embeds: ClassVar[tuple[str, ...]] = ("prompt_embeds",)  # what ``_encode`` returns, by the pipeline's names
    true_cfg: ClassVar[bool] = False  # a negative-prompt half beside the conditional one when guidance_scale > 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "components" not in cls.__dict__:
            folders = {"scheduler": SCHEDULER, "transformer": MODEL, "vae": MODEL}
            for tokenizer in cls.tokenizers:
                folders |= {tokenizer: TOKENIZER, tokenizer.replace("tokenizer", "text_encoder"): MODEL}
            cls.components = dict(sorted(folders.items()))  # checked in this order: the first missing one is named

    def __init__(self, folder: Path, *, device: torch.device, dtype: torch.dtype, options: Mapping[str, Any]):
        import diffusers

        opts = read_options(options, self.defaults, backbone=self.backbone)
        check_model_dir(folder, self.components, hub_id=self.hub_id)
        self._layout(folder, opts)  # sizes checked before minutes of loading
        self.device, self.dtype = device, dtype
        self.guidance_scale = float(opts["guidance_scale"])
        if self.true_cfg:
            self.do_cfg = self.guidance_scale > 1  # the pipelines' do_classifier_free_guidance
            self.negative_prompt = str(opts["negative_prompt"])
            self._negative: Any = None
        self.max_sequence_length = int(opts["max_sequence_length"])

        self.encoders = load_text_encoders(
            getattr(diffusers, self.pipeline), folder, tokenizers=self.tokenizers, device=device, dtype=dtype,
            hub_id=self.hub_id,
        )
        vae = load_component(getattr(diffusers, self.vae_class), folder, "vae", dtype=dtype, hub_id=self.hub_id)
        self.vae = freeze(vae).to(device)
        transformer = load_component(
            getattr(diffusers, self.transformer_class), folder, "transformer", dtype=dtype, hub_id=self.hub_id
        )
        # Read before wrapping: the trainer may wrap the transformer (DDP) and hide its config.
        self._read_transformer(transformer.config)
        self.transformer = prepare_transformer(
            transformer.to(device), lora=self._lora(opts["lora"]),
            gradient_checkpointing=bool(opts["gradient_checkpointing"]),
        )
        self._loaded(opts)

    @classmethod
    def load(cls, path: str | None, *, device: torch.device, dtype: torch.dtype,
             options: Mapping[str, Any]) -> "DiffusersPolicy":
        """The policy of the model folder or cached hub id ``path`` (None: the backbone's own hub id)."""
        return cls(resolve_model_dir(path, hub_id=cls.hub_id), device=device, dtype=dtype, options=options)

    def _layout(self, folder: Path, opts: Mapping[str, Any]) -> None:
        """Image (and clip) size and latent layout from the folder's configs; bad sizes refused here."""
        raise NotImplementedError

    def _read_transformer(self, config: Any) -> None:
        """What the policy needs of the transformer's config: its latent channels (packed backbones: a quarter)."""
        self.latent_channels = config.in_channels

    def _lora(self, lora: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        return lora

    def _loaded(self, opts: Mapping[str, Any]) -> None:
        """What the subclass reads of its loaded parts."""

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, ...]:
        """The prompts' tensors, one per name of ``embeds``, batch first."""
        raise NotImplementedError

    @no_grad
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        tensors = dict(zip(self.embeds, self._encode(list(prompts))))
        if self.true_cfg and self.do_cfg:
            if self._negative is None:  # the same for every prompt: encoded once
                self._negative = self._encode([self.negative_prompt])
            for name, t in zip(self.embeds, self._negative):
                tensors[f"negative_{name}"] = t.expand(len(prompts), *t.shape[1:])
        return PromptEmbeds(tensors)


def diffusers_backbone(name: str, *, stand_in: Callable[[Path], Path], **facts: Any):
    """Class decorator: register a :class:`DiffusersPolicy` subclass as backbone ``name``; the spec's hub id,
    components, defaults and export pipeline are the class's own, ``facts`` the rest (options, cost, ...)."""

    def deco(cls: type[DiffusersPolicy]) -> type[DiffusersPolicy]:
        cls.backbone = name

        def factory(path: str | None, *, device: torch.device, dtype: torch.dtype,
                    options: Mapping[str, Any]) -> Policy:
            return cls.load(path, device=device, dtype=dtype, options=options)

        factory.__module__, factory.__qualname__ = cls.__module__, f"{cls.__qualname__}.load"
        register_backbone(name, defaults=cls.defaults, hub_id=cls.hub_id, components=cls.components,
                          export_pipeline=cls.pipeline, stand_in=stand_in, **facts)(factory)
        return cls

    return deco
