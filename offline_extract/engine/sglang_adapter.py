"""The SGLang adapter, which drives SGLang's internals (pinned to sglang==0.5.17); only it and the engine
package's `kernels` (SGLang's JIT caches and kernel prebuild) touch them.

It loads a model with SGLang's own loader into an in-process `ModelRunner`, builds EXTEND (prefill-only)
batches from token lists, and returns per token the EAGLE-3 auxiliary states and the final state (after
the model's final norm, or before it: see options.FINAL_STATES).
Full-vocab logits are never computed: the model's logits processor is replaced by one that only keeps the
hidden states it is handed.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import os
import sys
import types
from pathlib import Path
from array import array
from dataclasses import dataclass
from typing import Iterator, Sequence, cast

import numpy as np
import torch

from offline_extract.data.images import Images
from offline_extract.engine.families import FAMILIES, CaptureRule
from offline_extract.engine.kernels import (
    Compiles,
    KernelPrebuild,
    RoutingPrebuild,
    kernel_shapes,
    prebuild_calls,
    use_jit_cache,
)
from offline_extract.engine.moe import (
    recording_routing,
    routed_expert_count,
    triton_kernels_routing,
    warm_up_token_counts,
)
from offline_extract.engine.sglang_releases import NoTreeCache, installed
from offline_extract.engine.multimodal import IMAGE_MODELS, HostWork, image_model, init_embedding_cache
from offline_extract.options import DEFAULT_PORT_BASE, DEFAULT_TOKENS_PER_BATCH, FinalState, check_choice, default
from offline_extract.final_norm import FinalNorm

LAYER_CONVENTION = "id k = output of decoder layer k (0-based) = HF output_hidden_states[k+1]"


def prepare_process(device: str) -> None:
    """Environment that must be in place before sglang is first imported."""
    if device == "cpu":
        hide_gpus()  # a run did already (preflight); tests and benchmarks come here first
        if torch.cuda.is_available():
            raise ValueError(
                "this run is on the CPU, where SGLang must not see the machine's GPUs (it would call its CUDA "
                "kernels on the CPU's tensors), but CUDA had already started in this process, so hiding them "
                "through CUDA_VISIBLE_DEVICES came too late. Start the process with them hidden: "
                "CUDA_VISIBLE_DEVICES= python bin/extract.py ... --device cpu"
            )
        # Many sglang modules snapshot the platform at import time.
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        _shim_sgl_kernel_if_missing()
    # torchrun exports TORCHELASTIC_USE_AGENT_STORE=True, which turns every rank into a client of
    # SGLang's own tcp:// rendezvous with no server behind it: a silent 30-minute hang, even at world 1.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    # Copied from what sglang's engine entry point sets, minus the process-wide side effects.
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    os.environ.setdefault("CUDA_MODULE_LOADING", "AUTO")


def hide_gpus() -> None:
    """Hides the GPUs from this process, for a run on the CPU. SGLang 0.5.17 chooses its kernels at import from
    whether torch sees a GPU (utils/common.py `is_cuda`, kept as `_is_cuda` by layernorm.py and many more), not
    from the run's device: on a GPU machine a CPU run would call sgl_kernel's CUDA-only operators on CPU tensors.
    The CUDA driver reads CUDA_VISIBLE_DEVICES once, when it starts, so a run calls this as soon as it knows its
    device (preflight), before anything can ask the driver about its GPUs (transformers does, when it imports a
    model's configuration module)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def import_sglang(device: str, jit_cache: str | os.PathLike | None = None) -> dict[str, str]:
    """Everything `Engine` needs before it reads a model: the process environment and the compilers' caches
    (both before sglang's first import: `prepare_process`, `use_jit_cache`), then SGLang's modules, which
    import transformers, tokenizers and jinja2 too. Returns where the compilers keep their results.

    A caller may call it first, on its own thread: once it returns, a tokenizer loads on another thread
    beside the model without the two threads importing the same modules at once. An SGLang the engine does
    not support is refused first (`UnsupportedSGLang`), before its import."""
    installed()
    prepare_process(device)
    caches = use_jit_cache(jit_cache)
    importlib.import_module("sglang.srt.model_executor.model_runner")  # the engine's modules all come with it
    return caches


class _SglKernelImportShim(types.ModuleType):
    """Stands in for `sgl_kernel` where the installed wheel cannot load (CUDA-only wheel on a CPU host).

    SGLang's CPU engine imports a dozen `*_cpu` names from it at module level but, without AMX, never
    calls them: every layer takes its `forward_native` path. Any call therefore means a path we do not
    support, and raises. It is deliberately not a package, so `import sgl_kernel.x` keeps failing with
    ImportError, which SGLang's own fallbacks rely on.
    """

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"sgl_kernel.{name} was called, but sgl_kernel is only an import shim on this CPU host")

        unavailable.__name__ = name
        return unavailable


def _shim_sgl_kernel_if_missing() -> None:
    if "sgl_kernel" in sys.modules:
        return
    try:
        importlib.import_module("sgl_kernel")
    except (ImportError, OSError):
        sys.modules["sgl_kernel"] = _SglKernelImportShim("sgl_kernel")


def warm_up_batches(budget: int, max_seqs: int, longest: int, moe_counts: list[int]) -> list[list[int]]:
    """The sequence lengths of each warm-up batch: two short sequences within the budget and the context
    (`longest`), one length a multiple of 16 and one not, as Triton specializes on that; then on a MoE model a
    forward of each of `moe_counts` tokens, in as few sequences as the context holds (the experts see a
    forward's tokens as one matrix; a sequence over the context would write past its row of SGLang's
    request-to-token pool). No chunked sequence: an extend on a prefix is verified on Llama only, and a run
    whose samples all fit one forward must not fail on it; a run's first long sample compiles what that path
    adds."""
    batches = [[max(1, min(n, budget // 2, longest)) for n in (17, 32)][:max_seqs]]
    for n in moe_counts:
        parts = -(-n // longest)
        batches.append([n // parts + (i < n % parts) for i in range(parts)])
    return batches


def warm_up(engine: Engine) -> dict:
    """Captures the `warm_up_batches` of the engine's model and budget, so that what compiles on first use
    (JIT_CACHES) compiles here rather than inside the first real batch: the Triton kernels, and the wait for
    any nvcc module `KernelPrebuild` is still building; seconds when the cache is cold, milliseconds once it
    is warm. A MoE model routed through triton_kernels has its routing compiled for every token count beside
    them (`RoutingPrebuild`), whose report it returns ({} for any other model)."""
    cfg, vocab, on_gpu = engine.cfg, engine.runner.model_config.vocab_size, torch.device(engine.device).type == "cuda"
    moe = engine.warm_up_token_counts()
    batches = warm_up_batches(cfg.max_tokens_per_batch, cfg.max_seqs_per_batch, engine.max_sequence_tokens, moe)
    # None where SGLang routes otherwise: a dense model, another MoE runner, the CPU.
    model, experts, dtype = engine.runner.model, engine.routed_experts, engine.runner.model_config.dtype
    routing = triton_kernels_routing(model, experts, dtype) if on_gpu else None
    prebuild = RoutingPrebuild(routing, engine.warm_up_tokens, cfg.gpu_id) if routing is not None else None
    try:
        for lengths in batches:
            engine.capture([np.arange(1, n + 1, dtype=np.int64) % vocab for n in lengths])
        if on_gpu:
            torch.cuda.synchronize()
        return prebuild.wait() if prebuild is not None else {}
    finally:
        if prebuild is not None:
            prebuild.stop()


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    device: str = "cuda"  # "cuda" or "cpu"
    dtype: str = default("dtype")  # options.ComputeDtype
    tp_size: int = default("tp")
    tp_rank: int = 0
    gpu_id: int = 0
    nccl_port: int = DEFAULT_PORT_BASE
    attention_backend: str | None = None  # None: fa3 on Hopper when installed, else triton
    max_tokens_per_batch: int = DEFAULT_TOKENS_PER_BATCH["cuda"]
    max_seqs_per_batch: int = default("seqs_per_batch")
    # Tokens a forward for a sequence longer than max_tokens_per_batch, prefilled alone in chunks. None:
    # max_tokens_per_batch. It may exceed a ragged batch's budget: the KV pool is sized for the whole
    # sequence anyway, and each chunk pays a forward's fixed costs (host-side batch set-up, launches, the
    # kernels' last partial wave) again. Only activation memory grows with it.
    chunk_tokens: int | None = None
    context_length: int | None = None
    layer_ids: tuple[int, ...] | None = None  # None: SGLang's EAGLE-3 default for the model
    final_state: FinalState = default("final_state")
    load_format: str = default("load_format")
    mem_fraction_static: float = default("mem_fraction_static")
    trust_remote_code: bool = False
    jit_cache: str | None = None  # where compiled kernels are kept between runs (use_jit_cache); None: its default
    # torch's intra-op threads once the model is loaded, which copy each batch's states into the shard
    # buffers; None: as many as torch had before the load.
    host_threads: int | None = None


@dataclass
class Captured:
    """One batch's states on the engine's device, tokens packed request by request."""

    aux: torch.Tensor  # [T, k*H]
    last: torch.Tensor  # [T, H], the final state EngineConfig.final_state names


def _captured(states: Captured | None) -> Captured:
    """The states of a forward that captured them (`Engine._extend` with capture=True)."""
    if states is None:
        raise RuntimeError("a capturing forward returned no states")
    return states


def default_attention_backend(device: str) -> str:
    if device == "cpu":
        return "torch_native"
    try:
        hopper = torch.cuda.get_device_capability()[0] == 9
        importlib.import_module("sgl_kernel.flash_ops")
        return "fa3" if hopper else "triton"
    except (ImportError, OSError, RuntimeError):
        return "triton"


# Every supported architecture's rule, by SGLang class name: what `capture_rule` answers from, and what the
# tests hold against SGLang's own model files.
CAPTURE_RULES = {f.sglang_class: f.capture for f in FAMILIES}


# Architectures whose SGLang model file captures something other than a layer's output.
_GEMMA3_CAPTURE = (
    "SGLang's gemma3_causal.py (also behind gemma3_mm.py) captures the output of a layer's last norm, "
    "post_feedforward_layernorm(mlp(...)), without the residual its layers carry apart (gemma3_causal.py:386 "
    "and :642), so what it records is not the layer's output (HF hidden_states[k+1]); on the test model it is "
    "as far from it as the state itself, while the final state matches"
)
_WRONG_CAPTURE = {"Gemma3ForCausalLM": _GEMMA3_CAPTURE, "Gemma3ForConditionalGeneration": _GEMMA3_CAPTURE}


def capture_rule(architecture: str, model_path: str = "") -> CaptureRule:
    if architecture in _WRONG_CAPTURE:
        raise NotImplementedError(
            f"architecture {architecture} ({model_path or 'model'}) is not supported: {_WRONG_CAPTURE[architecture]}"
        )
    rule = CAPTURE_RULES.get(architecture)
    if rule is None:
        raise NotImplementedError(
            f"architecture {architecture} ({model_path or 'model'}) is not supported: its SGLang model file's "
            f"EAGLE-3 capture convention has not been verified against HF transformers. Supported: "
            f"{', '.join(sorted(CAPTURE_RULES))}"
        )
    return rule


def model_capture_rule(model, model_path: str = "") -> CaptureRule:
    """The rule for a loaded SGLang model; a model file that has no EAGLE-3 capture at all says so."""
    cls = type(model)
    if not callable(getattr(cls, "set_eagle3_layers_to_capture", None)):
        raise NotImplementedError(
            f"architecture {cls.__name__} ({model_path or 'model'}) cannot capture EAGLE-3 states: SGLang's model "
            f"file {cls.__module__} defines no set_eagle3_layers_to_capture"
        )
    return capture_rule(cls.__name__, model_path)


def resolve_capture(model, rule: CaptureRule, points: list[int] | None) -> list[int]:
    """Hand SGLang's `model` the ids that its own set_eagle3_layers_to_capture turns into `points` (None:
    no ids, i.e. the model file's EAGLE-3 default), and return the capture points it actually set. Points the
    model file cannot express are refused before the model is touched, so its capture stays as it was."""
    ids = None if points is None else rule.ids_for_points(points)
    route_capture(rule.causal_lm(model), rule, [])  # a previous call's per-layer flags would stick
    model.set_eagle3_layers_to_capture(ids)
    return rule.captured_points(model)


def route_capture(lm, rule: CaptureRule, points: list[int]) -> None:
    """Capture exactly `points` (none: SGLang's plain prefill). The decoder returns (states, aux) whenever
    anything was captured, so turning capture off needs the points emptied, not just the flag cleared."""
    lm.capture_aux_hidden_states = bool(points)
    lm.model.layers_to_capture = list(points)
    if rule.in_layer_flags:
        for i, layer in enumerate(lm.model.layers):
            layer._is_layer_to_capture = i in points


def chunk_bounds(num_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """[start, stop) of each chunk of a sequence prefilled `chunk` tokens at a time; the last may be short."""
    if chunk < 1:
        raise ValueError(f"chunk size must be positive, got {chunk}")
    return [(start, min(start + chunk, num_tokens)) for start in range(0, num_tokens, chunk)]


# The config keys SGLang 0.5.17 reads a model's context length from (hf_transformers/common.py,
# get_context_length), most trusted first; a config with none of them gets 2048.
CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")


def context_length(text_config) -> tuple[int, str]:
    """The longest context SGLang accepts for a model (a longer context_length stops its ModelConfig),
    derived from the decoder's HF config as SGLang does, and the config key it came from.

    RoPE scaling stretches the limit by its factor, except where the config already states the stretched
    length (a rope_scaling that names original_max_position_embeddings, or Llama-3's rope type).
    """
    scaling = getattr(text_config, "rope_scaling", None) or {}
    stated = "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3"
    factor = 1 if stated else scaling.get("factor", 1)
    for key in CONTEXT_KEYS:
        value = getattr(text_config, key, None)
        if value is not None:
            return int(factor * value), key
    return 2048, "SGLang's default for a config without a context length"


# Llama 4's RoPE layers attend within fixed chunks of attention_chunk_size tokens. Of SGLang 0.5.17's CUDA
# backends only fa3 implements that (flashattention_backend.py's local attention); the others run such layers
# with full causal attention, silently wrong for every token past the first chunk.
_CHUNKED_ATTENTION_BACKENDS = ("fa3",)


def _refuse_unsupported_attention(model_config, backend: str, model_path: str) -> None:
    chunk = model_config.attention_chunk_size
    if chunk is not None and backend not in _CHUNKED_ATTENTION_BACKENDS:
        raise NotImplementedError(
            f"{model_path} uses chunked attention (attention_chunk_size={chunk}), which SGLang {installed().version} "
            f"implements only in the {' and '.join(_CHUNKED_ATTENTION_BACKENDS)} attention backend; on {backend} "
            f"tokens past the first {chunk} would attend to the wrong keys. Use --attention-backend fa3 on Hopper."
        )


# Architectures SGLang loads on CPU but cannot run there, checked before the weights load.
_CPU_UNSUPPORTED = {f.sglang_class: f.not_on_cpu for f in FAMILIES if f.refused_on_cpu}


def _refuse_on_cpu(architecture: str, device: str, model_path: str) -> None:
    reason = _CPU_UNSUPPORTED.get(architecture)
    if reason and device == "cpu":
        raise NotImplementedError(
            f"{architecture} ({model_path}) cannot run on SGLang {installed().version}'s CPU path: {reason}. Run it on a GPU."
        )


def check_engine_choices(attention_backend: str | None, load_format: str) -> None:
    """Raises ValueError naming the option and SGLang's values when either is not one the installed SGLang
    takes: refused in the first seconds, where importing server_args takes seconds and SGLang refuses an
    attention backend only once the model is loaded. An SGLang the engine does not support is refused here
    too (`UnsupportedSGLang`)."""
    release = installed()
    for option, value, allowed in (
        ("--attention-backend", attention_backend, release.attention_backends),
        ("--load-format", load_format, release.load_formats),
    ):
        if value is not None and value not in allowed:
            raise ValueError(f"{option} {value} is not one of SGLang {release.version}'s: {', '.join(allowed)}")


def validate_layer_ids(ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    ids = tuple(int(i) for i in ids)
    if not ids:
        raise ValueError("--layers needs at least one layer id")
    if len(set(ids)) != len(ids):
        raise ValueError(f"--layers has duplicate ids: {list(ids)}")
    for i in ids:
        # The output of the last layer is never captured by SGLang (it would be dropped silently); the
        # final post-norm state is stored separately as `hidden_states`.
        if not 0 <= i < num_layers - 1:
            raise ValueError(
                f"layer id {i} is out of range: ids are 0..{num_layers - 2} for a model of {num_layers} "
                f"decoder layers (id k = output of layer k; the last layer's output is not capturable)"
            )
    return tuple(sorted(ids))


class PortTaken(OSError):
    """EngineConfig.nccl_port is another process's."""


@functools.cache
def _tear_down_process_groups_at_exit() -> None:
    """SGLang's process groups (TP and the others of parallel_state) and torch's default one, destroyed at
    the process's exit, before the interpreter's teardown: left to it, torch warns that
    destroy_process_group() was not called, at the end of every GPU run. Once per process (the groups are
    SGLang's process globals); an exit through os._exit (a stopped command) runs no destructor to warn."""

    def tear_down() -> None:
        from sglang.srt.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()

    atexit.register(tear_down)


def _checkpoint_quantization(model_path: str) -> dict | None:
    """Where the checkpoint's weights are quantized, as its config.json states it (a wrapper's text model's).
    Read from the file: SGLang's FP8 loader adds config objects to the in-memory dict later, which would no
    longer serialize into the run's metadata. Read before SGLang reads the config, whose own model checks
    (GPT-OSS's attention backends) would otherwise speak first."""
    raw = json.loads((Path(model_path) / "config.json").read_text())
    return raw.get("quantization_config") or raw.get("text_config", {}).get("quantization_config")


def _server_args(cfg: EngineConfig, backend: str):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=cfg.model_path,
        load_format=cfg.load_format,
        dtype=cfg.dtype,
        device=cfg.device,
        tp_size=cfg.tp_size,
        trust_remote_code=cfg.trust_remote_code,
        attention_backend=backend,
        sampling_backend="pytorch",
        # Prefill graphs would replay without running our capture module; extraction is prefill only.
        disable_cuda_graph=True,
        disable_radix_cache=True,
        disable_overlap_schedule=True,
        chunked_prefill_size=-1,
        skip_tokenizer_init=True,
        # SGLang builds Llama 4's vision tower only when asked (model_config.py's mm_disabled_models), every other
        # vision-language model's by default; a text model ignores it. The engine loads before any record is
        # read, so a Llama 4 run on a text corpus builds the tower too: its weights take GPU memory from
        # activations, though no more reads (SGLang reads a tower it skips and drops its weights).
        enable_multimodal=True,
        # The KV pool holds one forward's tokens, or one chunked sequence with its whole prefix, and no
        # more: everything else stays activation room.
        max_total_tokens=max(cfg.max_tokens_per_batch, cfg.context_length or 0) + 64,
        max_running_requests=cfg.max_seqs_per_batch,
        context_length=cfg.context_length,
        mem_fraction_static=cfg.mem_fraction_static,
        disable_custom_all_reduce=cfg.device == "cpu",
        log_level="error",
    )


def _model_config(sa, backend: str, cfg: EngineConfig):
    """SGLang's ModelConfig of the run, after the process-wide kernel configs it reads `sa` into; a model
    this engine cannot run is refused here, before any weight loads."""
    from sglang.srt.configs.model_config import ModelConfig

    installed().configure_process(sa, cfg.tp_rank, cfg.gpu_id, cfg.device)
    mc = ModelConfig.from_server_args(sa)
    _refuse_unsupported_attention(mc, backend, cfg.model_path)
    _refuse_on_cpu(mc.hf_config.architectures[0], cfg.device, cfg.model_path)
    return mc


def _model_runner(cfg: EngineConfig, mc, sa):
    """SGLang's ModelRunner of this rank, its weights loaded."""
    threads = torch.get_num_threads()
    # ModelRunner makes the process groups: from here the process tears them down before it exits.
    _tear_down_process_groups_at_exit()
    try:
        runner = installed().model_runner(sa, mc, cfg.tp_rank, cfg.tp_size, cfg.gpu_id, cfg.nccl_port)
    except torch.distributed.DistNetworkError as e:
        # The replica's TP rank 0 serves its process group's store on that port; torch says only EADDRINUSE.
        if "EADDRINUSE" not in str(e):
            raise
        raise PortTaken(
            f"port {cfg.nccl_port}, where SGLang's ranks of this replica meet, is taken by another process"
        ) from None
    # On a GPU, ModelRunner.load_model leaves torch with one intra-op thread (to load weights with fewer
    # thread conflicts); every batch's states would then be copied into the shard buffers on one core,
    # and the last batches' copies add to the end of every run.
    torch.set_num_threads(cfg.host_threads or threads)
    return runner


class Engine:
    """An in-process SGLang ModelRunner that returns hidden states for ragged prefill batches."""

    def __init__(self, cfg: EngineConfig):
        self.jit_caches = import_sglang(cfg.device, cfg.jit_cache)
        check_choice("final_state", cfg.final_state)
        self.cfg = cfg
        self.final_state = cfg.final_state
        self.quantization = _checkpoint_quantization(cfg.model_path)
        _refuse_quantization(cfg.model_path, self.quantization, cfg.device)
        if torch.device(cfg.device).type == "cuda":
            torch.cuda.set_device(cfg.gpu_id)
        self.attention_backend = cfg.attention_backend or default_attention_backend(cfg.device)
        sa = _server_args(cfg, self.attention_backend)
        mc = _model_config(sa, self.attention_backend, cfg)
        # On CPU nothing is compiled: the torch_native path calls none of these modules.
        self.compiles = Compiles(
            KernelPrebuild(
                lambda: prebuild_calls(kernel_shapes(mc, cfg.tp_size)), self.jit_caches["TVM_FFI_CACHE_DIR"], cfg.gpu_id
            )
            if torch.device(cfg.device).type == "cuda"
            else None
        )
        self.runner = _model_runner(cfg, mc, sa)
        model = self.runner.model
        self.architecture = type(model).__name__
        # The decoder's own config: a multimodal wrapper's (Kimi-K2.5) nests it as text_config.
        text = mc.hf_text_config
        self.num_layers, self.hidden_size = text.num_hidden_layers, text.hidden_size
        self.routed_experts = routed_expert_count(text)
        self._experts_per_token = getattr(text, "num_experts_per_tok", 0)
        self.is_moe = self.routed_experts > 0
        self.dtype = str(mc.dtype).removeprefix("torch.")
        self._states = _StateCapture(model, cfg.model_path, self.num_layers)
        self.layer_ids = self._configure_capture(model, cfg.layer_ids)
        self.runner.alloc_memory_pool()
        self.runner.init_attention_backends()
        self.runner.init_cuda_graphs()
        self.device = self.runner.device
        if self.architecture in IMAGE_MODELS:
            init_embedding_cache()
        self._host_work = HostWork()
        self.compiles.loaded()

    def _configure_capture(self, model, requested: tuple[int, ...] | None) -> tuple[int, ...]:
        return self._states.configure(model, requested)

    @property
    def capture_points(self) -> list[int]:
        """SGLang's capture points, layer id + 1 each."""
        return self._states.points

    def final_norm(self) -> FinalNorm | None:
        """The model's final norm as loaded (weight, epsilon, gain convention), for an export to turn one
        final state into the other; None for a norm other than SGLang's plain or Gemma-style RMSNorm."""
        return _final_norm(self._states.lm.model.norm)

    def recording_routing(self):
        """`moe.recording_routing` of the loaded model: yields {decoder layer index: [ids of each forward]}
        of the experts SGLang's top-k picks for every token while the block runs."""
        return recording_routing(self.runner.model, self._experts_per_token, self.routed_experts)

    def warm_up(self) -> None:
        """`warm_up` of this engine."""
        self.compiles.routing = warm_up(self)

    @property
    def warm_up_tokens(self) -> int:
        """The most tokens a forward of ragged batches holds."""
        return min(self.cfg.max_tokens_per_batch, self.cfg.max_seqs_per_batch * self.max_sequence_tokens)

    def warm_up_token_counts(self) -> list[int]:
        """`moe.warm_up_token_counts` up to the most tokens a forward holds; empty for a dense model."""
        if not self.is_moe:
            return []
        return warm_up_token_counts(self.runner, self.device, bool(self.quantization), self.warm_up_tokens)

    def capture(self, seqs: Sequence[np.ndarray], images: Sequence[Images | None] | None = None) -> Captured:
        """Prefill `seqs` as one EXTEND batch and return their states (still on the device).

        `images`, parallel to `seqs` (None entries and None altogether: text only), are the images each
        sequence's image tokens stand for. A single text sequence longer than one forward's token budget is
        prefilled in chunks (`chunks`); a sequence with images never is, and is refused there.
        """
        return _captured(self._prefill(seqs, capture=True, images=self._checked_images(seqs, images)))

    def _checked_images(
        self, seqs: Sequence[np.ndarray], images: Sequence[Images | None] | None
    ) -> Sequence[Images | None] | None:
        """`images` checked against `seqs`; None where no sequence has any."""
        if images is None or all(im is None for im in images):
            return None
        self._check_images(seqs, images)
        return images

    def _check_images(self, seqs: Sequence[np.ndarray], images: Sequence[Images | None]) -> None:
        if len(images) != len(seqs):
            raise ValueError(f"{len(images)} image entries for {len(seqs)} sequences: one entry (or None) per sequence")
        image_model(self.architecture, self.cfg.model_path)
        for ids, im in zip(seqs, images):
            if im is None:
                continue
            if len(ids) > self.cfg.max_tokens_per_batch:
                raise ValueError(
                    f"a sequence with images of {len(ids)} tokens exceeds one forward's budget of "
                    f"{self.cfg.max_tokens_per_batch} tokens: the engine prefills a sequence with images in one "
                    f"forward, its image embeddings and positions built for the whole sequence (raise "
                    f"--tokens-per-batch or shorten it)"
                )
            if len(im.token_mask) != len(ids):
                raise ValueError(f"an image token mask of {len(im.token_mask)} tokens for a sequence of {len(ids)}")

    def prepare_images(self, seqs: Sequence[np.ndarray], images: Sequence[Images | None] | None) -> None:
        """Ahead of `capture(seqs, images)`, on another thread (the feed's): the host's work on their images that
        every forward of them repeats (`multimodal.HostInputs`: each image's pixels hashed), off the forwards'."""
        if (images := self._checked_images(seqs, images)) is not None:
            spec = image_model(self.architecture, self.cfg.model_path)
            self._host_work.prepare(self.runner.model_config.hf_config, spec, seqs, images)

    def _request(self, i: int, ids: np.ndarray, images: Images | None):
        if images is None:
            return _new_req(i, ids)
        spec = image_model(self.architecture, self.cfg.model_path)
        hf_config = self.runner.model_config.hf_config
        padded, mm = self._host_work.request(self.runner.model, hf_config, spec, ids, images)
        req = _new_req(i, padded)
        req.extend_image_inputs(mm)
        return req

    def prefill(self, seqs: Sequence[np.ndarray], images: Sequence[Images | None] | None = None) -> None:
        """SGLang's unmodified prefill of `seqs` (last-token logits only, nothing captured): the ceiling
        the benchmarks hold extraction against. `images` as `capture`'s: an image chat's bare prefill runs
        its vision tower too, or it would not be the same input."""
        self._prefill(seqs, capture=False, images=self._checked_images(seqs, images))

    def _prefill(
        self, seqs: Sequence[np.ndarray], capture: bool, images: Sequence[Images | None] | None = None
    ) -> Captured | None:
        if self.is_chunked(seqs) and images is None:
            return self._chunked(seqs[0], self.chunk_tokens, capture)
        self._check_lengths(seqs)
        total = sum(len(s) for s in seqs)
        if total > self.cfg.max_tokens_per_batch or len(seqs) > self.cfg.max_seqs_per_batch:
            raise ValueError(
                f"batch of {len(seqs)} sequences / {total} tokens exceeds the engine's "
                f"{self.cfg.max_seqs_per_batch} sequences / {self.cfg.max_tokens_per_batch} tokens"
            )
        # Fresh Req objects every batch: a Req reused after the pools are cleared would keep its stale
        # req_pool_idx and be treated as a chunk continuation.
        images = images or [None] * len(seqs)
        reqs = [self._request(i, ids, im) for i, (ids, im) in enumerate(zip(seqs, images))]
        try:
            return self._extend(reqs, capture)
        finally:
            self._clear_pools()

    def is_chunked(self, seqs: Sequence[np.ndarray]) -> bool:
        """Whether `capture(seqs)` prefills in chunks: a single sequence over one forward's token budget."""
        return len(seqs) == 1 and len(seqs[0]) > self.cfg.max_tokens_per_batch

    @property
    def chunk_tokens(self) -> int:
        return self.cfg.chunk_tokens or self.cfg.max_tokens_per_batch

    @property
    def max_forward_tokens(self) -> int:
        """The most tokens whose states one forward returns: a batch or a chunk."""
        return max(self.cfg.max_tokens_per_batch, self.chunk_tokens)

    def capture_chunked(self, ids: np.ndarray, chunk: int) -> Captured:
        """All of `chunks(ids, chunk)` in one piece: states equal to an unchunked prefill's. For the tests;
        extraction takes the chunks one by one (`chunks`), so as to copy each out while the
        next one computes."""
        return _captured(self._chunked(ids, chunk, capture=True))

    def prefill_chunked(self, ids: np.ndarray, chunk: int) -> None:
        """`prefill` of one long sequence, `chunk` tokens at a time: the bench's bare baseline for chunked
        prefill; extraction never calls it."""
        self._chunked(ids, chunk, capture=False)

    def _chunked(self, ids: np.ndarray, chunk: int, capture: bool) -> Captured | None:
        states = [states for _, _, states in self._chunks(ids, chunk, capture)]
        if not capture:
            return None
        parts = [_captured(p) for p in states]
        return Captured(aux=torch.cat([p.aux for p in parts]), last=torch.cat([p.last for p in parts]))

    def chunks(self, ids: np.ndarray, chunk: int) -> Iterator[tuple[int, int, Captured]]:
        """Prefill one long sequence `chunk` tokens at a time, each chunk attending to the KV cache of
        the ones before (SGLang's extend with a prefix), and yield each chunk's rows (start, stop) and
        states as soon as its forward is enqueued: the caller can move them off the device while later
        chunks compute.

        The sequence holds the KV pool until the generator is exhausted or closed.
        """
        return cast(Iterator[tuple[int, int, Captured]], self._chunks(ids, chunk, capture=True))  # with states

    def _chunks(self, ids: np.ndarray, chunk: int, capture: bool) -> Iterator[tuple[int, int, Captured | None]]:
        self._check_lengths([ids])
        req = _new_req(0, ids)
        try:
            for start, stop in chunk_bounds(len(ids), chunk):
                installed().set_extend(self.runner, req, start, stop)
                yield start, stop, self._extend([req], capture)
        finally:
            self._clear_pools()

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence a request holds: a row of SGLang's request-to-token pool (the context)."""
        return self.runner.model_config.context_len

    def _check_lengths(self, seqs: Sequence[np.ndarray]) -> None:
        if (longest := max(len(s) for s in seqs)) > self.max_sequence_tokens:
            raise ValueError(
                f"a sequence of {longest} tokens exceeds the context length of {self.max_sequence_tokens} that "
                f"SGLang's pools were sized for (raise context_length)"
            )

    def _extend(self, reqs: list, capture: bool) -> Captured | None:
        self.compiles.before_forward()
        self._states.switch(capture, pre_norm=self.final_state == "pre-norm")
        _forward(self.runner, reqs, capture)
        if not capture:
            return None
        aux, last = self._states.take()
        total = sum(installed().extend_length(r) for r in reqs)
        if aux.shape[0] != total or aux.shape[1] != len(self.layer_ids) * self.hidden_size:
            raise RuntimeError(
                f"SGLang returned aux states of shape {tuple(aux.shape)} for {total} tokens and layers "
                f"{list(self.layer_ids)}; expected {(total, len(self.layer_ids) * self.hidden_size)}"
            )
        return Captured(aux=aux, last=last)

    def _clear_pools(self) -> None:
        # Outputs are fresh tensors, not views into the KV pool, so the pool can be reused at once.
        self.runner.req_to_token_pool.clear()
        self.runner.token_to_kv_pool_allocator.clear()


class _StateCapture:
    """What a forward of SGLang's model records: the capture points routed in the model, its logits processor
    swapped for one that keeps the states it is handed, and, for a pre-norm run, the final norm's input."""

    def __init__(self, model, model_path: str, num_layers: int):
        self.model_path, self.num_layers = model_path, num_layers
        self._logits_processor = model_capture_rule(model, model_path).causal_lm(model).logits_processor
        self._capture = _CaptureOnly()
        self._keeps_pre_norm = False  # whether the forwards from the last switch keep the final norm's input

    def configure(self, model, requested: tuple[int, ...] | None) -> tuple[int, ...]:
        """Capture the layer ids `requested` (None: SGLang's EAGLE-3 default for the model); returns them."""
        rule = model_capture_rule(model, self.model_path)
        # None: ask SGLang for its own default, so training data matches what EAGLE-3 inference captures.
        wanted = [p - 1 for p in resolve_capture(model, rule, None)] if requested is None else requested
        ids = validate_layer_ids(wanted, self.num_layers)
        points = [k + 1 for k in ids]
        resolved = resolve_capture(model, rule, points)
        if resolved != points:
            raise RuntimeError(
                f"SGLang's {rule.source} ({rule.convention}) resolved layer ids {list(ids)} to capture points "
                f"{resolved}, expected {points}"
            )
        self.rule, self.lm = rule, rule.causal_lm(model)
        self._pre_norm: torch.Tensor | None = None
        self.lm.model.norm.register_forward_hook(self._keep_pre_norm)
        self.points = resolved
        self._capturing: bool | None = None  # SGLang's capture state now: unknown until the first switch
        return ids

    def _keep_pre_norm(self, norm, args, output) -> None:
        """The pre-norm state is the final norm's input. Called as norm(x, residual) the norm returns
        (normed, x + residual), and its fused CUDA kernel overwrites x in place, so the state is taken from
        the output; called as norm(x) (the last layer already added its residual), x is the state."""
        if self._keeps_pre_norm:
            self._pre_norm = output[1] if isinstance(output, tuple) else args[0]

    def switch(self, on: bool, pre_norm: bool) -> None:
        """Capture in the next forwards, their final state the final norm's input where `pre_norm`; or run
        SGLang's plain prefill."""
        self._keeps_pre_norm = on and pre_norm
        if on == self._capturing:
            return  # re-routing walks every layer on Qwen-MoE: once per switch, not once per batch
        route_capture(self.lm, self.rule, self.points if on else [])
        self.lm.logits_processor = self._capture if on else self._logits_processor
        self._capturing = on

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The last capturing forward's (aux, final state)."""
        aux, last = self._capture.take()
        if self._keeps_pre_norm:
            last, self._pre_norm = self._pre_norm, None
        return aux, last


def _final_norm(norm) -> FinalNorm | None:
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm

    if type(norm) is GemmaRMSNorm:
        offset = 1.0
    elif type(norm) is RMSNorm and norm.has_weight and norm.variance_size_override is None:
        offset = 0.0
    else:
        return None
    # RMSNorm is replicated across TP ranks: any rank's weight is the whole weight.
    return FinalNorm(norm.weight.detach().float().cpu(), float(norm.variance_epsilon), offset)


def _forward(runner, reqs: list, capture: bool) -> None:
    """One EXTEND forward of `reqs` on SGLang's `runner`, the final states kept for the capture (or not)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    batch = ScheduleBatch.init_new(
        reqs=reqs,
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        tree_cache=NoTreeCache(
            page_size=installed().page_size(runner),
            device=runner.device,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        ),
        model_config=runner.model_config,
        enable_overlap=False,
        spec_algorithm=SpeculativeAlgorithm.NONE,
    )
    batch.prepare_for_extend()
    batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
    batch.prefill_input_ids_cpu = None
    fb = ForwardBatch.init_new(
        batch,
        runner,
        capture_hidden_mode=CaptureHiddenMode.FULL if capture else CaptureHiddenMode.NULL,
        return_hidden_states_before_norm=False,
    )
    with torch.no_grad():
        runner.forward(fb)


def _new_req(i: int, ids: np.ndarray):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    r = Req(
        rid=str(i),
        origin_input_text="",
        # From bytes: element by element, array() walks a 16k-token batch in Python for a millisecond.
        origin_input_ids=array("q", np.asarray(ids, dtype=np.int64).tobytes()),
        sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
    )
    r.full_untruncated_fill_ids = r.origin_input_ids
    r.logprob_start_len = -1  # no input logprobs, hence no full-vocab logits
    installed().set_extend(None, r, 0, len(ids))
    return r


# The quantized formats SGLang 0.5.17 runs and how: {quant_method: (name, what runs it on CPU)}.
_QUANTIZED_ON_CPU = {
    # fp8.py asserts AMX after loading every weight.
    "fp8": (
        "an FP8 checkpoint",
        "SGLang runs FP8 weights on CPU only with the Intel AMX kernels of sgl_kernel's CPU build",
    ),
    # mxfp4.py packs the experts for AMX, and otherwise upcasts them with triton_kernels' GPU kernels.
    "mxfp4": (
        "an MXFP4 checkpoint",
        "SGLang runs MXFP4 experts on CPU only with the Intel AMX kernels of sgl_kernel's CPU build",
    ),
}


def _refuse_quantization(model_path: str, quantization: dict | None, device: str) -> None:
    """Before SGLang reads the model: a quantized checkpoint on a device where SGLang 0.5.17 cannot run it.

    MXFP4 on a GPU runs through triton_kernels (the MoE runner SGLang picks for GPT-OSS on Hopper: MXFP4 weights
    upcast inside the kernel, bf16 activations), or FlashInfer's MXFP4 kernels on Blackwell (sm100/sm120);
    without triton_kernels a Hopper would fail only after loading every weight."""
    method = (quantization or {}).get("quant_method")
    if method not in _QUANTIZED_ON_CPU:
        return
    name, cpu = _QUANTIZED_ON_CPU[method]
    if device == "cpu":
        from sglang.srt.utils import cpu_has_amx_support

        if not cpu_has_amx_support():
            raise NotImplementedError(
                f"{model_path} is {name} ({quantization}); {cpu}, which this host lacks. Run it on a GPU (--device cuda)"
            )
    elif method == "mxfp4":
        from sglang.srt.utils import is_sm100_supported, is_sm120_supported, is_triton_kernels_available

        if not (is_triton_kernels_available() or is_sm100_supported() or is_sm120_supported()):
            raise NotImplementedError(
                f"{model_path} is {name} ({quantization}); SGLang {installed().version} runs MXFP4 experts on this GPU "
                f"only through the triton_kernels package, which is not installed (pip install triton_kernels)"
            )


class _CaptureOnly(torch.nn.Module):
    """Takes the logits processor's place: keeps the states it is handed and computes no logits."""

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None, *args, **kwargs):
        from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        self._taken = (pack_aux_hidden_states(aux_hidden_states), hidden_states)
        return LogitsProcessorOutput(next_token_logits=None)

    def take(self):
        out, self._taken = self._taken, None
        return out
