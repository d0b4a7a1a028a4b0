"""`tiny-sana`: an example backbone plugin, a tiny random Sana (diffusers' ``SanaTransformer2DModel``).

jagg ships Flux, SD3, Qwen-Image, Wan and its toy; this one file adds a backbone of another kind, the way a user adds
last month's model: it builds the model's parts, wraps them in a :class:`~jagg_core.policies.base.Policy` (prompts →
embeddings, the network's velocity, latents → images) and registers it under a name with its spec (typed options
with defaults and bounds, cost facts for `jagg plan`, the diffusers pipeline an export writes for, a stand-in
folder). jagg's configuration, sampler, trainer, evaluation, plan and export then work on it unchanged
(docs/extending.md).

What it is (all random, nothing downloaded, built from ``options["seed"]`` on the CPU in float32, so two builds on
any machine give the same weights):

- the trained **transformer**: ``SanaTransformer2DModel``, 2 blocks of width 32 (linear self-attention, cross-attention
  to the text, GLU-conv feed-forward; 54 k parameters), on 4-channel latents with 1×1 patches;
- the frozen **text encoder**: a 2-layer, 32-wide ``Gemma2Model`` (Sana's is Gemma-2-2B) behind a byte-level
  tokenizer built in code (every UTF-8 byte a token, ``<bos>`` first: no vocabulary file);
- the frozen **VAE**: a 3-stage ``AutoencoderDC`` (Sana's deep-compression autoencoder, here 4× instead of 32×);
- the **schedule**: ``FlowMatchEulerDiscreteScheduler(shift=3)``'s sigmas (jagg's ``flow_match_schedule``).

The denoising step is ``SanaPipeline``'s (prompts lower-cased, padded to ``max_sequence_length`` with their attention
mask, classifier-free guidance with the unconditional half first, timesteps ``σ·1000`` as the scheduler gives them,
the VAE decoding ``latents / scaling_factor``); ``tests/test_example_backbone.py`` checks the policy against
``SanaPipeline`` itself. Sana's "complex human instruction" prompt prefix is left out (it is hundreds of tokens).

Use it: name the file in params.yaml (``model.path`` unset builds from the seed; a folder written by
:func:`save_tiny_sana` loads)::

    plugins: [examples/plugins/tiny_sana.py]
    model: {backbone: tiny-sana, options: {height: 32, width: 32, guidance_scale: 4.5}}
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Mapping, NamedTuple, Sequence

import torch
from pydantic import Field

from jagg_core.policies.base import Policy, PolicyError, PromptEmbeds, register_backbone
from jagg_core.policies.diffusers_common import prepare_transformer, to_unit_images
from jagg_core.schedules import Schedule, flow_match_schedule
from jagg_core.setup.options import LORA
from jagg_core.setup.registry import CostFacts

# --- The backbone's facts ----------------------------------------------------------------------------------------
# Plain data, kept together so that a spec declaration (name, options, components, cost and export facts) can take
# them in one edit; the code below reads them (the test checks the counts against the built model).

NAME = "tiny-sana"


class Option(NamedTuple):
    """One model option: its default, its type, its bounds (inclusive; None: unbounded) and what it means."""

    default: Any
    type: type | tuple[type, ...]
    doc: str
    minimum: float | None = None
    maximum: float | None = None


OPTIONS: dict[str, Option] = {
    "height": Option(32, int, "image height in pixels; a multiple of 4 (the VAE's 4× and 1×1 patches)", 4, 1024),
    "width": Option(32, int, "image width in pixels; a multiple of 4", 4, 1024),
    "guidance_scale": Option(4.5, (int, float), "classifier-free guidance scale (SanaPipeline's default); <= 1: off",
                             0.0, 30.0),
    "negative_prompt": Option("", str, "the unconditional prompt of classifier-free guidance (SanaPipeline's)"),
    "max_sequence_length": Option(32, int, "text tokens (bytes + <bos>) a prompt is padded or cut to", 2, 300),
    "shift": Option(3.0, (int, float), "the schedule's static shift (the scheduler config's `shift`)", 0.01, 100.0),
    "seed": Option(0, int, "seed of the random weights when model.path is not set", 0, 2**63 - 1),
    "lora": Option(None, (dict, type(None)), "{rank, alpha, target_modules, dropout}; None or rank 0: full fine-tune"),
    "gradient_checkpointing": Option(False, bool, "recompute each block's activations in the backward"),
}
DEFAULTS: dict[str, Any] = {name: o.default for name, o in OPTIONS.items()}

# The parts' constructor arguments (diffusers' and transformers' own names). The text encoder's vocabulary is the
# tokenizer's: 256 bytes and 3 specials.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
TRANSFORMER_CONFIG: dict[str, Any] = dict(
    in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
    num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=32,
    mlp_ratio=2.5, sample_size=8, patch_size=1, interpolation_scale=None,  # no positional embedding, as Sana
)
TEXT_ENCODER_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    attn_implementation="eager",  # Gemma-2's logit soft-capping, which SDPA does not do
)
VAE_CONFIG: dict[str, Any] = dict(
    in_channels=3, latent_channels=4, attention_head_dim=8,
    encoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
    decoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
    encoder_block_out_channels=(8, 16, 16), decoder_block_out_channels=(8, 16, 16),
    encoder_layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
    encoder_qkv_multiscales=((), (), (5,)), decoder_qkv_multiscales=((), (), (5,)),
    downsample_block_type="conv", upsample_block_type="interpolate",
    scaling_factor=0.41407,  # Sana's DC-AE's
)
SCHEDULER_CONFIG: dict[str, Any] = dict(shift=DEFAULTS["shift"])  # FlowMatchEulerDiscreteScheduler's
LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")  # self- and cross-attention (no joint-attention names)
VAE_SCALE_FACTOR = 2 ** (len(VAE_CONFIG["encoder_block_out_channels"]) - 1)  # pixels per latent pixel: 4

# What a diffusers folder of this model holds (save_tiny_sana writes it; SanaPipeline.from_pretrained loads it).
PIPELINE_CLASS = "SanaPipeline"  # what an export loads into; its LoRA format is SanaPipeline.load_lora_weights'
TRANSFORMER_CLASS = "SanaTransformer2DModel"
COMPONENTS = ("scheduler", "text_encoder", "tokenizer", "transformer", "vae")

# Cost facts for a planner (the fields of jagg_core.setup.registry.CostFacts), checked against the built model
# by the test.
ARCHITECTURE: dict[str, Any] = dict(
    name="tiny Sana (random)",
    params=54_084,  # transformer parameters
    layers=TRANSFORMER_CONFIG["num_layers"],
    hidden=TRANSFORMER_CONFIG["num_attention_heads"] * TRANSFORMER_CONFIG["attention_head_dim"],
    pixels_per_token=VAE_SCALE_FACTOR * TRANSFORMER_CONFIG["patch_size"],
    text_tokens=DEFAULTS["max_sequence_length"],
    frozen_params=27_008 + 35_079,  # text encoder + VAE
    cross_attention=True,  # text by cross-attention, linear self-attention over the image tokens
    true_cfg=True,  # guidance_scale > 1: the unconditional and conditional halves, two forwards a step
    source="examples/plugins/tiny_sana.py: 2 Sana blocks of width 32; DC-AE ×4, 1×1 patches; 2-layer Gemma-2",
)

# --- Building the parts --------------------------------------------------------------------------------------------


def byte_tokenizer():
    """A byte-level tokenizer: ``<bos>`` then one token per UTF-8 byte (a BPE with no merges), so any prompt encodes
    and the vocabulary is fixed without a file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 printable stand-ins of the bytes
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   padding_side="right")  # SanaPipeline pads on the right


def build_parts(seed: int = 0) -> dict[str, Any]:
    """The random parts, from ``seed`` alone: on the CPU in float32 (bit-identical on every machine), leaving the
    caller's random state as it was."""
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return {
            "tokenizer": byte_tokenizer(),
            "text_encoder": Gemma2Model(Gemma2Config(**TEXT_ENCODER_CONFIG)).eval(),
            "vae": AutoencoderDC(**VAE_CONFIG).eval(),
            "transformer": SanaTransformer2DModel(**TRANSFORMER_CONFIG).eval(),
            "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        }


def save_tiny_sana(folder: str | Path, seed: int = 0) -> Path:
    """Write the parts of ``seed`` as a diffusers ``SanaPipeline`` folder (what ``model.path`` may point at)."""
    from diffusers import SanaPipeline

    folder = Path(folder)
    SanaPipeline(**build_parts(seed)).save_pretrained(folder)
    return folder


def check_folder(folder: str | Path | None) -> Path | None:
    """A folder written by :func:`save_tiny_sana`, checked without loading it (None: the model is built from its seed);
    a wrong folder is one sentence. The spec's ``check_files``: a launcher runs it before starting any worker."""
    if folder is None:
        return None
    folder = Path(folder)
    missing = [name for name in ("model_index.json", *COMPONENTS) if not (folder / name).exists()]
    if missing:
        raise PolicyError(f"model.path {str(folder)!r} is not a {NAME} folder ({missing[0]} is missing); write one "
                          f"with save_tiny_sana() from examples/plugins/tiny_sana.py, or leave model.path unset.")
    return folder


def load_parts(folder: str | Path) -> dict[str, Any]:
    """The parts of a folder written by :func:`save_tiny_sana`; a wrong folder is one sentence."""
    from diffusers import SanaPipeline

    folder = check_folder(folder)
    pipe = SanaPipeline.from_pretrained(folder, dtype=torch.float32)
    return {name: getattr(pipe, name) for name in COMPONENTS}


def check_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``DEFAULTS`` overridden by ``options``, each checked against :data:`OPTIONS` (one sentence per mistake)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise PolicyError(f"unknown model option(s) {', '.join(unknown)} for backbone {NAME!r}; "
                          f"known: {', '.join(OPTIONS)}.")
    merged = {**DEFAULTS, **options}
    for name, value in merged.items():
        o = OPTIONS[name]
        if not isinstance(value, o.type) or (isinstance(value, bool) and o.type is not bool):
            raise PolicyError(f"model.options.{name} = {value!r} is invalid: {o.doc}.")
        if o.minimum is not None and not o.minimum <= value <= o.maximum:
            raise PolicyError(f"model.options.{name} = {value!r} is out of range [{o.minimum}, {o.maximum}]: {o.doc}.")
    for side in ("height", "width"):
        if merged[side] % (VAE_SCALE_FACTOR * TRANSFORMER_CONFIG["patch_size"]):
            raise PolicyError(f"model.options.{side} = {merged[side]} is invalid: {OPTIONS[side].doc}.")
    return merged


# --- The policy ------------------------------------------------------------------------------------------------------


class TinySanaPolicy(Policy):
    """Sana transformer (trained) + Gemma-2 text encoder and DC-AE VAE (frozen), with SanaPipeline's step.

    Independent of how it is registered: give it the parts and checked options (:func:`check_options`).
    Latents are unpacked ``(C, h, w)``; the transformer patchifies them itself.
    """

    def __init__(self, parts: Mapping[str, Any], options: Mapping[str, Any], *, device: torch.device | str,
                 dtype: torch.dtype):
        self.device, self.dtype = torch.device(device), dtype
        self.options = dict(options)
        self.height, self.width = options["height"], options["width"]
        self.guidance_scale = float(options["guidance_scale"])
        self.do_cfg = self.guidance_scale > 1  # SanaPipeline.do_classifier_free_guidance
        self.max_sequence_length = options["max_sequence_length"]
        self.shift = float(options["shift"])
        self.tokenizer = parts["tokenizer"]
        # The frozen parts stay in float32 (they are tiny, and their outputs are cast to the transformer's dtype).
        self.text_encoder = parts["text_encoder"].to(self.device).eval().requires_grad_(False)
        self.vae = parts["vae"].to(self.device).eval().requires_grad_(False)
        transformer = parts["transformer"].to(self.device)
        if transformer.dtype != dtype:  # (diffusers warns about any dtype in .to(), even the one it has)
            transformer = transformer.to(dtype=dtype)
        self.latent_channels = transformer.config.in_channels
        self.timestep_scale = transformer.config.timestep_scale  # 1 for Sana; what SanaPipeline multiplies t by
        lora = options["lora"] and {"target_modules": LORA_TARGET_MODULES, **options["lora"]}
        self.transformer = prepare_transformer(transformer, lora=lora,
                                               gradient_checkpointing=options["gradient_checkpointing"])
        self._negative: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def _encode(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        text = [p.lower().strip() for p in prompts]  # SanaPipeline._text_preprocessing without caption cleaning
        tokens = self.tokenizer(text, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                                add_special_tokens=True, return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)
        embeds = self.text_encoder(tokens.input_ids.to(self.device), attention_mask=mask)[0]
        return embeds.to(self.dtype), mask  # (B, L, D), (B, L): padding is masked out of the cross-attention

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        embeds, mask = self._encode(prompts)
        tensors = {"prompt_embeds": embeds, "prompt_attention_mask": mask}
        if self.do_cfg:
            if self._negative is None:  # the same for every prompt: encoded once
                self._negative = self._encode([self.options["negative_prompt"]])
            neg, neg_mask = self._negative
            tensors["negative_prompt_embeds"] = neg.expand_as(embeds)
            tensors["negative_prompt_attention_mask"] = neg_mask.expand_as(mask)
        return PromptEmbeds(tensors)

    def latent_shape(self) -> tuple[int, ...]:
        return (self.latent_channels, self.height // VAE_SCALE_FACTOR, self.width // VAE_SCALE_FACTOR)

    def schedule(self, num_steps: int) -> Schedule:
        # FlowMatchEulerDiscreteScheduler.set_timesteps(num_steps) with a static shift: SD3's spacing.
        return flow_match_schedule(num_steps, shift=self.shift, spacing="sd3",
                                   num_train_timesteps=self.num_train_timesteps)

    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        b = latents.shape[0]
        x = latents.to(self.device, self.dtype)
        t = timesteps.to(self.device, torch.float32).expand(b) * self.timestep_scale  # σ·1000, as the scheduler's
        e = embeds.tensors
        text, mask = e["prompt_embeds"].to(self.device), e["prompt_attention_mask"].to(self.device)
        if self.do_cfg:  # one batched call, the unconditional half first, as SanaPipeline concatenates
            x, t = torch.cat([x, x]), torch.cat([t, t])
            text = torch.cat([e["negative_prompt_embeds"].to(self.device), text])
            mask = torch.cat([e["negative_prompt_attention_mask"].to(self.device), mask])
        out = self.transformer(x, encoder_hidden_states=text, encoder_attention_mask=mask, timestep=t,
                               return_dict=False)[0].float()  # the flow-matching velocity ε − x₀
        if not self.do_cfg:
            return out
        uncond, cond = out.chunk(2)
        return uncond + self.guidance_scale * (cond - uncond)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents.to(self.device, torch.float32) / self.vae.config.scaling_factor
        return to_unit_images(self.vae.decode(z, return_dict=False)[0])


# --- Registration ------------------------------------------------------------------------------------------------


def _schema() -> dict[str, tuple[Any, Any]]:
    """:data:`OPTIONS` as the spec's typed schema: what params.yaml's ``model.options`` is read through before any work
    (jagg_core/setup/options.py; a wrong type or a value out of bounds is one sentence there)."""
    out = {}
    for name, o in OPTIONS.items():
        if name == "lora":
            out[name] = LORA
            continue
        kind = float if o.type == (int, float) else o.type
        bounds = {"ge": o.minimum, "le": o.maximum} if o.minimum is not None else {}
        out[name] = (Annotated[kind, Field(**bounds)] if bounds else kind, None)
    return out


@register_backbone(
    NAME,
    options=_schema(),
    defaults=DEFAULTS,
    cost=CostFacts(**ARCHITECTURE),  # `jagg plan` on it
    export_pipeline=PIPELINE_CLASS,  # `jagg export` writes LoRA adapters in SanaPipeline's format
    stand_in=save_tiny_sana,  # a model folder for tests (model.path); unset, the model is built from its seed
    check_files=check_folder,
)
def load_tiny_sana(path: str | None, *, device: torch.device, dtype: torch.dtype,
                   options: Mapping[str, Any]) -> TinySanaPolicy:
    """``model.path`` unset: the random model of ``options["seed"]``; else the folder :func:`save_tiny_sana` wrote."""
    opts = check_options(options)  # before any building
    parts = build_parts(opts["seed"]) if path is None else load_parts(path)
    return TinySanaPolicy(parts, opts, device=device, dtype=dtype)
