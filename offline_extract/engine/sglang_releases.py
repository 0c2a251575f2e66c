"""The SGLang releases the engine runs on, and everything in which they differ, stated here once.

The engine package (`sglang_adapter`, `kernels`, `moe`, `multimodal`) calls what the supported releases share;
where they differ it asks `installed()`, the `Release` of the SGLang in this environment. The two kinds below
are the whole of the difference:

- bringing a process up: 0.5.17's `ModelRunner` takes a `ParallelState`, publishes the `ServerArgs` (resolved
  when they were made) and starts torch.distributed itself, and the kernel configs read the `ServerArgs`
  handed to them; from 0.5.23 the `ServerArgs` are resolved on request (`resolve_once`), published by the
  process (`runtime_context.publish`) before anything reads them, the kernel configs read what was
  published, and the process groups start before the runner (`bootstrap.init_parallel_runtime`);
- a request's extend range: 0.5.17's `Req.set_extend_range` and the prefix's KV indices in
  `Req.prefix_indices`; 0.5.23's `Req.prefix_len` and `Req.extend_end`, the prefix read from the request's
  own row (`Req.kv`);
- the few facts each states otherwise: its tree cache's methods (`NoTreeCache`), the arguments of its KV
  pool's store module (which the kernel prebuild asks for), where its triton_kernels routing keeps the
  experts' choice, the attention backends and load formats it accepts, and whether its own server can return
  the aux layers (`Release.serves_aux_layers`, which only the bench's peer reads).

The releases between (0.5.18 to 0.5.22) are refused: 0.5.18 to 0.5.21 each take some of these steps one way
and some the other, and 0.5.22, which takes them all as 0.5.23 does, has not been run here
(docs/supported-models.md, "SGLang versions").
"""

from __future__ import annotations

import functools
import importlib.metadata
import types
from dataclasses import dataclass
from typing import Callable

# Oldest first; the last is what a fresh install gets (setup.cfg's range ends there).
SUPPORTED = ("0.5.17", "0.5.23")


class UnsupportedSGLang(NotImplementedError):
    """The installed SGLang is not one of `SUPPORTED` (or none is installed)."""


@dataclass(frozen=True)
class Release:
    """One supported SGLang release: the versions its wheel pins, and its side of every difference."""

    version: str
    torch: str  # the torch its wheel pins
    transformers: str  # the transformers its wheel pins
    # Whether its server (sglang.Engine) returns EAGLE-3 aux layers without a draft model, through
    # --enable-return-aux-hidden-states (server_args' exec group); the engine captures them itself either way.
    serves_aux_layers: bool

    # What its server_args.py accepts, for preflight to refuse a mistyped value before SGLang loads.
    @property
    def attention_backends(self) -> tuple[str, ...]:
        return _accepted(_ATTENTION_BACKENDS, self.version)

    @property
    def load_formats(self) -> tuple[str, ...]:
        return _accepted(_LOAD_FORMATS, self.version)

    def configure_process(self, server_args, tp_rank: int, gpu_id: int, device: str) -> None:
        """What must hold, process-wide, before SGLang's ModelConfig is read: the kernel configs."""
        raise NotImplementedError

    def model_runner(self, server_args, model_config, tp_rank: int, tp_size: int, gpu_id: int, port: int):
        """SGLang's ModelRunner of this rank, its weights loaded and its process groups started."""
        raise NotImplementedError

    def set_extend(self, runner, req, start: int, stop: int) -> None:
        """The next forward of `req` extends tokens [start, stop), the ones before already in its KV row of
        `runner`'s request-to-token pool."""
        raise NotImplementedError

    def extend_length(self, req) -> int:
        """How many tokens the forward of `req` extends."""
        raise NotImplementedError

    def page_size(self, runner) -> int:
        raise NotImplementedError

    def kvcache_module(self, k_row_bytes: int, v_row_bytes: int) -> Callable[[], object]:
        """The KV pool's call for its nvcc-built store module for rows of these bytes, with the arguments SGLang
        memoizes it under, so that a prebuild of it is the module the forward then finds."""
        raise NotImplementedError

    def triton_kernels_pairs(self, topk_output) -> tuple | None:
        """Of a TopK output on the triton_kernels MoE runner (GPT-OSS's on Hopper): the (token, slot) pairs
        numbered token * k + slot and sorted by expert, each expert's count of them, and k; None for another
        output."""
        raise NotImplementedError


def _kernel_configs() -> list:
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config

    return [initialize_moe_config, initialize_fp8_gemm_config, initialize_fp4_gemm_config, initialize_bf16_gemm_config]


class _Release0517(Release):
    """0.5.17: the ServerArgs resolved when made, handed to everything that reads them."""

    def configure_process(self, server_args, tp_rank: int, gpu_id: int, device: str) -> None:
        for initialize in _kernel_configs():
            initialize(server_args)

    def model_runner(self, server_args, model_config, tp_rank: int, tp_size: int, gpu_id: int, port: int):
        from sglang.srt.distributed.parallel_state_wrapper import ParallelState
        from sglang.srt.model_executor.model_runner import ModelRunner

        ps = ParallelState(
            **dict(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, dp_rank=None, dp_size=1),
            **dict(attn_tp_rank=tp_rank, attn_tp_size=tp_size, attn_cp_rank=0, attn_cp_size=1),
            **dict(attn_dp_rank=0, attn_dp_size=1, moe_ep_rank=0, moe_ep_size=1, moe_dp_rank=None, moe_dp_size=1),
            dcp_size=1,
            gpu_id=gpu_id,
        )
        return ModelRunner(
            model_config=model_config,
            mem_fraction_static=server_args.mem_fraction_static,
            gpu_id=gpu_id,
            ps=ps,
            nccl_port=port,
            server_args=server_args,
        )

    def set_extend(self, runner, req, start: int, stop: int) -> None:
        if start:
            row = runner.req_to_token_pool.req_to_token[req.req_pool_idx]
            req.prefix_indices = row[:start].to(req.prefix_indices.dtype)
        req.set_extend_range(start, stop)

    def extend_length(self, req) -> int:
        return req.extend_range.end - req.extend_range.start

    def page_size(self, runner) -> int:
        return runner.server_args.page_size

    def kvcache_module(self, k_row_bytes: int, v_row_bytes: int) -> Callable[[], object]:
        from sglang.kernels.ops.kvcache.kvcache import _jit_kvcache_module

        return functools.partial(_jit_kvcache_module, k_row_bytes, v_row_bytes)

    def triton_kernels_pairs(self, topk_output) -> tuple | None:
        routing = getattr(topk_output, "routing_data", None)
        if routing is None:
            return None
        return topk_output.gather_indx.src_indx, routing.expt_hist, routing.n_expts_act


class _Release0523(Release):
    """0.5.23: the ServerArgs resolved on request and published; the process groups started before the runner."""

    def configure_process(self, server_args, tp_rank: int, gpu_id: int, device: str) -> None:
        from sglang.srt.runtime_context import SpawnRanks, publish

        server_args.resolve_once()
        # On CPU, 0.5.23 binds a rank's threads to the NUMA node of its published gpu_id, where 0.5.17 took
        # its TP rank: each data-parallel replica is a world of its own, so its local rank would run past
        # the host's nodes.
        gpu_id = tp_rank if device == "cpu" else gpu_id
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=tp_rank, gpu_id=gpu_id))
        for initialize in _kernel_configs():
            initialize()

    def model_runner(self, server_args, model_config, tp_rank: int, tp_size: int, gpu_id: int, port: int):
        from sglang.srt.distributed import bootstrap
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.arg_groups.overrides import resolving_view
        from sglang.srt.runtime_context import get_device

        bootstrap.init_parallel_runtime(server_args=server_args, device=get_device().device, dist_port=port)
        bootstrap.init_layer_runtime(model_config=model_config)
        return ModelRunner(
            model_config=model_config,
            mem_fraction_static=resolving_view(server_args).mem_fraction_static,
            gpu_id=gpu_id,
            nccl_port=port,
            server_args=server_args,
        )

    def set_extend(self, runner, req, start: int, stop: int) -> None:
        req.prefix_len, req.extend_end = start, stop

    def extend_length(self, req) -> int:
        return req.extend_len

    def page_size(self, runner) -> int:
        from sglang.srt.runtime_context import get_schedule

        return get_schedule().page_size

    def kvcache_module(self, k_row_bytes: int, v_row_bytes: int) -> Callable[[], object]:
        from sglang.kernels.ops.kvcache.kvcache import _jit_kvcache_module

        # Thread count 0: the pool leaves it to SGLang's heuristic, which is memoized under 0.
        return functools.partial(_jit_kvcache_module, k_row_bytes, v_row_bytes, 0)

    def triton_kernels_pairs(self, topk_output) -> tuple | None:
        # topk.py's routing: scatter_indx is the pairs sorted by expert, the ragged metadata counts them.
        ragged = getattr(topk_output, "a_ragged_metadata", None)
        if ragged is None:
            return None
        return topk_output.scatter_indx, ragged.slice_sizes, topk_output.n_expts_act


# What the releases' server_args.py accept (ATTENTION_BACKEND_CHOICES and LOAD_FORMAT_CHOICES, held to them by
# tests/unit/engine/test_attention_backend.py), each value once, in their order; `_ONLY_IN` names the values that
# one release takes and another does not.
_ATTENTION_BACKENDS = (
    *("triton", "torch_native", "flex_attention", "dsa", "nsa", "qsa", "dsv4", "compressed", "cutlass_mla", "fa3"),
    *("fa4", "flashinfer", "llada2_cfg_flashinfer", "flashmla", "trtllm_mla", "cutedsl_mla", "tokenspeed_mla"),
    *("trtllm_mha", "dual_chunk_flash_attn", "hpc_ops", "minicpm_flashattn", "minicpm_flashinfer", "aiter", "wave"),
    *("intel_amx", "ascend", "intel_xpu"),
)
_LOAD_FORMATS = (
    *("auto", "pt", "safetensors", "instanttensor", "npcache", "dummy", "sharded_state", "presharded", "gguf"),
    *("expert_pack", "bitsandbytes", "mistral", "layered", "flash_rl", "remote", "remote_instance"),
    *("fastsafetensors", "private", "runai_streamer"),
)
_ONLY_IN = {
    "0.5.17": {"cutlass_mla", "dual_chunk_flash_attn"},
    "0.5.23": {
        *("qsa", "llada2_cfg_flashinfer", "minicpm_flashattn", "minicpm_flashinfer"),
        "instanttensor",
        "expert_pack",
    },
}


def _accepted(choices: tuple[str, ...], version: str) -> tuple[str, ...]:
    others = set().union(*(only for release, only in _ONLY_IN.items() if release != version))
    return tuple(choice for choice in choices if choice not in others)


RELEASES = {
    r.version: r
    for r in (
        _Release0517(
            "0.5.17",
            torch="2.11.0",
            transformers="5.12.1",
            serves_aux_layers=False,
        ),
        _Release0523(
            "0.5.23",
            torch="2.14.1",
            transformers="5.19.0",
            serves_aux_layers=True,
        ),
    )
}


def installed_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "none"


@functools.cache
def installed() -> Release:
    """The release of the installed SGLang; an unsupported one is refused naming the supported releases."""
    version = installed_version()
    release = RELEASES.get(version)
    if release is None:
        raise UnsupportedSGLang(
            f"SGLang {version} is installed, but the engine runs only on SGLang {' and '.join(SUPPORTED)} (the "
            f"releases between are not supported). Install one: pip install sglang=={SUPPORTED[-1]}"
        )
    return release


def _no(*args, **kwargs) -> bool:
    return False


def _nothing(*args, **kwargs) -> None:
    pass


class NoTreeCache(types.SimpleNamespace):
    """The tree-cache interface ScheduleBatch needs when every batch starts from empty pools: a cache that
    shares no prefix, holds nothing to evict, and keeps no request's row."""

    # 0.5.17 asks is_chunk_cache and is_tree_cache, 0.5.23 supports_prefix_sharing and maybe_hand_to_session.
    supports_swa = supports_mamba = is_tree_cache = supports_prefix_sharing = _no
    evict = pretty_print = maybe_hand_to_session = _nothing

    def is_chunk_cache(self):
        return True

    def available_and_evictable_str(self):
        return f"available={self.token_to_kv_pool_allocator.available_size()}"
