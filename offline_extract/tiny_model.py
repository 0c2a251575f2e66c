"""The embedded default model: a tiny random Llama with a locally trained tokenizer and chat template.

Everything here is generated from fixed seeds, so two machines build the same files; nothing is
downloaded. `build_model` writes, with the same tokenizer, every other architecture the parity suites
check (ARCHITECTURES below, the GPU suite's 8B-shaped Llama among them).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TINY_VERSION = "1"

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# Llama-3 shaped: a header per turn, content, then an end-of-turn token with nothing after it, so the
# assistant span that the loss mask covers ends exactly at <|end|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' }}\n{{ m['content'] }}{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)

TRAINING_TEXT = """
The quick brown fox jumps over the lazy dog. A drafter model learns to predict the next tokens of a
larger target model from its hidden states. Speculative decoding proposes several tokens at once and
the target model verifies them in a single forward pass. Hidden states are vectors of floating point
numbers, one per token and layer. What is the capital of France? The capital of France is Paris.
How many legs does a spider have? A spider has eight legs. Write a short poem about the sea.
The sea is wide and deep and blue, it sings at night and shines at noon. Please explain recursion.
Recursion is when a function calls itself on a smaller part of the problem until it reaches a base case.
Can you help me with my homework? Of course, tell me what the question is and we will solve it together.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.718. Code: def add(a, b): return a + b
for i in range(10): print(i) if x > 0: y = x * 2 else: y = -x. JSON: {"name": "value", "list": [1, 2]}.
Thank you! You are welcome. Hello, how are you today? I am fine, thanks for asking. Goodbye.
"""


def _train_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in TRAINING_TEXT.splitlines() if line.strip()]
    tok.train_from_iterator(lines * 4, trainer)
    bos = tok.token_to_id("<|bos|>")
    # trim_offsets=False keeps character offsets exact, which the loss mask relies on.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", bos)]),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|eos|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def tiny_llama_config(vocab_size: int) -> dict:
    # 8 layers so that SGLang's default EAGLE-3 ids [1, N/2-1, N-4] = [1, 3, 4] are distinct.
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 1,
        "torch_dtype": "float32",
    }


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


def _wrap_as_kimi_k25(model_dir: Path) -> None:
    """Turn a written DeepSeek-V3 checkpoint into the Kimi-K2.5 layout: the same weights under
    `language_model.`, and no vision weights, which SGLang's loader does not require."""
    text_config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(_kimi_k25_config(text_config), indent=2))
    path = model_dir / "model.safetensors"
    if path.exists():  # absent when only the config was written
        save_file({f"language_model.{k}": v for k, v in load_file(path).items()}, str(path), metadata={"format": "pt"})


# Architectures HF transformers cannot build itself, as (the HF-buildable one holding the weights, wrapper).
_WRAPPED = {"kimi_k25": ("kimi_k2", _wrap_as_kimi_k25)}


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
) -> Path:
    """Write a seeded random model of `arch` with the embedded tokenizer (from `tokenizer_dir` if given,
    else the cached embedded model).

    `arch` is a key of ARCHITECTURES, or "kimi_k25": exactly the weights of "kimi_k2" under the same seed,
    wrapped as Kimi-K2.5, so that "kimi_k2" built alongside is its HF reference. `device` is where the
    weights are drawn (a GPU makes the 8B-shaped model quick); `overrides` replace top-level config fields
    (of the text config, for a wrapped architecture). weights=False writes the config alone, for SGLang's
    dummy loader.
    """
    base, wrap = _WRAPPED.get(arch, (arch, None))
    if base not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join([*ARCHITECTURES, *_WRAPPED])}")
    tiny = Path(tokenizer_dir) if tokenizer_dir else ensure_tiny_model()
    tiny_config = json.loads((tiny / "config.json").read_text())
    config = ARCHITECTURES[base](tiny_config["vocab_size"])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config[key] = tiny_config[key]
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config.update(overrides or {})
    if weights:
        out = random_checkpoint(config, out_dir, seed=seed, dtype=dtype, device=device)
    else:  # for SGLang's dummy loader, which draws its own random weights
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    if wrap is not None:
        wrap(out)
    for f in tiny.iterdir():
        if f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)
    return out


def _random_tensor(name: str, shape, gen: torch.Generator, dtype, device) -> torch.Tensor:
    """Weights that keep activations O(1) through the stack, so a 1e-5 tolerance means something.

    HF's default init (std 0.02) would shrink every state towards zero and make any comparison pass.
    """
    if name.endswith("norm.weight") or "layernorm" in name:
        return (1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)).to(dtype)
    if name.endswith(".sinks"):  # attention-sink logits (GPT-OSS): O(1), so they take a real share of each softmax
        return torch.randn(shape, generator=gen, device=device).to(dtype)
    if name.endswith(".bias") or len(shape) == 1:
        return (0.02 * torch.randn(shape, generator=gen, device=device)).to(dtype)
    std = 1.0 if "embed" in name else 1.0 / math.sqrt(shape[-1])
    return (std * torch.randn(shape, generator=gen, device=device)).to(dtype)


def random_checkpoint(
    config: dict,
    out_dir: str | os.PathLike,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    max_file_bytes: int = 4 << 30,
) -> Path:
    """Write config.json and seeded random weights for any HF causal-LM config, in the layout HF saves.

    Parameter names and shapes come from instantiating the HF model on the meta device, so the same
    function serves every architecture transformers knows.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    hf_config = AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(hf_config)
    shapes = {k: tuple(v.shape) for k, v in meta_model.state_dict().items()}

    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {name: _random_tensor(name, shape, gen, dtype, device).cpu() for name, shape in shapes.items()}
    # transformers 5 holds MoE experts fused ([E, 2I, H]); published checkpoints, and so SGLang's loaders,
    # name every expert's projections separately. Saving does the same split; for dense models it is a no-op.
    tensors = revert_weight_conversion(meta_model, tensors)

    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if files[-1] and size + nbytes > max_file_bytes:
            files.append({})
            size = 0
        files[-1][name] = t
        size += nbytes
    if len(files) == 1:
        save_file(files[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    weight_map = {}
    for i, part in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def default_cache_dir() -> Path:
    root = os.environ.get("OFFLINE_EXTRACT_CACHE") or Path.home() / ".cache" / "offline_extract"
    return Path(root) / f"tiny-llama-v{TINY_VERSION}"


def build_tiny_model(out_dir: str | os.PathLike) -> Path:
    tokenizer = _train_tokenizer()
    config = tiny_llama_config(len(tokenizer))
    config["bos_token_id"] = tokenizer.bos_token_id
    config["eos_token_id"] = tokenizer.eos_token_id
    config["pad_token_id"] = tokenizer.pad_token_id
    random_checkpoint(config, out_dir, seed=0)
    tokenizer.save_pretrained(out_dir)
    return Path(out_dir)


def ensure_tiny_model(path: str | os.PathLike | None = None) -> Path:
    """Return the embedded default model's directory, building it once.

    Built in a temporary directory and renamed into place, so concurrent ranks under torchrun either
    see a complete model or build their own copy and discard it.
    """
    target = Path(path) if path else default_cache_dir()
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build_tiny_model(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "tokenizer.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target

