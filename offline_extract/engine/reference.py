"""HF transformers' model of the checkpoint, the parity gate's reference (`load_hf_model`), and its weights read
ahead into host memory beside SGLang's start-up (`ReferencePreload`).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Callable

import torch

from offline_extract.engine.checkpoint import (
    WeightsUnreadable,
    checkpoint_tensors,
    dequantized_fp8_tensors,
    dequantized_mxfp4_tensors,
    is_fp8_block,
    is_mxfp4,
)
from offline_extract.engine.families import FAMILIES
from offline_extract.engine.parity import ParityError
from offline_extract.formatting import human_bytes


def wrapped_text_config(raw: dict):
    """The decoder's HF config inside the config.json of a multimodal wrapper that transformers has no class
    for (Kimi-K2.5): its `text_config`, whose model type transformers knows."""
    from transformers import AutoConfig

    text = dict(raw.get("text_config") or raw)
    return AutoConfig.for_model(text.pop("model_type"), **text)


# Where such a wrapper's checkpoint keeps its decoder's weights (SGLang's loader reads them from there too).
WRAPPED_DECODER_PREFIX = "language_model."


_TAKE_IMAGES = {f.sglang_class for f in FAMILIES if f.images}


def _hf_model_class(model_path: str, raw: dict):
    """(HF class, its config, the checkpoint's key mapping or None) of the reference for the checkpoint whose
    config.json is `raw`."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    try:
        config, key_mapping = AutoConfig.from_pretrained(model_path), None
    except ValueError:  # a model type transformers does not know
        config = None
    if (
        config is not None
        and type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
        and raw.get("architectures", [None])[0] in _TAKE_IMAGES
    ):
        # A vision-language model whose images the engine extracts (Qwen2.5-VL, which has no causal-LM class;
        # Llama 4): its own class, tower and all, which takes the images too. A wrapper the engine runs for text
        # (Kimi-K2.5, which transformers 5.19 knows and 5.12 does not) is read as its decoder, below.
        return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)], config, key_mapping
    # Where SGLang has registered its own config class for the wrapper, transformers parses it but has no
    # model for it.
    if config is None or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        if "text_config" not in raw:
            raise ValueError(f"HF transformers has no causal LM for {model_path} (model type {raw.get('model_type')})")
        config, key_mapping = wrapped_text_config(raw), {f"^{re.escape(WRAPPED_DECODER_PREFIX)}": ""}
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], config, key_mapping


def load_hf_model(
    model_path: str,
    dtype: str,
    device: str,
    tensors: dict[str, torch.Tensor] | None = None,
    mark: Callable[[str], object] = lambda point: None,
):
    """HF transformers' model of the checkpoint, the gate's reference. A wrapper transformers has no class
    for is loaded as its decoder: the HF class of its text_config, on the weights under
    WRAPPED_DECODER_PREFIX (any vision weights are left unread), which is the model SGLang runs for text.

    `tensors`: the checkpoint's tensors already read into host memory (`ReferencePreload`), which HF then
    loads (renaming and fusing them as from the files) instead of reading the files. `mark` is told each
    point reached: "hf configured" (transformers' model class and the config), "hf on host" (the weights
    read and converted to `dtype`), "hf on device"."""
    raw = json.loads((Path(model_path) / "config.json").read_text())
    model_class, config, key_mapping = _hf_model_class(model_path, raw)
    # A multimodal config whose causal LM is its text model's (Llama-4) is built on its text config, as
    # AutoModelForCausalLM builds it.
    config = config if model_class.config_class is type(config) else config.get_text_config()
    # SDPA where transformers has it; GPT-OSS's attention sinks exist only in its eager attention.
    attention = "sdpa" if model_class._supports_sdpa else "eager"
    # A wrapper's quantization is stated for its text model.
    quantization = raw.get("quantization_config") or raw.get("text_config", {}).get("quantization_config")
    if quantization is not None and not (is_fp8_block(quantization) or is_mxfp4(quantization)):
        raise NotImplementedError(
            f"{model_path}: the parity gate has no HF reference for quantization {quantization}; it supports FP8 "
            f"block-quantized checkpoints (quant_method fp8 with weight_block_size) and MXFP4 experts "
            f"(quant_method mxfp4)"
        )
    mark("hf configured")
    if quantization is not None:
        # transformers' own quantized layers would compute as SGLang does, but fetch their kernels from the
        # Hugging Face Hub at run time (offline: unavailable), and its dequantize modes need accelerate; the
        # weights are dequantized here instead, exactly.
        del config.quantization_config  # what HF is handed is dequantized
        dequantized = dequantized_fp8_tensors if is_fp8_block(quantization) else dequantized_mxfp4_tensors
        tensors, _ = dequantized(model_path, getattr(torch, dtype), tensors)
    # Given tensors, HF reads no weight file: it loads them as it would the files' (renamed, split and fused
    # alike).
    model = model_class.from_pretrained(
        model_path if tensors is None else None,
        config=config,
        state_dict=tensors,
        key_mapping=key_mapping,
        dtype=getattr(torch, dtype),
        attn_implementation=attention,
    )
    mark("hf on host")
    model = model.to(device).eval()
    mark("hf on device")
    return model


# The share of a host's available memory that the preloads of its ranks may take together; the rest stays for
# SGLang's load, the shard buffers and the page cache.
PRELOAD_MEMORY_SHARE = 0.5


def preload_refusal(nbytes: int, readers: int, available: int | None) -> str | None:
    """Why `readers` ranks of a host may not each preload a checkpoint of `nbytes` while `available` bytes of
    host memory are available (None: unknown); None when they may."""
    if available is None:
        return "the host's available memory is unknown"
    if nbytes * readers > PRELOAD_MEMORY_SHARE * available:
        return (
            f"{readers} x {human_bytes(nbytes)} of weights exceed {PRELOAD_MEMORY_SHARE:.0%} of the host's "
            f"{human_bytes(available)} available"
        )
    return None


class ReferencePreload:
    """The gate's HF reference weights read from the checkpoint's files into host memory on a thread of its own
    (`start`), while SGLang imports and loads its model, so that at the gate only HF's model has to be built
    on them and moved to the device (`take`). The read is HF's own, independent of SGLang's load, as the
    gate requires. The thread touches no GPU: SGLang sizes its KV pool from the GPU memory free while it
    loads. Nor does it import anything, so it may start before SGLang's import without the two threads
    importing one module at once."""

    def __init__(self, model_path: str, mark: Callable[[str], object] = lambda point: None):
        self.model_path = model_path
        self._mark = mark
        self._tensors: dict[str, torch.Tensor] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, name="parity-preload", daemon=True)

    def start(self) -> "ReferencePreload":
        self._thread.start()
        return self

    def _read(self) -> None:
        self._mark("parity preload started")
        try:
            self._tensors = checkpoint_tensors(self.model_path, resident=True)
        except BaseException as e:  # raised by take, on the thread that runs the gate
            self._error = e
        self._mark("parity preload read")

    def take(self) -> dict[str, torch.Tensor]:
        """Waits for the read to end and hands its tensors over, keeping none (they go with the HF model built
        on them), or raises its failure, naming the checkpoint."""
        self._thread.join()
        if self._error is not None:
            e = self._error
            why = str(e) if isinstance(e, WeightsUnreadable) else f"{type(e).__name__}: {e}"
            raise ParityError(
                f"parity gate: reading HF's reference weights from {self.model_path} failed: {why}"
            ) from e
        tensors, self._tensors = self._tensors, None
        if tensors is None:
            raise RuntimeError("the reference weights were taken already: they are handed over once")
        return tensors

    def drop(self) -> None:
        """Where the gate runs no HF model after all (no sample to check): the read is waited for and freed."""
        self._thread.join()
        self._tensors = self._error = None
