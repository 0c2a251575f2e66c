"""MoE models in bf16 on CPU with the engine's expert choice forced onto HF (`parity.ForcedRouting`): then
every token matches as on a dense model, so what the parity gate's median rule lets through is routing
flips and nothing else (docs/moe-bf16-investigation.md). The GPU suite runs the same check
(tests/test_gpu_architectures.py)."""
import pytest
import torch
from arch_parity import run_report

from offline_extract.testing.models import build_model

# Architecture -> its MoE decoder layers: Qwen3-MoE routes in every layer; DeepSeek-V3's first two are dense,
# and its routing is the grouped top-k with the correction bias and routed_scaling_factor.
MOE_LAYERS = {"qwen3_moe": list(range(8)), "deepseek_v3": list(range(2, 8))}
TOKENS = 5 + 37 + 64  # arch_parity.LENGTHS
# Near-ties only: measured 1-7 % of tokens per layer on these checkpoints; a wrong bias, grouping or scoring
# function would send most tokens elsewhere.
MAX_DISAGREEMENT_RATE = 0.15


@pytest.fixture(scope="module", params=list(MOE_LAYERS))
def report(request, tiny_model_dir, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"routing-{arch}")
    model = build_model(arch, root / "m", dtype=torch.bfloat16, tokenizer_dir=tiny_model_dir)
    return arch, run_report(model, root / "report.json", "--dtype", "bfloat16", "--forced-routing")


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


def test_forcing_keeps_hfs_own_weights_and_hfs_own_choice_differs_only_on_few_tokens(report):
    arch, rep = report
    for layer in rep["forced_routing"]["routing"]:
        assert layer["tokens"] == TOKENS, (arch, layer)
        # Where HF's router picks the forced experts itself, the forced weights are exactly its own.
        assert layer["weight_max_abs_diff"] == 0.0, (arch, layer)
        assert layer["disagreement_rate"] <= MAX_DISAGREEMENT_RATE, (arch, layer)
