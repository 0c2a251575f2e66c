"""The embedded default model: a tiny random Llama with a locally trained tokenizer and chat template.

Everything here is generated from fixed seeds, so two machines build the same files; nothing is
downloaded. offline_extract.testing.models writes, with the same tokenizer, every other architecture the
parity suites check.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from offline_extract.options import cache_root

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


def _random_tensor(name: str, shape, gen: torch.Generator, dtype, device) -> torch.Tensor:
    """Weights that keep activations O(1) through the stack, so a 1e-5 tolerance means something.

    HF's default init (std 0.02) would shrink every state towards zero and make any comparison pass.
    """
    # A vision tower's norms are named norm1, norm2 and ln_q (Qwen's VL towers).
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")) or "layernorm" in name:
        return (1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)).to(dtype)
    if name.endswith(".sinks"):  # attention-sink logits (GPT-OSS): O(1), so they take a real share of each softmax
        return torch.randn(shape, generator=gen, device=device).to(dtype)
    if name.endswith(".bias") or len(shape) == 1:
        return (0.02 * torch.randn(shape, generator=gen, device=device)).to(dtype)
    # A convolution's fan-in is all of its dimensions but the output channels (a vision tower's patch embedding).
    fan_in = math.prod(shape[1:]) if len(shape) > 3 else shape[-1]
    std = 1.0 if "embed" in name and len(shape) == 2 else 1.0 / math.sqrt(fan_in)
    return (std * torch.randn(shape, generator=gen, device=device)).to(dtype)


def random_checkpoint(
    config: dict,
    out_dir: str | os.PathLike,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    max_file_bytes: int = 4 << 30,
) -> Path:
    """Write config.json and seeded random weights for any HF causal-LM or vision-language config (one with a
    vision_config), in the layout HF saves.

    Parameter names and shapes come from instantiating the HF model on the meta device, so the same
    function serves every architecture transformers knows.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    hf_config = AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        auto = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
        meta_model = auto.from_config(hf_config)
    shapes = {k: tuple(v.shape) for k, v in meta_model.state_dict().items()}

    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {name: _random_tensor(name, shape, gen, dtype, device).cpu() for name, shape in shapes.items()}
    # transformers 5 holds MoE experts fused ([E, 2I, H]) and a vision-language model's decoder under
    # model.language_model; published checkpoints, and so SGLang's loaders, name every expert's projections
    # separately and the decoder model.*. Saving does the same; for dense text models it is a no-op.
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
    """Where the embedded model is built: under OFFLINE_EXTRACT_CACHE if set (the tests point it at a temporary
    folder), else under `options.cache_root()` beside the compiled kernels."""
    root = os.environ.get("OFFLINE_EXTRACT_CACHE") or cache_root()
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
