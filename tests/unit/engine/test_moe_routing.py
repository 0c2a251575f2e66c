"""MoE models in bf16 on CPU with the engine's expert choice forced onto HF (`parity.ForcedRouting`): then
every token matches as on a dense model, so what the parity gate's median rule lets through is routing
flips and nothing else (docs/moe-bf16-investigation.md). The GPU suite runs the same check
(tests/gpu/test_gpu_architectures.py) on every MoE family, including those SGLang cannot run on CPU; for those,
the forcing itself is checked here on HF's own model, and the reading of SGLang's triton_kernels routing."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from arch_parity import beyond_bf16_floor, run_report, write_result

from offline_extract.engine import parity, reference
from offline_extract.engine.families import FAMILIES, cpu_models
from offline_extract.testing.models import ARCHITECTURES, build_model


def _moe_layers(arch: str) -> list[int]:
    # Layers before first_k_dense_replace are dense (DeepSeek-V3's first two, GLM-4.5's first); Qwen3-MoE
    # routes in every layer.
    config = ARCHITECTURES[arch](0)
    return list(range(config.get("first_k_dense_replace", 0), config["num_hidden_layers"]))


# Every HF MoE block ForcedRouting knows, by the family that has it, HF building each (a wrapper's block is
# its text model's).
HF_BLOCKS = {f.name: f.routing.block for f in FAMILIES if f.routing and not f.capture.language_model}
# Architecture -> its MoE decoder layers, for the families of HF_BLOCKS that SGLang runs on CPU (DeepSeek-V3's
# routing is the grouped top-k with the correction bias and routed_scaling_factor; GLM-4.5's sigmoid routing
# with the correction bias, a shared expert and routed_scaling_factor).
MOE_LAYERS = {arch: _moe_layers(arch) for arch in HF_BLOCKS if arch in cpu_models()}
TOKENS = 5 + 37 + 64  # arch_parity.LENGTHS
# Near-ties only: measured 1-7 % of tokens per layer on these checkpoints; a wrong bias, grouping or scoring
# function would send most tokens elsewhere.
MAX_DISAGREEMENT_RATE = 0.15


@pytest.fixture(scope="module", params=list(MOE_LAYERS))
def report(request, tiny_model_dir, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"routing-{arch}")
    model = build_model(arch, root / "m", dtype=torch.bfloat16, tokenizer_dir=tiny_model_dir)
    rep = run_report(model, root / "report.json", "--dtype", "bfloat16", "--forced-routing", "--fp32-reference")
    write_result(rep, arch, "cpu_bf16")
    return arch, rep


def test_every_token_matches_hf_once_hf_takes_the_engines_experts(report):
    arch, rep = report
    forced = rep["forced_routing"]
    assert forced["moe_layers"] == MOE_LAYERS[arch]
    rows = forced["rows"]
    assert [r["layer"] for r in rows] == [f"aux {k}" for k in rep["checks"][0]["layer_ids"]] + ["last"]
    for r in rows:
        # The dense bf16 gate: every token's cosine >= 0.999 and max abs within 5 % of the states' scale.
        assert r["ok"] and r["cosine"] >= 0.999, (arch, r)
        assert r["neighbour_cosine"] < r["median_cosine"] - 0.01, (arch, r)
    # Without forcing the same states miss on some tokens: the forcing is what closes the gap.
    assert min(r["cosine"] for r in rep["checks"][0]["rows"]) < 0.999
    # Against HF in fp32 on the same experts, the engine is as close as HF's own bf16 run (the rule the GPU
    # suite holds a family to where HF's bf16 is itself far from fp32).
    assert not beyond_bf16_floor(forced["fp32_reference"]), beyond_bf16_floor(forced["fp32_reference"])


def test_forcing_keeps_hfs_own_weights_and_hfs_own_choice_differs_only_on_few_tokens(report):
    arch, rep = report
    for layer in rep["forced_routing"]["routing"]:
        assert layer["tokens"] == TOKENS, (arch, layer)
        # Where HF's router picks the forced experts itself, the forced weights are exactly its own.
        assert layer["weight_max_abs_diff"] == 0.0, (arch, layer)
        assert layer["disagreement_rate"] <= MAX_DISAGREEMENT_RATE, (arch, layer)


def _hf_run(hf, ids, forced=None):
    """HF's states for `ids` and the experts each MoE block was handed, with `forced` experts if given (None:
    HF routes itself, the forcing only recording its choice)."""
    forcing = parity.ForcedRouting(hf)
    handed, hooks = {}, []
    for name, block in hf.named_modules():
        if type(block).__name__ in HF_BLOCKS.values():
            layer = int(name.split("layers.")[1].split(".")[0])
            # After the forcing's own hook, so that it sees what the experts are handed.
            hooks.append(
                block.experts.register_forward_pre_hook(
                    lambda m, args, layer=layer: handed.__setitem__(layer, args[1].clone())
                )
            )
    try:
        forcing.set(forced)
        states = parity.hf_hidden_states(hf, ids, "cpu")
    finally:
        for h in hooks:
            h.remove()
        forcing.remove()
    return states, handed, forcing


@pytest.mark.parametrize("arch", list(HF_BLOCKS))
def test_forcing_hfs_own_choice_changes_nothing_and_another_choice_moves_that_token(arch, tiny_model_dir, tmp_path):
    model = build_model(arch, tmp_path / "m", dtype=torch.bfloat16, tokenizer_dir=tiny_model_dir)
    hf = reference.load_hf_model(str(model), "bfloat16", "cpu")
    assert {type(m).__name__ for m in hf.modules()} & set(HF_BLOCKS.values()) == {HF_BLOCKS[arch]}
    ids = np.random.default_rng(0).integers(6, 380, 24).tolist()
    own_states, own, recorded = _hf_run(hf, ids)
    # Nothing forced: HF's own run, its choice recorded as its experts were handed it.
    assert all(torch.equal(a, b) for a, b in zip(parity.hf_hidden_states(hf, ids, "cpu"), own_states)), arch
    assert recorded.own_choice.keys() == own.keys()
    assert all(torch.equal(recorded.own_choice[layer], own[layer]) for layer in own)

    # HF's own experts, forced: bit for bit HF's own run, and HF's own weights (no arithmetic added).
    states, handed, forcing = _hf_run(hf, ids, own)
    assert all(torch.equal(a, b) for a, b in zip(own_states, states)), arch
    routing = [forcing.layers[layer].to_json() for layer in sorted(own)]
    assert all(r["disagreements"] == 0 and r["weight_max_abs_diff"] == 0.0 for r in routing), routing

    # Token 9 sent elsewhere in the first MoE layer: HF's experts get that choice, the layer's output moves
    # for that token alone, and the disagreement is counted.
    first, token = min(own), 9
    moved = {layer: e.clone() for layer, e in own.items()}
    experts = hf.config.get_text_config().to_dict()
    num = next(experts[key] for key in ("num_experts", "n_routed_experts", "num_local_experts") if experts.get(key))
    moved[first][token] = torch.tensor([e for e in range(num) if e not in own[first][token]][: own[first].shape[1]])
    states, handed, forcing = _hf_run(hf, ids, moved)
    assert torch.equal(handed[first].sort(dim=-1).values, moved[first].sort(dim=-1).values)
    assert forcing.layers[first].disagreements == 1
    after = states[first + 1].float() - own_states[first + 1].float()
    assert after[token].abs().max() > 0.1 * own_states[first + 1][token].float().abs().max(), arch
    assert torch.equal(after[:token], torch.zeros_like(after[:token])), "earlier tokens cannot see a later one"


def test_experts_are_read_back_from_triton_kernels_routing():
    """GPT-OSS's default MoE runner on Hopper (triton_kernels) hands its experts no id table, only the (token,
    slot) pairs sorted by expert and each expert's count; the adapter reads the choice back from those."""
    from offline_extract.engine.moe import routed_experts
    from offline_extract.engine.sglang_adapter import prepare_process

    prepare_process("cpu")
    from sglang.srt.layers.moe.topk import TritonKernelTopKOutput

    generator = torch.Generator().manual_seed(0)
    tokens, num_experts, k = 37, 8, 3
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:k] for _ in range(tokens)])
    # As triton_kernels' reference builds them (make_bitmatrix_metadata_torch, whose histc has no CPU kernel
    # for ints): pairs numbered token * k + slot, stably sorted by expert.
    by_expert = torch.argsort(ids.flatten(), stable=True).int()
    inverse = torch.argsort(by_expert, stable=True).int()
    counts = torch.bincount(ids.flatten(), minlength=num_experts).int()
    if "routing_data" in TritonKernelTopKOutput._fields:  # SGLang 0.5.17's, on its triton_kernels
        from triton_kernels.matmul_ogs import GatherIndx, RoutingData, ScatterIndx

        routing = RoutingData(torch.zeros(tokens * k), counts, num_experts, k)
        output = TritonKernelTopKOutput(routing, GatherIndx(by_expert, inverse), ScatterIndx(inverse, by_expert))
    else:  # 0.5.23's, as its topk.routing builds it from triton_kernels' sorted indices
        ragged = SimpleNamespace(slice_sizes=counts)
        output = TritonKernelTopKOutput(ragged, by_expert // k, by_expert, torch.zeros(tokens * k), k)
    assert torch.equal(routed_experts(output), ids)
    # A runner that routes inside its kernel states no choice.
    assert routed_experts(object()) is None
