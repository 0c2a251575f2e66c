"""What the engine reads of a MoE model's experts in SGLang 0.5.17: how many are routed, which ones its top-k
picks for each token (for the parity gate's forced routing), and the token counts whose forwards compile
every variant of its expert kernels and of its routing (for the warm-up)."""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from offline_extract.engine.sglang_releases import installed


def routed_expert_count(text_config) -> int:
    """A decoder's routed experts under any of the names the supported configs use; 0 for a dense model."""
    return next(
        (
            getattr(text_config, key)
            for key in ("num_experts", "n_routed_experts", "num_local_experts")
            if getattr(text_config, key, None)
        ),
        0,
    )


@contextmanager
def recording_routing(model, experts_per_token: int, routed: int):
    """Record the routed experts SGLang picks for every token, per MoE layer of `model`, while the block runs.

    Yields {decoder layer index: [ids of each forward, [T, experts per token] int64 on the CPU, each row
    sorted, or None where SGLang's MoE runner routes inside its kernel and exposes no choice]}, empty for a
    model without SGLang TopK modules. The model computes exactly as without recording: the hook only
    reads SGLang's top-k output.
    """
    from sglang.srt.layers.moe.topk import TopK

    chosen: dict[int, list[torch.Tensor | None]] = {}
    k = experts_per_token

    def record(layer: int, output) -> None:
        ids = routed_experts(output)
        if ids is None:  # a MoE runner that routes inside its kernel (FlashInfer TRT-LLM)
            chosen.setdefault(layer, []).append(None)
            return
        # A shared expert fused into the routed kernel shows up as an extra column with an id past the
        # routed experts; sorting puts it last.
        ids = ids.sort(dim=-1).values
        if ids.shape[1] < k or bool((ids[:, :k] >= routed).any()):
            raise RuntimeError(
                f"SGLang's top-k at layer {layer} returned ids {tuple(ids.shape)} outside "
                f"{routed} routed experts x {k} per token"
            )
        chosen.setdefault(layer, []).append(ids[:, :k].long().cpu())

    handles = []
    for name, module in model.named_modules():
        if isinstance(module, TopK):
            found = re.search(r"layers\.(\d+)\.", name)
            if found is None:
                raise RuntimeError(f"SGLang's top-k module {name} is not inside a numbered decoder layer")
            layer = int(found.group(1))
            handles.append(module.register_forward_hook(lambda m, args, out, layer=layer: record(layer, out)))
    try:
        yield chosen
    finally:
        for h in handles:
            h.remove()


def warm_up_token_counts(runner, device, quantized: bool, max_tokens: int) -> list[int]:
    """The token counts of the forwards that compile a MoE model's expert kernels for every forward of
    up to `max_tokens` (`moe_token_counts`), from the launch config SGLang's Triton MoE runner picks
    for M tokens (`fused_moe_triton_config.try_get_optimal_moe_config`: the tuned table's nearest entry
    for the device and the experts' shapes, else its heuristic); for another MoE runner, which picks its
    kernels its own way (and on CPU), by octaves of M. `runner` is SGLang's ModelRunner."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import (
        get_config_dtype_str,
        try_get_optimal_moe_config,
    )
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    layer = next((m for m in runner.model.modules() if isinstance(m, FusedMoE)), None)
    moe_runner = getattr(getattr(layer, "quant_method", None), "runner", None)
    # The tuned tables are looked up by the CUDA device's name; on CPU the experts take torch's own path.
    on_cuda = torch.device(device).type == "cuda"
    config_of: Callable[[int], object]
    if (
        on_cuda
        and layer is not None
        and moe_runner is not None
        and moe_runner.runner_backend == MoeRunnerBackend.TRITON
        and not quantized
    ):
        # As fused_moe.py's _prepare_fused_moe_run asks for an unquantized layer (no padding, no blocks).
        w1, w2, k = tuple(layer.w13_weight.shape), tuple(layer.w2_weight.shape), layer.top_k
        dtype = get_config_dtype_str(dtype=runner.model_config.dtype)

        def config_of(m: int) -> object:
            return json.dumps(try_get_optimal_moe_config(w1, w2, k, dtype, m, return_down_config=True), sort_keys=True)
    else:
        config_of = int.bit_length
    return moe_token_counts(config_of, max_tokens)


def moe_token_counts(config_of: Callable[[int], object], max_tokens: int) -> list[int]:
    """Token counts M whose forwards compile every variant of a MoE model's expert kernels that forwards of 1
    to `max_tokens` tokens can launch. SGLang 0.5.17's Triton MoE kernels take their launch config from M
    (`config_of(M)`), and Triton compiles a kernel anew for each specialization of its integer arguments:
    whether each is 1, and whether it is a multiple of 16 (M x top-k, the padded sorted-token count, ...),
    which M's largest power-of-two divisor up to 16 decides. So: for each config, the smallest M that takes
    it with each such divisor, and M = 1."""
    firsts: dict[tuple, int] = {}
    for m in range(1, max_tokens + 1):
        firsts.setdefault((config_of(m), m == 1, min(m & -m, 16)), m)
    return sorted(set(firsts.values()))


def routed_experts(topk_output) -> torch.Tensor | None:
    """The experts SGLang's TopK chose, [T, experts per token] in any order within a row, from any output format
    that states them; None for one that leaves the choice to the MoE kernel (BYPASSED)."""
    ids = getattr(topk_output, "topk_ids", None)
    if ids is not None:
        return ids
    found = installed().triton_kernels_pairs(topk_output)
    if found is None:
        return None
    # triton_kernels (GPT-OSS's default MoE runner on Hopper): no id table, but the (token, slot) pairs sorted by
    # expert, numbered token * k + slot, and each expert's count of them. Reading the experts back off that
    # order gives each pair its expert (triton_kernels' own reference, make_bitmatrix_metadata_torch, is a
    # stable argsort of the flat id table).
    pairs, counts, k = found
    pairs = pairs[pairs >= 0].long()
    experts = torch.repeat_interleave(
        torch.arange(len(counts), device=pairs.device), counts.long(), output_size=len(pairs)
    )
    ids = torch.empty(len(pairs), dtype=torch.long, device=pairs.device)
    ids[pairs] = experts
    return ids.view(-1, k)


# SGLang's triton_kernels routing (its TopK on the triton_kernels MoE runner: GPT-OSS's on Hopper) keeps a
# bitmatrix whose rows are the forward's tokens rounded up to this many, and both of its kernels take that
# row count as a compile-time constant (triton_kernels/topk.py, `_topk_forward`'s stride_rn, and
# `_sum_bitmatrix_rows`'s stride_bn): every such block of token counts is a compile of each.
ROUTING_ROW_BLOCK = 32


@dataclass(frozen=True)
class Routing:
    """What SGLang's triton_kernels routing is compiled for, besides a forward's token count."""

    experts: int  # the router logits' columns
    top_k: int
    sm_first: bool  # softmax over every expert before the top-k, rather than over the k chosen
    dtype: str  # the router logits', a torch dtype's name


def triton_kernels_routing(model, experts: int, dtype: torch.dtype) -> Routing | None:
    """The routing of `model`'s TopK modules where SGLang runs it through triton_kernels, as `TopK.forward_cuda`
    decides (its config's output format, else the MoE runner backend's); None for any other routing. The
    router's logits are in the model's dtype (GPT-OSS's router takes params_dtype=config.dtype)."""
    from sglang.srt.layers.moe.topk import TopK, TopKOutputFormat
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    topk = next((m for m in model.modules() if isinstance(m, TopK)), None)
    if topk is None:
        return None
    config = topk.topk_config
    triton_kernels = config.output_format == TopKOutputFormat.TRITON_KERNEL or (
        config.output_format is None and get_moe_runner_backend().is_triton_kernels()
    )
    if not triton_kernels:
        return None
    return Routing(experts, config.top_k, not config.renormalize, str(dtype).removeprefix("torch."))


def routing_token_counts(max_tokens: int) -> list[int]:
    """Token counts whose routing compiles every variant of triton_kernels' routing kernels that forwards of 1
    to `max_tokens` tokens launch: one in each block of ROUTING_ROW_BLOCK token counts for each way Triton
    specializes the token count itself (1, a multiple of 16, neither)."""
    firsts: dict[tuple, int] = {}
    for m in range(1, max_tokens + 1):
        firsts.setdefault((-(-m // ROUTING_ROW_BLOCK), m == 1, m % 16 == 0), m)
    return sorted(firsts.values())


def compile_routing(routing: dict, gpu_id: int, counts: list[int]) -> None:
    """Runs triton_kernels' top-k as SGLang's `routing` (srt/layers/moe/topk.py) calls it for `routing`
    (`Routing` as a dict), on random logits of each of `counts` tokens on GPU `gpu_id`: what it compiles lands
    in TRITON_CACHE_DIR, where the forward's own call finds it. In a process of its own (`RoutingPrebuild`):
    one process compiles one kernel at a time."""
    from triton_kernels.topk import topk

    r = Routing(**routing)
    torch.cuda.set_device(gpu_id)
    for n in counts:
        logits = torch.randn(n, r.experts, dtype=getattr(torch, r.dtype), device="cuda")
        topk(torch.softmax(logits, dim=-1) if r.sm_first else logits, r.top_k, apply_softmax=not r.sm_first)
    torch.cuda.synchronize()
