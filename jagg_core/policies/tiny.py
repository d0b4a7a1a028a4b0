"""Tiny random Flux, SD3, Qwen-Image and Wan pipelines, built in code and saved as diffusers folders: each backbone's
stand-in (its spec's ``stand_in``), which the smoke test (`jagg smoke`, jagg_core/smoke/run.py) and the tests
(tests/test_real_backbones.py, tests/test_wan.py) build.

They have the real component classes and folder layout (model_index.json, one subfolder per component), so the
policies load them through exactly the code path of the released weights; nothing is downloaded. Tokenizers are built
locally: a character-level CLIP BPE, a Unigram T5 over letters, a byte-level Qwen2 BPE without merges.

Flux and Wan come in shapes (:class:`FluxShape`, :class:`WanShape`): the defaults are the tests' (seconds to build
and run), and the smoke test passes its own (up to a 36 M-parameter Flux at 256 px on a GPU). SD3 and Qwen-Image
have the tests' shape only.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path


__all__ = ["FluxShape", "IMAGE_SIZE", "WanShape", "build_flux", "build_qwenimage", "build_sd3",
           "build_wan", "clip_encoder", "clip_tokenizer", "kl_vae", "qwen_tokenizer", "rope_axes", "t5_encoder",
           "t5_tokenizer"]

LETTERS = string.ascii_lowercase
IMAGE_SIZE = 32  # pixels of the tests' images; every tiny VAE maps it to a small latent


# --- tokenizers and text encoders ---------------------------------------------------------------------------------


def clip_tokenizer(max_length: int = 40):
    """Character-level CLIP BPE (no merges: every word becomes its letters, the last one marked ``</w>``)."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in LETTERS:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def t5_tokenizer():
    """A Unigram T5 tokenizer over letters."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + c, -3.0) for c in LETTERS] + [(c, -4.0) for c in LETTERS]
    return T5TokenizerFast(vocab=pieces, extra_ids=0)


def qwen_tokenizer():
    """A byte-level Qwen2 BPE without merges, with Qwen-Image's chat-template specials."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Qwen2Tokenizer(
        vocab=vocab, merges=[], unk_token=None, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.add_special_tokens({"additional_special_tokens": specials})
    return tok


def clip_encoder(vocab_size: int, *, hidden: int, projection: bool, max_positions: int = 40):
    """A 2-layer CLIP text encoder of width ``hidden`` (with its projection for SD3's pooled embedding)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=max_positions,
        projection_dim=hidden,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def t5_encoder(vocab_size: int, *, d_model: int, d_kv: int = 8):
    """A one-layer, two-head T5 encoder of width ``d_model``."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=d_kv, d_ff=2 * d_model, num_layers=1, num_heads=2, dropout_rate=0.0
    )
    return T5EncoderModel(config).eval()


def kl_vae(latent_channels: int, *, shift_factor: float, scaling_factor: float,
           block_out_channels: tuple[int, ...] = (8, 16), sample_size: int = IMAGE_SIZE):
    """An ``AutoencoderKL`` with one block per entry of ``block_out_channels`` (2^(blocks − 1)× downsampling)."""
    from diffusers import AutoencoderKL

    blocks = len(block_out_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=tuple(block_out_channels),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=sample_size,
        shift_factor=shift_factor,
        scaling_factor=scaling_factor,
    ).eval()


# --- Flux ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FluxShape:
    """A FLUX.1-dev-shaped pipeline's sizes; the defaults are the tests' (a 2× VAE, 4 latent channels)."""

    num_layers: int = 1  # double-stream blocks
    num_single_layers: int = 1
    num_attention_heads: int = 2
    attention_head_dim: int = 16  # even, at least 8 (the rotary axes)
    text_hidden_size: int = 32  # T5 width (joint_attention_dim)
    t5_head_dim: int = 8
    pooled_hidden_size: int = 32  # CLIP width (pooled_projection_dim)
    vae_channels: tuple[int, ...] = (8, 16)  # one VAE block each: FLUX.1's 8× is four blocks
    latent_channels: int = 4  # FLUX.1's: 16
    sample_size: int = IMAGE_SIZE  # the VAE's nominal image size


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Rotary axes (index, row, column) summing to ``head_dim``, each even (FLUX.1 splits its 128 as 16, 56, 56)."""
    side = (head_dim * 3 // 8) // 2 * 2
    return (head_dim - 2 * side, side, side)


def build_flux(folder: str | Path, shape: FluxShape = FluxShape(), *, seed: int = 0) -> Path:
    """A FLUX.1-dev-shaped pipeline: CLIP pooled + T5 sequence, 2×2-packed latents, guidance embedding, FLUX.1-dev's
    scheduler config."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                  base_image_seq_len=256, max_image_seq_len=4096),
        vae=kl_vae(shape.latent_channels, shift_factor=0.1159, scaling_factor=0.3611,  # FLUX.1's
                   block_out_channels=shape.vae_channels, sample_size=shape.sample_size),
        text_encoder=clip_encoder(len(tokenizer), hidden=shape.pooled_hidden_size, projection=False),
        tokenizer=tokenizer,
        text_encoder_2=t5_encoder(len(tokenizer_2), d_model=shape.text_hidden_size, d_kv=shape.t5_head_dim),
        tokenizer_2=tokenizer_2,
        transformer=FluxTransformer2DModel(
            patch_size=1, in_channels=4 * shape.latent_channels,  # 2×2 packing
            num_layers=shape.num_layers, num_single_layers=shape.num_single_layers,
            attention_head_dim=shape.attention_head_dim, num_attention_heads=shape.num_attention_heads,
            joint_attention_dim=shape.text_hidden_size, pooled_projection_dim=shape.pooled_hidden_size,
            guidance_embeds=True, axes_dims_rope=rope_axes(shape.attention_head_dim),
        ).eval(),
    )
    folder = Path(folder)
    pipe.save_pretrained(folder)
    return folder


# --- SD3 and Qwen-Image (the tests' shapes) -----------------------------------------------------------------------


def build_sd3(folder: str | Path) -> Path:
    """An SD3.5-shaped pipeline: two CLIPs with projection + T5, 2×2-patch transformer, static shift 3."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(0)
    tokenizer, tokenizer_3 = clip_tokenizer(), t5_tokenizer()
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(
            sample_size=IMAGE_SIZE // 2,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=32,  # the T5 width; the two CLIPs (16 + 16) are padded up to it
            caption_projection_dim=16,
            pooled_projection_dim=32,  # the two CLIP projections, concatenated
            out_channels=4,
            pos_embed_max_size=32,
        ).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=kl_vae(4, shift_factor=0.0609, scaling_factor=1.5305),
        text_encoder=clip_encoder(len(tokenizer), hidden=16, projection=True),
        tokenizer=tokenizer,
        text_encoder_2=clip_encoder(len(tokenizer), hidden=16, projection=True),
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5_encoder(len(tokenizer_3), d_model=32),
        tokenizer_3=tokenizer_3,
    )
    folder = Path(folder)
    pipe.save_pretrained(folder)
    return folder


def build_qwenimage(folder: str | Path) -> Path:
    """A Qwen-Image-shaped pipeline: Qwen2.5-VL text encoder, 3-D causal VAE with latents mean/std, shift_terminal."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    tokenizer = qwen_tokenizer()
    hidden = 16
    text_config = {
        "hidden_size": hidden,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": len(tokenizer),
        "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        "rope_theta": 1e6,
        "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    vision_config = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": hidden}
    config = Qwen2_5_VLConfig(
        text_config=text_config, vision_config=vision_config, vocab_size=len(tokenizer), hidden_size=hidden
    )
    z_dim = 4
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            shift=1.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=0.9,
            base_image_seq_len=256,
            max_image_seq_len=8192,
            shift_terminal=0.02,
            time_shift_type="exponential",
        ),
        vae=AutoencoderKLQwenImage(
            base_dim=z_dim * 6,
            z_dim=z_dim,
            dim_mult=[1, 2, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True],  # vae_scale_factor 4
            latents_mean=[0.1, -0.2, 0.0, 0.3],
            latents_std=[1.5, 0.8, 1.0, 2.0],
        ).eval(),
        text_encoder=Qwen2_5_VLForConditionalGeneration(config).eval(),
        tokenizer=tokenizer,
        transformer=QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * z_dim,
            out_channels=z_dim,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=hidden,
            guidance_embeds=False,
            axes_dims_rope=(8, 4, 4),
        ).eval(),
    )
    folder = Path(folder)
    pipe.save_pretrained(folder)
    return folder


# --- Wan ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WanShape:
    """A Wan2.1-T2V-shaped pipeline's sizes. The defaults are the tests' (5 frames of 16 px: a VAE ×2 in time and
    space, with latents mean/std); the released model's VAE is ×4 in time, ×8 in space, 16 latent channels."""

    num_layers: int = 2  # WanTransformerBlocks
    num_attention_heads: int = 2
    attention_head_dim: int = 8
    ffn_dim: int = 32
    freq_dim: int = 16
    rope_max_seq_len: int = 32
    text_dim: int = 16  # UMT5 width
    text_head_dim: int = 8
    text_heads: int = 2
    text_buckets: int = 8  # UMT5's relative-attention buckets
    z_dim: int = 4  # latent channels
    vae_base_dim: int = 8
    vae_dim_mult: tuple[int, ...] = (1, 2)
    temporal_downsample: tuple[bool, ...] = (True,)
    scale_factor_temporal: int = 2
    scale_factor_spatial: int = 2
    latents_mean: tuple[float, ...] | None = (0.1, -0.2, 0.0, 0.3)  # None: the VAE's default (z_dim 16)
    latents_std: tuple[float, ...] | None = (1.5, 0.8, 1.0, 2.0)


# The tests' clips: 5 frames (3 latent frames: their VAE halves time after the first frame) of 16×16 px.
WAN_FRAMES, WAN_SIZE = 5, 16


def build_wan(folder: str | Path, shape: WanShape = WanShape(), *, seed: int = 0) -> Path:
    """A Wan2.1-T2V-shaped pipeline: UMT5 text encoder, a causal 3-D VAE, a WanTransformer3DModel with 1×2×2 patches,
    and the UniPC flow scheduler Wan ships with."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tokenizer = t5_tokenizer()
    d = shape.text_dim
    text = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=d, d_kv=shape.text_head_dim, d_ff=2 * d,
                                       num_layers=1, num_heads=shape.text_heads, dropout_rate=0.0,
                                       relative_attention_num_buckets=shape.text_buckets)).eval()
    stats = {k: list(v) for k, v in (("latents_mean", shape.latents_mean), ("latents_std", shape.latents_std))
             if v is not None}
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text,
        vae=AutoencoderKLWan(base_dim=shape.vae_base_dim, z_dim=shape.z_dim, dim_mult=list(shape.vae_dim_mult),
                             num_res_blocks=1, temperal_downsample=list(shape.temporal_downsample),
                             scale_factor_temporal=shape.scale_factor_temporal,
                             scale_factor_spatial=shape.scale_factor_spatial, **stats).eval(),
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
        transformer=WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=shape.num_attention_heads,
                                          attention_head_dim=shape.attention_head_dim, in_channels=shape.z_dim,
                                          out_channels=shape.z_dim, text_dim=d, freq_dim=shape.freq_dim,
                                          ffn_dim=shape.ffn_dim, num_layers=shape.num_layers,
                                          rope_max_seq_len=shape.rope_max_seq_len).eval(),
    )
    folder = Path(folder)
    pipe.save_pretrained(folder)
    return folder
