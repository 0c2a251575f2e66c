"""Seeded random checkpoints of every architecture the parity suites check (ARCHITECTURES below, the GPU
suite's 8B-shaped Llama and a 180B DeepSeek-V3 shape among them; VISION_LANGUAGE_SHAPES, a Qwen2.5-VL-7B shape for
the bench's image chats), with the embedded model's tokenizer.

Everything is generated from fixed seeds, so two machines build the same files; nothing is downloaded.
`build_model` writes them in bf16/fp32, or block-quantized to FP8 as DeepSeek-V3 and the Qwen3 "-FP8"
releases ship, or with MXFP4 experts as GPT-OSS ships.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import load_file, save_file

from offline_extract.default_model import ensure_tiny_model, random_checkpoint, tiny_llama_config
from offline_extract.engine.checkpoint import CHECKPOINT_INDEX, E2M1_MAGNITUDES, MXFP4_BLOCK
from offline_extract.engine.families import FAMILIES, Family


def _tiny_qwen3_config(vocab_size: int) -> dict:
    # Head dim 64, unlike the tiny Llama's 16: the GPU suite runs these on FlashInfer, whose prefill kernels
    # exist for 64, 128 and 256 only.
    return {
        **tiny_llama_config(vocab_size),
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
    }


def _tiny_qwen2_config(vocab_size: int) -> dict:
    # Qwen2/Qwen2.5: biased q/k/v projections, no q/k norms, head dim from hidden / heads; the sliding
    # window that the config format carries is off, as in every released Qwen2.5 checkpoint.
    config = {
        **_tiny_qwen3_config(vocab_size),
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "use_sliding_window": False,
        "sliding_window": None,
    }
    del config["head_dim"]
    return config


def _tiny_mistral_config(vocab_size: int) -> dict:
    # Mistral 7B v0.3 / Mistral-Small shape: a Llama decoder under its own class, no sliding window.
    return {
        **_tiny_qwen3_config(vocab_size),
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
    }


def _tiny_qwen3_moe_config(vocab_size: int) -> dict:
    # Every layer sparse, as in Qwen3-30B-A3B; 8 experts so that top-2 routing leaves most of them unused.
    return {
        **_tiny_qwen3_config(vocab_size),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "output_router_logits": False,
    }


def _tiny_glm4_moe_config(vocab_size: int) -> dict:
    # GLM-4.5: biased q/k/v, q/k norms, RoPE on half of each head, a dense first layer, then sigmoid routing
    # with the correction bias, a shared expert and the routed scaling factor, in one expert group.
    return {
        **_tiny_qwen3_config(vocab_size),
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": True,
        "first_k_dense_replace": 1,
        "moe_intermediate_size": 128,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
    }


def _tiny_gpt_oss_config(vocab_size: int) -> dict:
    # GPT-OSS: attention sinks, sliding-window layers (a 16-token window, so the test's longer requests
    # cross it) alternating with full ones, YaRN RoPE, biased attention and experts with the clamped SwiGLU,
    # written as the released config.json writes them.
    return {
        **_tiny_qwen3_config(vocab_size),
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "intermediate_size": 128,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 4,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "initial_context_length": 4096,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    }


def _tiny_llama4_text_config(vocab_size: int) -> dict:
    # Llama 4's decoder: dense layers alternating with top-1 sigmoid-routed experts plus a shared expert
    # (Maverick's interleave), QK L2 norm on RoPE layers, every 4th layer without RoPE and with attention
    # temperature tuning, RoPE layers attending in chunks, Llama-3 RoPE scaling. Chunk size and temperature
    # floor are 16 tokens, so the test's longer requests cross both.
    return {
        **_tiny_qwen3_config(vocab_size),
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "intermediate_size": 128,
        "intermediate_size_mlp": 512,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "use_qk_norm": True,
        "no_rope_layer_interval": 4,
        "attention_chunk_size": 16,
        "attn_temperature_tuning": True,
        "floor_scale": 16,
        "attn_scale": 0.1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }


def _tiny_qwen3_next_config(vocab_size: int) -> dict:
    # Qwen3-Next: Gated DeltaNet linear attention in three of every four layers, gated full attention with
    # partial RoPE in the fourth, every layer sparse with a gated shared expert.
    return {
        **_tiny_qwen3_moe_config(vocab_size),
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
        "full_attention_interval": 4,
        "partial_rotary_factor": 0.25,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "shared_expert_intermediate_size": 128,
    }


def _tiny_minimax_m2_config(vocab_size: int) -> dict:
    # MiniMax-M2: RoPE on half of each head, RMS norms over all heads' q and k together, every layer sparse
    # with sigmoid routing and the correction bias, no shared expert; written as the released config.json
    # writes it.
    return {
        **_tiny_qwen3_config(vocab_size),
        "architectures": ["MiniMaxM2ForCausalLM"],
        "model_type": "minimax_m2",
        "intermediate_size": 128,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rotary_dim": 32,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "rope_theta": 5000000.0,
    }


def _tiny_qwen2_moe_config(vocab_size: int) -> dict:
    # Qwen1.5/Qwen2-MoE: Qwen2's biased attention, every layer sparse with unnormalized top-k weights and a
    # shared expert behind its own sigmoid gate.
    return {
        **_tiny_qwen2_config(vocab_size),
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 256,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": False,
        "output_router_logits": False,
    }


def _tiny_deepseek_v3_config(vocab_size: int) -> dict:
    # MLA with both LoRA ranks, interleaved RoPE under YaRN (whose mscale changes the softmax scale), grouped
    # sigmoid routing with the correction bias, shared experts, and dense first layers: every DeepSeek-V3
    # path that a ported checkpoint exercises, at toy width. The attention head dims are DeepSeek-V3's own,
    # the only ones GPU MLA kernels are built for.
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 8,
        "first_k_dense_replace": 2,
        "moe_layer_freq": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 192,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "hidden_act": "silu",
        "max_position_embeddings": 16384,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 1,
        "torch_dtype": "float32",
    }


def _deepseek_v3_180b_config(_vocab_size: int) -> dict:
    # DeepSeek-V3's own layer shapes (61 layers, 3 dense, MLA, hidden 7168) with 64 routed experts instead
    # of 256: about 180B parameters, 361 GB in bf16. Too big for two H200s, it needs TP=4 (TP=4 x DP=2 on
    # a node) or TP=8, which is what the multi-GPU runs are for. Meant for SGLang's dummy loader only.
    return {
        **_tiny_deepseek_v3_config(129280),
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "n_routed_experts": 64,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 163840,
        "rope_scaling": {**_tiny_deepseek_v3_config(0)["rope_scaling"], "factor": 40.0},
        "torch_dtype": "bfloat16",
    }


def _tiny_kimi_k2_config(vocab_size: int) -> dict:
    # Kimi-K2 runs on the same DeepSeek-V3 classes; what takes a different path is its routing: a single
    # expert group (n_group = topk_group = 1) and one dense first layer.
    return {
        **_tiny_deepseek_v3_config(vocab_size),
        "first_k_dense_replace": 1,
        "n_routed_experts": 12,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,
    }


def _llama3_8b_config(_vocab_size: int) -> dict:
    # Llama-3's own vocabulary size, which only sizes the embedding: the tiny tokenizer's ids all fit in it.
    return {
        **tiny_llama_config(128256),
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
    }


# Architecture name -> config builder taking the tokenizer's vocab size. Tiny ones have 8 layers so that
# SGLang's default EAGLE-3 ids [1, N/2-1, N-4] are distinct and inside the model.
ARCHITECTURES = {
    "llama": tiny_llama_config,
    "qwen3": _tiny_qwen3_config,
    "qwen3_moe": _tiny_qwen3_moe_config,
    "qwen2": _tiny_qwen2_config,
    "mistral": _tiny_mistral_config,
    "glm4_moe": _tiny_glm4_moe_config,
    "gpt_oss": _tiny_gpt_oss_config,
    "llama4_text": _tiny_llama4_text_config,
    "qwen3_next": _tiny_qwen3_next_config,
    "minimax_m2": _tiny_minimax_m2_config,
    "qwen2_moe": _tiny_qwen2_moe_config,
    "deepseek_v3": _tiny_deepseek_v3_config,
    "kimi_k2": _tiny_kimi_k2_config,
    "llama3_8b": _llama3_8b_config,
    "deepseek_v3_180b": _deepseek_v3_180b_config,
}


def _kimi_k25_config(text_config: dict) -> dict:
    # The wrapper SGLang serves Kimi-K2.5 with: a DeepSeek-V3 text model plus a MoonViT tower and projector,
    # here at toy size. Only the fields SGLang's kimi_k25.py reads are set; the tower gets no weights.
    vision = {
        "patch_size": 14,
        "init_pos_emb_height": 8,
        "init_pos_emb_width": 8,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "vt_hidden_size": 32,
        "mm_hidden_size": 32,
        "text_hidden_size": text_config["hidden_size"],
    }
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text_config,
        "vision_config": vision,
        "media_placeholder_token_id": text_config["vocab_size"] - 1,
        **{k: text_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype")},
    }


def _under_language_model(wrapper_config):
    def wrap(model_dir: Path) -> None:
        """Turn a written text-model checkpoint into its multimodal wrapper's layout: the same weights under
        `language_model.`, and no vision weights, which SGLang's loaders do not require."""
        text_config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps(wrapper_config(text_config), indent=2))
        path = model_dir / "model.safetensors"
        if path.exists():  # absent when only the config was written
            tensors = {f"language_model.{k}": v for k, v in load_file(path).items()}
            save_file(tensors, str(path), metadata={"format": "pt"})

    return wrap


# A multimodal wrapper HF transformers cannot build at all, as (the text model holding the weights, wrapper).
_WRAPPED = {
    "kimi_k25": ("kimi_k2", _under_language_model(_kimi_k25_config)),
}


# Qwen's vision special tokens, which its processors write into the text and SGLang's qwen_vl.py reads back,
# added to the embedded tokenizer after its own tokens.
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _vl_chat_template(image: str) -> str:
    """The embedded chat template (default_model.CHAT_TEMPLATE), with a message's content either a string or
    OpenAI-style parts, an image part rendered as `image`, the placeholder the processor widens to the image's
    tokens."""
    return (
        "{{ bos_token }}"
        "{% for m in messages %}"
        "{{ '<|' + m['role'] + '|>' }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
        "{% if part['type'] in ('image', 'image_url') %}{{ '" + image + "' }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|end|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
    )


# As Qwen's templates render an image: one image pad between the vision markers.
VL_CHAT_TEMPLATE = _vl_chat_template("<|vision_start|><|image_pad|><|vision_end|>")

# Images the tiny processors keep at their own size from 28 x 28 up to 16 merged 28 x 28 blocks: a 28 x 56
# image is 8 patches, 2 image tokens.
_TINY_IMAGE_SIZE = {"shortest_edge": 28 * 28, "longest_edge": 16 * 28 * 28}
# Qwen3-VL's 16-pixel patches merge into 32-pixel blocks, to which the same images are resized: a 28 x 56
# image becomes 32 x 64, 8 patches, 2 image tokens, as with Qwen2.5-VL.
_TINY_IMAGE_SIZE_16 = {"shortest_edge": 32 * 32, "longest_edge": 16 * 32 * 32}


def _qwen2_5_vl_config(vocab_size: int, tokens: dict[str, int]) -> dict:
    # Qwen2.5-VL as released: the Qwen2 decoder's fields at the top level, M-RoPE over (time, height, width)
    # sections of the head's 32 frequencies, and a two-block vision tower whose second block attends to the
    # whole image and whose first within 56-pixel windows, merged 2 x 2 into the decoder's width.
    text = _tiny_qwen2_config(vocab_size)
    return {
        **text,
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
        "vision_start_token_id": tokens["<|vision_start|>"],
        "vision_end_token_id": tokens["<|vision_end|>"],
        "image_token_id": tokens["<|image_pad|>"],
        "video_token_id": tokens["<|video_pad|>"],
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "hidden_act": "silu",
            "tokens_per_second": 2,
            "out_hidden_size": text["hidden_size"],
        },
    }


def _qwen2_5_vl_7b_config(_vocab_size: int, tokens: dict[str, int]) -> dict:
    # Qwen2.5-VL-7B-Instruct's shapes, for SGLang's dummy loader (the bench's image chats): its Qwen2 decoder
    # (28 layers of 3584, 28 query heads on 4 KV heads), its M-RoPE sections and its 32-block vision tower of
    # 1280, windowed but for every eighth block; its own vocabulary size, which only sizes the embedding.
    tiny = _qwen2_5_vl_config(152064, tokens)
    return {
        **tiny,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 128000,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {
            **tiny["vision_config"],
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "out_hidden_size": 3584,
        },
    }


# The released Qwen2.5-VL processor's resize bounds: 4 to 16384 image tokens of 28 x 28 pixels.
_QWEN2_5_VL_IMAGE_SIZE = {"shortest_edge": 4 * 28 * 28, "longest_edge": 16384 * 28 * 28}


def _qwen2_5_vl_processor(tokenizer, size: dict[str, int] = _TINY_IMAGE_SIZE):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    shape = dict(size=size, patch_size=14, merge_size=2, temporal_patch_size=2)
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**shape),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**shape),
        chat_template=VL_CHAT_TEMPLATE,
    )


def _qwen3_vl_config(vocab_size: int, tokens: dict[str, int]) -> dict:
    # Qwen3-VL as released: the Qwen3 decoder under text_config, its M-RoPE sections interleaved over the
    # head's 32 frequencies, and a two-block vision tower of 16-pixel patches merged 2 x 2, whose DeepStack
    # features of both blocks are added to the image tokens' states after decoder layers 0 and 1.
    text = _tiny_qwen3_config(vocab_size)
    del text["architectures"]
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "tie_word_embeddings": False,
        "text_config": {
            **text,
            "model_type": "qwen3_vl_text",
            "rope_scaling": {"rope_type": "default", "mrope_section": [12, 10, 10], "mrope_interleaved": True},
        },
        "vision_start_token_id": tokens["<|vision_start|>"],
        "vision_end_token_id": tokens["<|vision_end|>"],
        "image_token_id": tokens["<|image_pad|>"],
        "video_token_id": tokens["<|video_pad|>"],
        "vision_config": {
            "model_type": "qwen3_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "hidden_act": "gelu_pytorch_tanh",
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1],
            "out_hidden_size": text["hidden_size"],
        },
    }


def _qwen3_vl_processor(tokenizer):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    shape = dict(size=_TINY_IMAGE_SIZE_16, patch_size=16, merge_size=2, temporal_patch_size=2)
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**shape),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**shape),
        chat_template=VL_CHAT_TEMPLATE,
    )


# Llama 4's image tokens, which its processor writes around each image's patches: the image's markers, the
# global tile's marker (also the chat template's placeholder), the patch token the tower's embeddings replace,
# and the separators between tiles.
_LLAMA4_VISION_TOKENS = (
    "<|image_start|>",
    "<|image_end|>",
    "<|image|>",
    "<|patch|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
)
# Tiles of 28 pixels, 4 x 4 patches of 7, pixel-shuffled 2 x 2 into 4 image tokens; at most 4 tiles an image, and
# the whole image as a global tile beside them when there are several: a 28 x 56 image is tiled 1 x 2, so 3 tiles,
# 12 tokens; a 28 x 28 one is 1 tile, 4 tokens.
_LLAMA4_TILE, _LLAMA4_PATCH = 28, 7


def _llama4_config(vocab_size: int, tokens: dict[str, int]) -> dict:
    # Llama4ForConditionalGeneration as Llama 4 Scout and Maverick ship it: the text model under text_config and
    # a one-block vision encoder whose pixel-shuffled patches (4 x its width) the adapter and the projector map
    # into the decoder's width.
    text = _tiny_llama4_text_config(vocab_size)
    vision = {
        "hidden_size": 32,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": _LLAMA4_TILE,
        "patch_size": _LLAMA4_PATCH,
        "pixel_shuffle_ratio": 0.5,
        "vision_output_dim": 64,
        "projector_input_dim": 64,
        "projector_output_dim": 64,
    }
    return {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": text,
        "vision_config": vision,
        "boi_token_index": tokens["<|image_start|>"],
        "eoi_token_index": tokens["<|image_end|>"],
        "image_token_index": tokens["<|patch|>"],
    }


def _llama4_processor(tokenizer):
    from transformers import Llama4ImageProcessor, Llama4Processor

    return Llama4Processor(
        image_processor=Llama4ImageProcessor(size={"height": _LLAMA4_TILE, "width": _LLAMA4_TILE}, max_patches=4),
        tokenizer=tokenizer,
        patch_size=_LLAMA4_PATCH,
        pixel_shuffle_ratio=0.5,
        chat_template=_vl_chat_template("<|image|>"),
    )


def towers(families: Iterable[Family]) -> dict[str, tuple]:
    """The vision-language models among `families`, those whose images are extracted (`Family.images`), with their
    towers, as (config builder taking the vocab size and the vision tokens' ids, the vision tokens, the HF processor
    built on the tokenizer): a family's builders are `_{name}_config` and `_{name}_processor` here, and its vision
    tokens `_{NAME}_VISION_TOKENS`, by default Qwen's, which VL_CHAT_TEMPLATE writes. Written with the processor's
    files, so that the model's own AutoProcessor renders and prepares image chats offline."""
    builders = globals()
    return {
        f.name: (
            builders[f"_{f.name}_config"],
            builders.get(f"_{f.name.upper()}_VISION_TOKENS", QWEN_VISION_TOKENS),
            builders[f"_{f.name}_processor"],
        )
        for f in families
        if f.images
    }


VISION_LANGUAGE = towers(FAMILIES)
# Release-sized shapes of vision-language families, for SGLang's dummy loader (the bench's image chats), as
# VISION_LANGUAGE's entries are; not a family of their own, so no suite runs them.
VISION_LANGUAGE_SHAPES = {
    "qwen2_5_vl_7b": (
        _qwen2_5_vl_7b_config,
        QWEN_VISION_TOKENS,
        functools.partial(_qwen2_5_vl_processor, size=_QWEN2_5_VL_IMAGE_SIZE),
    ),
}
_TOWERS = {**VISION_LANGUAGE, **VISION_LANGUAGE_SHAPES}


def build_model(
    arch: str,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    overrides: dict | None = None,
    seed: int = 0,
    tokenizer_dir: str | os.PathLike | None = None,
    weights: bool = True,
    fp8: bool = False,
    mxfp4: bool = False,
) -> Path:
    """Write a seeded random model of `arch` with the embedded tokenizer (from `tokenizer_dir` if given,
    else the cached embedded model).

    `arch` is a key of ARCHITECTURES, of VISION_LANGUAGE or VISION_LANGUAGE_SHAPES (with the tokenizer's vision tokens and the HF
    processor's files), or of _WRAPPED: "kimi_k25" holds exactly the weights of "kimi_k2" under
    the same seed, wrapped as Kimi-K2.5, so that "kimi_k2" built alongside is its HF reference. `device` is where
    the weights are drawn (a GPU makes the 8B-shaped model quick); `overrides` replace top-level config fields
    (of the text config, for a wrapped architecture). weights=False writes the config alone, for SGLang's
    dummy loader. fp8=True then quantizes the checkpoint as the FP8 releases are (`quantize_fp8_checkpoint`),
    mxfp4=True its experts as the GPT-OSS releases are (`quantize_mxfp4_checkpoint`).
    """
    base, wrap = _WRAPPED.get(arch, (arch, None))
    if base not in ARCHITECTURES and arch not in _TOWERS:
        raise ValueError(
            f"unknown architecture {arch!r}; choose from {', '.join([*ARCHITECTURES, *_WRAPPED, *_TOWERS])}"
        )
    tiny = Path(tokenizer_dir) if tokenizer_dir else ensure_tiny_model()
    tiny_config = json.loads((tiny / "config.json").read_text())
    config, processor = _config_and_processor(arch, base, tiny, tiny_config["vocab_size"])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config[key] = tiny_config[key]
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config.update(overrides or {})
    if weights:
        out = random_checkpoint(config, out_dir, seed=seed, dtype=dtype, device=device)
        if fp8:
            quantize_fp8_checkpoint(out)
        if mxfp4:
            quantize_mxfp4_checkpoint(out)
        if arch in _INDEXED:
            _write_index(out)
    else:  # for SGLang's dummy loader, which draws its own random weights
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    if wrap is not None:
        wrap(out)
    # The tokenizer states the model's context, as a release's does, not the embedded model's (a nested text
    # config's, for Qwen3-VL).
    _write_tokenizer(out, tiny, processor, config.get("text_config", config)["max_position_embeddings"])
    return out


# SGLang's mllama4.py builds Llama 4's vision tower only where the checkpoint's index names vision weights
# (_has_vision_weights), as the sharded releases' indexes do; a one-file checkpoint has none unless written.
_INDEXED = {"llama4"}


def _write_index(out: Path) -> None:
    """model.safetensors.index.json naming every tensor of a one-file checkpoint, as a sharded release's does."""
    if (out / CHECKPOINT_INDEX).exists():
        return
    names = load_file(out / "model.safetensors").keys()
    (out / CHECKPOINT_INDEX).write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")})
    )


def _config_and_processor(arch: str, base: str, tiny: Path, vocab_size: int):
    """(config.json's fields, the HF processor or None) of `arch`; a vision-language model's tokenizer is
    the tiny one with its vision tokens added."""
    if arch not in _TOWERS:
        return ARCHITECTURES[base](vocab_size), None
    from transformers import AutoTokenizer

    vl_config, vision_tokens, make_processor = _TOWERS[arch]
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tokenizer.add_tokens(list(vision_tokens), special_tokens=True)
    processor = make_processor(tokenizer)
    tokenizer.chat_template = processor.chat_template
    return vl_config(len(tokenizer), {t: tokenizer.convert_tokens_to_ids(t) for t in vision_tokens}), processor


def _write_tokenizer(out: Path, tiny: Path, processor, context: int) -> None:
    """The tokenizer's files (the processor's, where there is one) beside the model in `out`, stating the
    model's `context`."""
    if processor is not None:
        processor.save_pretrained(out)
    else:
        for f in tiny.iterdir():
            if f.name != "config.json" and not f.name.endswith(".safetensors"):
                shutil.copy2(f, out / f.name)
    tokenizer_config = out / "tokenizer_config.json"
    tokenizer_config.write_text(
        json.dumps({**json.loads(tokenizer_config.read_text()), "model_max_length": context}, indent=2)
    )


# The FP8 releases (DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8): e4m3 weights with one float32 scale per
# 128x128 block, stored as `<name>_scale_inv` (multiplying by it dequantizes), activations quantized at run
# time. This is DeepSeek-V3's quantization_config verbatim.
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def _is_fp8_quantized(name: str, shape) -> bool:
    # What those releases quantize: every projection of attention, MLP, shared and routed experts. Embeddings,
    # lm_head, norms, routers (`mlp.gate`) and the correction bias keep the checkpoint's dtype.
    return len(shape) == 2 and ".layers." in f".{name}" and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale_inv per block): each block scaled so that its largest value maps to e4m3's
    largest; a partial block at the edge gets its own scale, as in the releases (576 = 4.5 x 128 rows)."""
    n, k = weight.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    quantized = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(rows * bn, cols * bk)
    return quantized[:n, :k].contiguous(), scale


def quantize_fp8_checkpoint(model_dir: str | os.PathLike, quantization_config: dict = FP8_QUANTIZATION_CONFIG) -> None:
    """Rewrite a written checkpoint in place as an FP8 block-quantized release: the quantized weights and their
    `weight_scale_inv` in the same files, and `quantization_config` in config.json."""
    model_dir = Path(model_dir)
    block = tuple(quantization_config["weight_block_size"])
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = {}
        for name, t in load_file(path).items():
            if _is_fp8_quantized(name, t.shape):
                tensors[name], tensors[f"{name}_scale_inv"] = quantize_fp8_blocks(t, block)
                if index is not None:
                    index["weight_map"][f"{name}_scale_inv"] = path.name
            else:
                tensors[name] = t
        save_file(tensors, str(path), metadata={"format": "pt"})
    if index is not None:
        index_path.write_text(json.dumps(index))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}, indent=2))


# GPT-OSS as OpenAI releases it (gpt-oss-20b, -120b): the experts' projections in MXFP4, everything else in
# bf16. This is their quantization_config verbatim.
MXFP4_QUANTIZATION_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
_MXFP4_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8), the inverse of
    `checkpoint.dequantize_mxfp4` up to e2m1 rounding: each 32 values share the smallest power-of-two scale that
    brings their largest magnitude within e2m1's largest (6), so nothing clips, and each value rounds to the
    nearest e2m1 value, two codes a byte, the lower nibble first."""
    groups = weight.float().unflatten(-1, (-1, MXFP4_BLOCK))
    largest = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(largest / E2M1_MAGNITUDES[-1])).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(E2M1_MAGNITUDES)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1) + 8 * (scaled < 0)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8), (exponent + 127).to(torch.uint8)


def quantize_mxfp4_checkpoint(model_dir: str | os.PathLike) -> None:
    """Rewrite a written GPT-OSS checkpoint in place as released: each expert projection, held by HF as
    [experts, in, out], stored as `<name>_blocks` [experts, out, in/32, 16] and `<name>_scales`
    [experts, out, in/32] (gate and up rows interleaved, as HF's fused layout has them), its bias and every other
    tensor kept; and `quantization_config` in config.json."""
    model_dir = Path(model_dir)
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = {}
        for name, t in load_file(path).items():
            if not name.endswith(_MXFP4_EXPERTS):
                tensors[name] = t
                continue
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize_mxfp4(t.transpose(1, 2))
            if index is not None:
                del index["weight_map"][name]
                index["weight_map"].update({f"{name}_blocks": path.name, f"{name}_scales": path.name})
        save_file(tensors, str(path), metadata={"format": "pt"})
    if index is not None:
        index_path.write_text(json.dumps(index))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(
        json.dumps({**config, "quantization_config": MXFP4_QUANTIZATION_CONFIG}, indent=2)
    )
