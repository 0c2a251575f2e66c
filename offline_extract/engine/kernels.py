"""SGLang's compiled kernels: where each of its JIT compilers keeps what it builds (`use_jit_cache`, so that a
run on a fresh machine finds the last run's), and what a dense model's forward compiles on first use (SGLang's
nvcc-built modules, FlashInfer's RMSNorms) built ahead, beside the weights' load (`KernelPrebuild`,
docs/start-up.md). It calls SGLang's kernel modules, so it is part of the engine package, which alone touches
SGLang's internals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from offline_extract.engine import sglang_releases
from offline_extract.engine.families import FAMILIES
from offline_extract.engine.moe import Routing, routing_token_counts
from offline_extract.options import cache_root


# What SGLang 0.5.17 compiles on first use, by the environment variable that says where each compiler keeps
# its results (read when it compiles; FlashInfer's at import). In a dense model's EXTEND forward on CUDA:
# SiluAndMul (layers/activation.py), the fused RoPE (layers/rotary_embedding/base.py, via
# kernels/ops/attention/rope.py) and the KV store (mem_cache/memory_pool.py, kernels/ops/kvcache) are
# TVM-FFI modules built with nvcc (kernels/jit/utils/compile.py, load_jit); write_cache_indices
# (mem_cache/allocation.py) and compute_position (model_executor/forward_batch_info.py) are Triton
# kernels; at TP > 1 the vocab-parallel embedding is a Triton kernel or torch.compile'd (Inductor). FlashInfer
# and DeepGEMM compile for the backends and FP8 paths that use them. Their own defaults (~/.triton,
# ~/.cache/tvm-ffi, /tmp/torchinductor_$USER, ...) are lost with a fresh container: a cold first batch
# then compiles for tens of seconds.
JIT_CACHES = {
    "TVM_FFI_CACHE_DIR": "tvm-ffi",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "SGLANG_DG_CACHE_DIR": "deep_gemm",
    # FlashInfer's CuTe DSL kernels (its RMSNorms where nvidia-cutlass-dsl is installed, as SGLang requires):
    # read at each compile; its default is /tmp/$USER/cutlass_python_cache.
    "CUTE_DSL_CACHE_DIR": "cute-dsl",
}


def use_jit_cache(root: str | os.PathLike | None = None) -> dict[str, str]:
    """Points every compiler in JIT_CACHES at its own folder under `root` (None: `options.cache_root()`),
    except those the environment already points somewhere, and returns where each one keeps its results.
    Call before sglang is imported."""
    root = Path(root) if root is not None else cache_root()
    for key, folder in JIT_CACHES.items():
        os.environ.setdefault(key, str(root / folder))
    return {key: os.environ[key] for key in JIT_CACHES}


def jit_cache_files(caches: dict[str, str]) -> set[str]:
    """The files in the compilers' caches (`use_jit_cache`'s folders), each named by its cache's folder and
    its path in it: every kernel compiled or module built adds some; one loaded from the cache adds none."""
    return {
        f"{Path(folder).name}/{f.relative_to(folder)}"
        for folder in set(caches.values())
        if os.path.isdir(folder)
        for f in Path(folder).rglob("*")
        if f.is_file()
    }


# Head sizes for which SGLang's RotaryEmbedding on CUDA calls the fused RoPE module; any other takes its
# fallback kernel, a module of its own (srt/layers/rotary_embedding/base.py, RotaryEmbedding.__init__).
_FUSED_ROPE_HEAD_SIZES = (64, 128, 256, 512)
# Head sizes SGLang's QK-norm module takes (kernels/ops/layernorm/norm.py, can_use_fused_inplace_qknorm); any
# other norms q and k one row at a time through the RMSNorms.
_QK_NORM_HEAD_SIZES = (64, 128, 256, 512, 1024)
_QK_NORM = {f.sglang_class: f.qk_norm for f in FAMILIES if f.qk_norm}


@dataclass(frozen=True)
class KernelShapes:
    """What the nvcc-built modules and the RMSNorms of a dense model's forward are specialized on, for one
    rank, as SGLang will call them (docs/start-up.md): known from the model's config before its weights load."""

    dtype: torch.dtype  # activations, RoPE'd q and k, and the KV pool (kv_cache_dtype "auto")
    hidden: int | None  # the residual stream's width, which the decoder's RMSNorms take (not split by TP)
    mlp_width: int | None  # SiluAndMul's output per rank: the intermediate size / TP; None: no dense MLP
    head_dim: int
    rope_dim: int | None  # rotated dims of each head; None: RoPE of another kind (MLA)
    rope_is_neox: bool
    kv_row_bytes: tuple[int, int] | None  # a K and a V row of the KV pool per rank; None: not an MHA pool
    mla_row_bytes: tuple[int, int] | None  # an MLA pool row's latent and RoPE parts; None: not an MLA pool
    qk_norm: bool = False  # its attention norms q and k with SGLang's QK-norm (families.Family.qk_norm)


def kernel_shapes(model_config, tp_size: int) -> KernelShapes:
    """`KernelShapes` from SGLang's `ModelConfig`, as its model files, KV pool and MLP layers derive them
    (Llama's and Qwen's attention: head_dim, partial_rotary_factor, rope_is_neox_style; the pool:
    `get_num_kv_heads` x head_dim in the compute dtype)."""
    from sglang.srt.configs.model_config import AttentionArch

    text, dtype = model_config.hf_text_config, model_config.dtype
    intermediate = getattr(text, "intermediate_size", None)
    mha = model_config.attention_arch == AttentionArch.MHA
    mla = model_config.attention_arch == AttentionArch.MLA
    heads = model_config.get_num_kv_heads(tp_size)
    row = dtype.itemsize * heads
    qk_norm = _QK_NORM.get(model_config.hf_config.architectures[0])
    return KernelShapes(
        dtype=dtype,
        hidden=getattr(text, "hidden_size", None),
        mlp_width=intermediate // tp_size if isinstance(intermediate, int) else None,  # a list: per layer
        head_dim=model_config.head_dim,
        rope_dim=int(getattr(text, "partial_rotary_factor", 1) * model_config.head_dim) if mha else None,
        rope_is_neox=getattr(text, "rope_is_neox_style", True),
        kv_row_bytes=(row * model_config.head_dim, row * model_config.v_head_dim) if mha else None,
        # Not split by TP: every rank keeps the whole latent.
        mla_row_bytes=(
            (dtype.itemsize * model_config.kv_lora_rank, dtype.itemsize * model_config.qk_rope_head_dim)
            if mla
            else None
        ),
        qk_norm=qk_norm == "always" or bool(qk_norm and getattr(text, qk_norm, False)),
    )


def _rms_norms(hidden: int, dtype: torch.dtype, device: str) -> None:
    """One row through sgl_kernel's `rmsnorm` and `fused_add_rmsnorm`, the calls of SGLang's RMSNorm on CUDA
    (srt/layers/layernorm.py, `RMSNorm.forward_cuda`). Where FlashInfer is installed they hand the rows to it,
    which compiles at the first call: a CuTe DSL kernel for each width, dtype and arch (any row count takes
    the same one), or, without nvidia-cutlass-dsl, its nvcc-built norm module. FlashInfer memoizes both for
    the process, so the forward's first call finds them compiled."""
    from sgl_kernel import fused_add_rmsnorm, rmsnorm

    x = torch.zeros(1, hidden, dtype=dtype, device=device)
    weight = torch.ones(hidden, dtype=dtype, device=device)
    rmsnorm(x, weight, 1e-6)
    fused_add_rmsnorm(x, torch.zeros_like(x), weight, 1e-6)


def prebuild_calls(shapes: KernelShapes, device: str = "cuda") -> dict[str, Callable[[], object]]:
    """The calls by which SGLang's forward gets each module for `shapes`, by a name for the record. Each is
    memoized by SGLang (`cache_once`) or FlashInfer, so the forward's own call then returns the module built
    here. `device`: where the RMSNorms' row is made (a prebuild thread's current GPU)."""
    from functools import partial

    from sglang.kernels.jit.utils import is_arch_support_pdl
    from sglang.kernels.ops.activation.activation import activation_module
    from sglang.kernels.ops.attention.rope import _jit_fused_rope_module, _jit_rotary_embedding_module
    from sglang.kernels.ops.kvcache.set_mla_kv_buffer import set_mla_kv_buffer_module
    from sglang.kernels.ops.layernorm.norm import _jit_qknorm_module
    from sglang.srt.layers.activation import _jit_act_supported

    dtype = str(shapes.dtype).removeprefix("torch.")
    calls: dict[str, Callable[[], object]] = {}
    if shapes.hidden:
        # One thread for both norms: without CuTe DSL they share one module, whose memoizing takes no lock.
        calls[f"rms_norm hidden={shapes.hidden} {dtype}"] = partial(_rms_norms, shapes.hidden, shapes.dtype, device)
    # SGLang's own test of whether SiluAndMul takes the JIT kernel: the output row's width against the
    # vector width, read from the shape and dtype alone.
    if shapes.mlp_width and _jit_act_supported(torch.empty(0, shapes.mlp_width, dtype=shapes.dtype, device="meta")):
        calls[f"activation {dtype}"] = partial(activation_module, shapes.dtype)
    if shapes.rope_dim and shapes.head_dim in _FUSED_ROPE_HEAD_SIZES:
        calls[f"fused_rope neox={shapes.rope_is_neox} dim={shapes.rope_dim} {dtype}"] = partial(
            _jit_fused_rope_module, shapes.rope_is_neox, shapes.rope_dim, shapes.dtype, shapes.dtype
        )
    elif shapes.rope_dim:
        calls["rotary_embedding"] = _jit_rotary_embedding_module
    if shapes.qk_norm and shapes.head_dim in _QK_NORM_HEAD_SIZES:
        # The module itself, not can_use_fused_inplace_qknorm: that one memoizes a failure as "norm row by row".
        calls[f"qknorm head_dim={shapes.head_dim} {dtype}"] = partial(_jit_qknorm_module, shapes.head_dim, shapes.dtype)
    if shapes.kv_row_bytes:
        # The module itself, not can_use_store_cache: that one memoizes a failure as "use the slow path".
        k_bytes, v_bytes = shapes.kv_row_bytes
        calls[f"kvcache k={k_bytes} v={v_bytes} bytes"] = sglang_releases.installed().kvcache_module(k_bytes, v_bytes)
    if shapes.mla_row_bytes:
        # The MLA pool's store of a forward of 768 tokens or more (kernels/ops/kvcache/mla_buffer.py): a TMA
        # module, taken only where the arch has PDL and the row's parts are aligned for it, and asked for
        # with use_pdl True; any other store is a Triton kernel.
        nope, rope = shapes.mla_row_bytes
        if is_arch_support_pdl() and nope % 4 == rope % 4 == (nope + rope) % 16 == 0:
            calls[f"set_mla_kv_buffer nope={nope} rope={rope} bytes"] = partial(
                set_mla_kv_buffer_module, nope, rope, True
            )
    return calls


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class KernelPrebuild:
    """SGLang's nvcc-built modules and FlashInfer's RMSNorms for one rank (`prebuild_calls`), each built on a
    thread of its own from the moment the config is read, so that they compile side by side and while the
    weights load instead of one after another inside the first forward (tens of seconds on a fresh machine,
    docs/start-up.md).

    Harmless when it guesses wrong: a module nobody calls costs only its build, and the forward still
    builds what it needs. A failure is kept for the record, not raised: the forward's own call tries again.
    Builds of distinct modules may run at once: each has its own build directory under TVM_FFI_CACHE_DIR,
    and tvm-ffi holds a file lock there while ninja runs (a forward or another rank asking for the same
    module waits for it, then loads the result). The threads are daemons: a run that fails meanwhile does not
    wait for nvcc.
    """

    def __init__(self, plan: Callable[[], dict[str, Callable[[], object]]], cache_dir: str, gpu_id: int | None):
        """Starts the builds `plan()` names; a plan that raises (a config these rules do not know) is
        recorded like a failed build, and nothing is prebuilt."""
        from sglang.kernels.jit.utils import get_jit_cuda_arch, is_arch_support_pdl

        # SGLang sets TVM_FFI_CUDA_ARCH_LIST around each build and restores the old value after it: builds
        # on several threads would restore it under one another, and a build started while it is unset
        # targets plain sm_90 instead of sm_90a. Fixed for the process, to the value SGLang sets, before
        # any thread starts; the memoized arch and PDL checks are answered here once, not on every thread.
        os.environ["TVM_FFI_CUDA_ARCH_LIST"] = get_jit_cuda_arch().target_name
        is_arch_support_pdl()
        self._cache, self._gpu_id = Path(cache_dir), gpu_id
        self._modules_before = self._modules_in_cache()
        self._started = time.perf_counter()
        self._loaded: float | None = None
        self._waited: float | None = None
        self._modules_at_first_forward: int | None = None
        self._spans: dict[str, tuple[float, float]] = {}
        self.failed: dict[str, str] = {}
        try:
            calls = plan()
        except Exception as e:
            calls, self.failed["plan"] = {}, _first_line(e)
        self._threads = [
            threading.Thread(target=self._build, args=(name, call), name=f"prebuild {name}", daemon=True)
            for name, call in calls.items()
        ]
        for thread in self._threads:
            thread.start()

    def _modules_in_cache(self) -> int:
        return sum(1 for _ in self._cache.rglob("*.so")) if self._cache.is_dir() else 0

    def _build(self, name: str, call: Callable[[], object]) -> None:
        start = time.perf_counter()
        try:
            if self._gpu_id is not None:
                # A new thread's CUDA device is device 0: loading a module there would open a context on
                # another rank's GPU.
                torch.cuda.set_device(self._gpu_id)
            call()
        except Exception as e:  # the forward's own call builds it, or says why it cannot
            self.failed[name] = _first_line(e)
        self._spans[name] = (start, time.perf_counter())

    def loaded(self) -> None:
        """The model has loaded: what the builds ran until now ran beside the load."""
        self._loaded = time.perf_counter()

    def wait(self) -> None:
        """Until every build has ended (once; the first forward calls it)."""
        if self._waited is None:
            start = time.perf_counter()
            for thread in self._threads:
                thread.join()
            self._waited = time.perf_counter() - start
            self._modules_at_first_forward = self._modules_in_cache()

    def report(self) -> dict:
        """Seconds from the prebuild's start: until its last build ended (`prebuild_s`), the builds one by
        one (`prebuild_modules`, and their sum, `prebuild_serial_s`: what they cost in a row), the part that
        ran while the model loaded (`prebuild_during_load_s`), what the first forward waited for it
        (`prebuild_waited_s`); what failed; and the modules added to the cache before the first forward and
        after it (`prebuild_cache_added`, `forward_cache_added`: the forward compiled what the prebuild
        missed). None where no forward has run yet."""
        spans = dict(self._spans)
        end = max((stop for _, stop in spans.values()), default=self._started)
        loaded = self._loaded if self._loaded is not None else end
        at_forward = self._modules_at_first_forward
        return {
            "prebuild_s": end - self._started,
            "prebuild_serial_s": sum(stop - start for start, stop in spans.values()),
            "prebuild_during_load_s": max(0.0, min(end, loaded) - self._started),
            "prebuild_waited_s": self._waited,
            "prebuild_modules": {name: stop - start for name, (start, stop) in spans.items()},
            "prebuild_unfinished": [t.name.removeprefix("prebuild ") for t in self._threads if t.is_alive()],
            "prebuild_failed": dict(self.failed),
            "prebuild_cache_added": None if at_forward is None else at_forward - self._modules_before,
            "forward_cache_added": None if at_forward is None else self._modules_in_cache() - at_forward,
        }


# The slowest of a run's Triton compiles its manifest names, each with its seconds and specialization.
NAMED_TRITON_COMPILES = 40


class TritonCompiles:
    """Each Triton kernel this process compiles from now on (one found in `--jit-cache` compiles nothing and is
    only counted), split at the warm-up's end (`warm`): its name, the constants it was specialized on and the
    seconds its compile took, so that a fresh machine's start-up says which kernels its seconds went to.
    Triton calls it from its compiler (`knobs.compilation.listener`), on whatever thread compiles; a listener
    set before it still hears every compile."""

    def __init__(self):
        from triton import knobs

        self._before = knobs.compilation.listener
        self._lock = threading.Lock()
        self._compiled: list[tuple[str, str, float]] = []
        self._loaded = 0
        self._warm_at: int | None = None
        knobs.compilation.listener = self._heard

    def _heard(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        if self._before is not None:
            self._before(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
        seconds = (times.ir_initialization + times.total_lowering + times.store_results) / 1e6
        with self._lock:
            if cache_hit:
                self._loaded += 1
            else:
                self._compiled.append((src.name, _specialization(src), seconds))

    def warm(self) -> None:
        """The warm-up has ended: what compiles from now on, the extraction's first batches paid for."""
        with self._lock:
            self._warm_at = len(self._compiled)

    def report(self) -> dict:
        """The compiles until the warm-up's end (`triton_compiled`, `triton_compile_s`, the slowest of them in
        `triton_kernels`), those after it (`triton_compiled_in_extraction`, their names), and the kernels
        loaded from the cache (`triton_loaded`)."""
        with self._lock:
            compiled, loaded = list(self._compiled), self._loaded
            warm = len(compiled) if self._warm_at is None else self._warm_at
        start_up, later = compiled[:warm], compiled[warm:]
        slowest = sorted(start_up, key=lambda c: -c[2])[:NAMED_TRITON_COMPILES]
        return {
            "triton_compiled": len(start_up),
            "triton_compile_s": sum(seconds for *_, seconds in start_up),
            "triton_kernels": [{"kernel": k, "specialized": spec, "seconds": s} for k, spec, s in slowest],
            "triton_compiled_in_extraction": len(later),
            "triton_compiled_in_extraction_kernels": sorted({k for k, *_ in later})[:NAMED_TRITON_COMPILES],
            "triton_loaded": loaded,
        }


class Compiles:
    """What one engine compiles, and when: its nvcc-built modules built ahead (`KernelPrebuild`, on a GPU), a MoE
    model's routing compiled during the warm-up (`RoutingPrebuild`'s report, set by it) and Triton's compiles
    (`TritonCompiles`, where Triton is installed), reported together in the run's timings."""

    def __init__(self, prebuild: KernelPrebuild | None):
        self.prebuild = prebuild
        self.routing: dict = {}
        try:
            self.triton: TritonCompiles | None = TritonCompiles()
        except ImportError:  # torch's CPU wheels come without Triton: nothing compiles with it
            self.triton = None

    def loaded(self) -> None:
        if self.prebuild is not None:
            self.prebuild.loaded()

    def before_forward(self) -> None:
        """Until the prebuild's modules are built (`KernelPrebuild.wait`), which the forward calls."""
        if self.prebuild is not None:
            self.prebuild.wait()

    def warm(self) -> None:
        """The start-up is over, warmed up or not: what compiles from now on, the extraction pays for."""
        if self.triton is not None:
            self.triton.warm()

    def report(self) -> dict:
        return {
            **(self.prebuild.report() if self.prebuild is not None else {}),
            **self.routing,
            **(self.triton.report() if self.triton is not None else {}),
        }


def _specialization(src) -> str:
    """A compiled kernel's constants (its constexprs and the arguments Triton specialized to a value), by name."""
    try:
        names = src.fn.arg_names
        return ", ".join(f"{names[k[0]]}={v}" for k, v in sorted(src.constants.items()) if len(k) == 1)[:200]
    except (AttributeError, IndexError, TypeError):  # a source of another kind, or another Triton's layout
        return ""


# Processes compiling a MoE model's routing for one GPU at most (`RoutingPrebuild`): each holds a CUDA context
# (a few hundred MB of the GPU) while it runs.
MOST_ROUTING_COMPILERS = 8

_COMPILE_ROUTING = "import json, sys; from offline_extract.engine.moe import compile_routing; compile_routing(**json.loads(sys.argv[1]))"


def routing_shares(counts: list[int], gpu_id: int, gpus: int, processes: int) -> list[list[int]]:
    """`counts` dealt out to `processes`, from GPU `gpu_id`'s own place in the list on (`RoutingPrebuild`)."""
    start = gpu_id * len(counts) // gpus
    counts = counts[start:] + counts[:start]
    return [counts[i::processes] for i in range(processes)]


class RoutingPrebuild:
    """triton_kernels' routing compiled for every token count a forward can hold (`moe.routing_token_counts`:
    hundreds of kernels, a few tenths of a second each to compile) ahead of the forwards that would each pay
    for one, in processes of their own since Triton compiles one kernel at a time in a process
    (`moe.compile_routing`). Each GPU's ranks start at their own place in the list, so that ranks of one
    node sharing TRITON_CACHE_DIR find one another's kernels there rather than all compiling the same ones.
    With the cache warm, each process only loads what it finds there. A failure is kept for the record,
    not raised: the forward compiles what it needs anyway."""

    def __init__(self, routing: Routing, max_tokens: int, gpu_id: int):
        """Starts the processes for forwards of up to `max_tokens` tokens on GPU `gpu_id`: as many as this
        process's cores shared among the node's GPUs, at most MOST_ROUTING_COMPILERS."""
        counts = routing_token_counts(max_tokens)
        gpus = max(1, torch.cuda.device_count())
        cores = len(os.sched_getaffinity(0))
        processes = max(1, min(MOST_ROUTING_COMPILERS, cores // gpus, len(counts)))
        # A bin/ script finds this package through the checkout it puts on sys.path, which a child does not get.
        here = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
        self.counts, self._started = len(counts), time.perf_counter()
        self._ended: float | None = None
        self.failed: list[str] = []
        self._procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _COMPILE_ROUTING,
                    json.dumps({"routing": asdict(routing), "gpu_id": gpu_id, "counts": share}),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for share in routing_shares(counts, gpu_id, gpus, processes)
        ]
        # Reads their errors as they come (a full pipe would stall a process) and times their end.
        self._collector = threading.Thread(target=self._collect, name="routing prebuild", daemon=True)
        self._collector.start()

    def _collect(self) -> None:
        for p in self._procs:
            _, err = p.communicate()
            if p.returncode:
                self.failed.append((err.strip().splitlines() or [f"exit status {p.returncode}"])[-1])
        self._ended = time.perf_counter()

    def wait(self) -> dict:
        """Until every process has ended: the seconds from their start to the last one's end
        (`routing_prebuild_s`; the warm-up's forwards ran beside them), the token counts and processes, and
        each failed process's last line of error (`routing_prebuild_failed`)."""
        self._collector.join()
        assert self._ended is not None, "the collector thread sets it before it ends"
        return {
            "routing_prebuild_s": self._ended - self._started,
            "routing_prebuild_token_counts": self.counts,
            "routing_prebuild_processes": len(self._procs),
            "routing_prebuild_failed": list(self.failed),
        }

    def stop(self) -> None:
        """Ends the processes still running (a run stopped during its warm-up)."""
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                p.wait()
