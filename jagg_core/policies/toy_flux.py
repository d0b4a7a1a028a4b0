"""`toy-flux`: a tiny diffusers ``FluxTransformer2DModel`` on packed pixels, conditioned by a tiny CLIP text encoder.

The embedded default's policy. Images are RGB in [-1, 1]; each ``p×p`` pixel patch is one token of ``3·p²`` channels
(Flux packs 2×2 latent patches the same way), so a 32×32 image with p = 4 is 64 tokens of 48 channels. The text
encoder is a ``transformers`` ``CLIPTextModel`` with a word-level tokenizer built locally from the world's vocabulary;
its last hidden state is Flux's ``encoder_hidden_states`` (T5's role) and its pooled output ``pooled_projections``
(CLIP's role). Saved in diffusers/transformers formats: ``transformer/``, ``text_encoder/``, ``tokenizer/`` and
``toy_flux.json`` (geometry).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..setup.options import LORA, Scale
from ..setup.json_read import read_json
from ..setup.storage import atomic_write_text
from .base import Policy, PolicyError, PromptEmbeds, no_grad, register_backbone
from .lora import apply_lora

if TYPE_CHECKING:
    import torch

    from ..schedules import Schedule

__all__ = ["ToyFluxPolicy", "ToyFluxShape", "build_toy_flux", "build_tokenizer", "pack", "unpack"]

SPECIALS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]


def pack(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, 3, H, W) -> (B, (H/p)·(W/p), 3·p²) tokens in row-major patch order."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // patch, patch, w // patch, patch)  # (B, C, h, p, w, p)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


def unpack(tokens: torch.Tensor, patch: int, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack`."""
    b = tokens.shape[0]
    x = tokens.reshape(b, height // patch, width // patch, 3, patch, patch)  # (B, h, w, C, p, p)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, 3, height, width)


def build_tokenizer(vocabulary: Sequence[str], max_length: int):
    """A word-level fast tokenizer over the world's words: ``[BOS] words [EOS]``, padded to ``max_length``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = sorted({w.lower() for w in vocabulary} - set(SPECIALS))
    vocab = {tok: i for i, tok in enumerate(SPECIALS + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", vocab["[BOS]"]), ("[EOS]", vocab["[EOS]"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        model_max_length=max_length,
    )


@dataclass(frozen=True)
class ToyFluxShape:
    """The toy policy's shape: its image and patch size, the transformer's blocks and heads, the text encoder's width,
    depth and context, what the network predicts, its guidance scale, and the seed of its random weights."""

    image_size: int = 32
    patch_size: int = 4
    num_layers: int = 2
    num_single_layers: int = 4
    num_attention_heads: int = 4
    attention_head_dim: int = 32
    text_hidden_size: int = 64
    text_layers: int = 2
    max_text_length: int = 24
    prediction: str = "x0"
    guidance_scale: float = 1.0
    seed: int = 0


def build_toy_flux(vocabulary: Sequence[str], shape: ToyFluxShape = ToyFluxShape()):
    """Fresh (random) transformer, text encoder and tokenizer of the toy policy of ``shape``."""
    import torch
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    image_size, patch_size, max_text_length = shape.image_size, shape.patch_size, shape.max_text_length
    attention_head_dim, text_hidden_size, prediction = shape.attention_head_dim, shape.text_hidden_size, shape.prediction
    if image_size % patch_size:
        raise PolicyError(f"image_size {image_size} must be a multiple of patch_size {patch_size}.")
    if attention_head_dim % 8:
        raise PolicyError(f"attention_head_dim must be a multiple of 8 (3-axis RoPE), got {attention_head_dim}.")
    tokenizer = build_tokenizer(vocabulary, max_text_length)
    torch.manual_seed(shape.seed)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=text_hidden_size,
            intermediate_size=4 * text_hidden_size,
            num_hidden_layers=shape.text_layers,
            num_attention_heads=max(1, text_hidden_size // 32),
            max_position_embeddings=max_text_length,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    d = attention_head_dim
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=3 * patch_size * patch_size,
        num_layers=shape.num_layers,
        num_single_layers=shape.num_single_layers,
        attention_head_dim=d,
        num_attention_heads=shape.num_attention_heads,
        joint_attention_dim=text_hidden_size,
        pooled_projection_dim=text_hidden_size,
        guidance_embeds=False,
        axes_dims_rope=(d // 4, 3 * d // 8, 3 * d // 8),
    )
    if prediction not in ("x0", "velocity"):
        raise PolicyError(f"prediction must be 'x0' or 'velocity', got {prediction!r}.")
    geometry = {"image_size": image_size, "patch_size": patch_size, "max_text_length": max_text_length,
                "prediction": prediction, "guidance_scale": shape.guidance_scale}
    return transformer, text_encoder, tokenizer, geometry


def save_toy_flux(folder: str | Path, transformer, text_encoder, tokenizer, geometry: Mapping[str, Any]) -> None:
    folder = Path(folder)
    transformer.save_pretrained(folder / "transformer")
    text_encoder.save_pretrained(folder / "text_encoder")
    tokenizer.save_pretrained(folder / "tokenizer")
    atomic_write_text(folder / "toy_flux.json", json.dumps(dict(geometry), indent=2) + "\n")


class ToyFluxPolicy(Policy):
    def __init__(self, transformer, text_encoder, tokenizer, geometry: Mapping[str, Any], *, device, dtype):
        import torch

        self.device = torch.device(device)
        self.dtype = dtype
        self.transformer = transformer.to(self.device)
        if next(transformer.parameters()).dtype != dtype:
            self.transformer = transformer.to(dtype=dtype)
        self.text_encoder = text_encoder.to(self.device).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.image_size = int(geometry["image_size"])
        self.patch_size = int(geometry["patch_size"])
        self.max_text_length = int(geometry["max_text_length"])
        self.prediction = geometry.get("prediction", "velocity")
        self.guidance_scale = float(geometry.get("guidance_scale", 1.0))
        side = self.image_size // self.patch_size
        rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        # Flux position ids: (0, row, col) per image token, zeros per text token.
        self.img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float().to(self.device)
        self.txt_ids = torch.zeros(self.max_text_length, 3, device=self.device)

    def latent_shape(self) -> tuple[int, ...]:
        side = self.image_size // self.patch_size
        return (side * side, 3 * self.patch_size**2)

    def schedule(self, num_steps: int) -> Schedule:
        from ..schedules import flow_match_schedule

        return flow_match_schedule(num_steps, shift=1.0, spacing="flux")

    @no_grad
    def _encode(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.tokenizer(
            list(prompts), padding="max_length", max_length=self.max_text_length, truncation=True,
            return_tensors="pt",
        ).input_ids.to(self.device)
        out = self.text_encoder(input_ids=ids)
        return out.last_hidden_state.to(self.dtype), out.pooler_output.to(self.dtype)

    @no_grad
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        embeds, pooled = self._encode(prompts)
        tensors = {"prompt_embeds": embeds, "pooled": pooled}
        if self.guidance_scale != 1.0:  # the empty prompt is the unconditional branch (trained by caption dropout)
            neg, neg_pooled = self._encode([""])
            tensors["negative_prompt_embeds"] = neg.expand_as(embeds)
            tensors["negative_pooled"] = neg_pooled.expand_as(pooled)
        return PromptEmbeds(tensors)

    def predict(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        """The transformer's raw output: the clean sample x̂₀ (prediction "x0") or the velocity."""
        return self.transformer(
            hidden_states=latents.to(self.dtype),
            encoder_hidden_states=embeds.tensors["prompt_embeds"],
            pooled_projections=embeds.tensors["pooled"],
            timestep=(timesteps / self.num_train_timesteps).to(self.dtype),  # Flux takes t in [0, 1]
            img_ids=self.img_ids,
            txt_ids=self.txt_ids,
            return_dict=False,
        )[0]

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        import torch

        t = embeds.tensors
        if self.guidance_scale != 1.0:
            # Classifier-free guidance in one batched call: [conditional; unconditional].
            both = PromptEmbeds({"prompt_embeds": torch.cat([t["prompt_embeds"], t["negative_prompt_embeds"]]),
                                 "pooled": torch.cat([t["pooled"], t["negative_pooled"]])})
            cond, uncond = self.predict(torch.cat([latents, latents]), torch.cat([timesteps, timesteps]),
                                        both).float().chunk(2)
            out = uncond + self.guidance_scale * (cond - uncond)
        else:
            out = self.predict(latents, timesteps, embeds).float()
        if self.prediction == "velocity":
            return out
        # x0-prediction (a skip connection as in EDM's preconditioning): with z = (1 − σ)·x₀ + σ·ε and v = ε − x₀,
        # v = (z − x₀)/σ. The tiny network then only has to draw the clean image; the noise passes through z.
        sigma = (timesteps.float() / self.num_train_timesteps).clamp_min(1e-3).view(-1, *([1] * (latents.ndim - 1)))
        return (latents.float() - out) / sigma

    @no_grad
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        images = unpack(latents.float(), self.patch_size, self.image_size, self.image_size)
        return ((images + 1.0) / 2.0).clamp(0.0, 1.0)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] -> clean latents x₀ (the pretraining targets)."""
        return pack(images * 2.0 - 1.0, self.patch_size)


def _require(folder: Path, rel: str) -> None:
    if not (folder / rel).exists():
        raise PolicyError(
            f"the toy-flux model at {folder} is incomplete: {rel} is missing; set model.path to a folder written by "
            f"the pretrain stage (`jagg pretrain`)."
        )


_REBUILD = "rebuild the base model with `jagg pretrain` or set model.path"


def check_toy_flux_dir(path: str | None) -> Path:
    """The toy-flux folder ``path``, checked for its files (one sentence for what is missing); nothing is loaded."""
    if path is None:
        raise PolicyError("model.path is not set; point it at the toy-flux folder written by `jagg pretrain`.")
    folder = Path(path)
    if not folder.is_dir():
        raise PolicyError(f"the toy-flux model folder {folder} does not exist; run `jagg pretrain` or set model.path.")
    for rel in ("toy_flux.json", "transformer/config.json", "text_encoder/config.json", "tokenizer/tokenizer.json"):
        _require(folder, rel)
    return folder


@register_backbone(
    "toy-flux",
    # model.options: the saved model's guidance (pretrain.guidance_scale by default) and LoRA
    options={"guidance_scale": (Scale, None), "lora": LORA},
    check_files=check_toy_flux_dir,
    export_pipeline="FluxPipeline",  # a FluxTransformer2DModel: its LoRA keys are Flux's
    world=True,  # the embedded default: prompts from the world, its base model from `jagg pretrain`
)
def load_toy_flux(path: str | None, *, device: torch.device, dtype: torch.dtype, options: Mapping[str, Any]):
    folder = check_toy_flux_dir(path)
    # bounded and regular (a FIFO there hung `jagg evaluate`); a damaged file is one sentence, before the seconds
    # of diffusers' and transformers' imports
    geometry = read_json(folder / "toy_flux.json", PolicyError, limit=1 << 20, fix=_REBUILD)
    if not isinstance(geometry, dict):
        raise PolicyError(f"{folder / 'toy_flux.json'} is not a JSON object; {_REBUILD}.")
    unknown = set(options) - {"lora", "guidance_scale"}
    if unknown:
        raise PolicyError(f"unknown toy-flux option(s) {sorted(unknown)}; toy-flux takes lora and guidance_scale.")
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextModel, PreTrainedTokenizerFast

    if "guidance_scale" in options:
        geometry["guidance_scale"] = float(options["guidance_scale"])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer")
    if len(tokenizer) <= len(SPECIALS):
        raise PolicyError(f"the tokenizer in {folder / 'tokenizer'} loaded empty; rebuild it with `jagg pretrain`.")
    try:
        transformer = FluxTransformer2DModel.from_pretrained(folder / "transformer")
        text_encoder = CLIPTextModel.from_pretrained(folder / "text_encoder")
    except (OSError, ValueError) as e:
        raise PolicyError(f"cannot load the toy-flux weights in {folder}: {str(e).splitlines()[0]}") from None
    policy = ToyFluxPolicy(transformer, text_encoder, tokenizer, geometry, device=device, dtype=dtype)
    lora = options.get("lora")
    if lora and lora.get("rank", 0) > 0:
        apply_lora(policy.transformer, **lora)
    return policy
