"""Tiny random Flux, SD3, Qwen-Image and Wan pipelines, built in code and saved as diffusers folders.

They have the real component classes and folder layout (model_index.json, one subfolder per component), so the
policies load them through exactly the code path of the released weights. Tokenizers are built locally (no hub):
character-level CLIP BPE, a Unigram T5 over letters, a byte-level Qwen2 BPE without merges.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

from tasks.gpu_smoke import clip_tokenizer, t5_tokenizer  # noqa: F401  (the smoke test's tiny Flux uses them too)

LETTERS = string.ascii_lowercase
IMAGE_SIZE = 32  # pixels; every tiny VAE maps it to a small latent


def empty_clip_tokenizer():
    """What offline transformers returns for a CLIP tokenizer it could not find: two tokens, every word unknown."""
    from transformers import CLIPTokenizer

    return CLIPTokenizer(vocab={"<|startoftext|>": 0, "<|endoftext|>": 1}, merges=[])


def empty_t5_tokenizer():
    """What offline transformers returns for a T5 tokenizer it could not find: only "▁" and the 100 extra ids."""
    from transformers import T5TokenizerFast

    return T5TokenizerFast(vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)], extra_ids=100)


def qwen_tokenizer():
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


def t5_encoder(vocab_size: int, *, d_model: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=1, num_heads=2, dropout_rate=0.0
    )
    return T5EncoderModel(config).eval()


def kl_vae(latent_channels: int, *, shift_factor: float, scaling_factor: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),  # vae_scale_factor 2
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=IMAGE_SIZE,
        shift_factor=shift_factor,
        scaling_factor=scaling_factor,
    ).eval()


def build_flux(folder: Path) -> Path:
    """A FLUX.1-dev-shaped pipeline: CLIP pooled + T5 sequence, packed 4-channel latents, guidance embedding."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        ),
        vae=kl_vae(4, shift_factor=0.1159, scaling_factor=0.3611),
        text_encoder=clip_encoder(len(tokenizer), hidden=32, projection=False),
        tokenizer=tokenizer,
        text_encoder_2=t5_encoder(len(tokenizer_2), d_model=32),
        tokenizer_2=tokenizer_2,
        transformer=FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        ).eval(),
    )
    pipe.save_pretrained(folder)
    return folder


def build_sd3(folder: Path) -> Path:
    """An SD3.5-shaped pipeline: two CLIPs with projection + T5, 2×2-patch transformer, static shift 3."""
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
    pipe.save_pretrained(folder)
    return folder


def build_qwenimage(folder: Path) -> Path:
    """A Qwen-Image-shaped pipeline: Qwen2.5-VL text encoder, 3-D causal VAE with latents mean/std, shift_terminal."""
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
    pipe.save_pretrained(folder)
    return folder


# The tiny Wan's clips: 5 frames (3 latent frames: its VAE halves time after the first frame) of 16×16 px.
WAN_FRAMES, WAN_SIZE = 5, 16


def build_wan(folder: Path) -> Path:
    """A Wan2.1-T2V-shaped pipeline: UMT5 text encoder, a causal 3-D VAE (×2 in time and space here, with latents
    mean/std), a 2-block WanTransformer3DModel with 1×2×2 patches, and the UniPC flow scheduler Wan ships with."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    tokenizer = t5_tokenizer()
    text = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                       num_heads=2, dropout_rate=0.0, relative_attention_num_buckets=8)).eval()
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text,
        vae=AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                             latents_mean=[0.1, -0.2, 0.0, 0.3], latents_std=[1.5, 0.8, 1.0, 2.0],
                             scale_factor_temporal=2, scale_factor_spatial=2).eval(),
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
        transformer=WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                          in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                                          num_layers=2, rope_max_seq_len=32).eval(),
    )
    pipe.save_pretrained(folder)
    return folder


BUILDERS = {"flux": build_flux, "sd3": build_sd3, "qwenimage": build_qwenimage, "wan": build_wan}
