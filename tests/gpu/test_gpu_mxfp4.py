"""GPT-OSS as it ships, MXFP4 experts, on CUDA through SGLang 0.5.17's MXFP4 path (on Hopper the triton_kernels
MoE runner: MXFP4 weights upcast inside the kernel, bf16 activations), against HF on the dequantized weights
with HF sent to the engine's experts: the bf16 MoE rules, since the engine computes on exactly those weights.
Then `bin/extract.py --verify` as users run it (default backend), which records the quantization in the
shards and the manifest.

With OFFLINE_EXTRACT_RESULTS set, the rows go to $OFFLINE_EXTRACT_RESULTS/mxfp4-gpt_oss-<backend>.json with
the command that ran them (arch_parity.write_result).
"""

import json

import pytest
import torch
from arch_parity import beyond_bf16_floor, run_report, write_result
from extract_runs import ROOT, run_extract, succeeded

from offline_extract.engine.parity import MOE_HALF_MIN_MEDIAN_COSINE
from offline_extract.store.index import shard_paths
from offline_extract.store.shard import open_shard
from offline_extract.testing.models import MXFP4_QUANTIZATION_CONFIG, build_model

pytestmark = pytest.mark.gpu

MIN_COSINE = 0.999


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory):
    built = build_model(
        "gpt_oss",
        tmp_path_factory.mktemp("gpu-mxfp4") / "gpt_oss",
        dtype=torch.bfloat16,
        device="cuda",
        tokenizer_dir=tiny_model_dir,
        mxfp4=True,
    )
    torch.cuda.empty_cache()  # the engines run in other processes and size their pools by free memory
    return built


@pytest.fixture(scope="module", params=["triton", "fa3"])
def report(request, model, tmp_path_factory):
    backend = request.param
    rep = run_report(
        model,
        tmp_path_factory.mktemp(f"mxfp4-{backend}") / "report.json",
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--attention-backend",
        backend,
        "--forced-routing",
        "--fp32-reference",
    )
    write_result(rep, "mxfp4-gpt_oss", backend)
    return backend, rep


def test_sglang_runs_the_experts_through_its_mxfp4_path(report):
    _, rep = report
    assert rep["quantization"] == MXFP4_QUANTIZATION_CONFIG
    assert rep["expert_methods"] == ["Mxfp4MoEMethod"], rep["expert_methods"]


def test_mxfp4_states_match_hf_on_the_dequantized_weights_with_the_engines_experts(report):
    backend, rep = report
    forced = rep["forced_routing"]
    floor = {r["layer"]: r for r in forced["fp32_reference"]["hf_bf16_rows"]}
    for r in forced["rows"]:
        assert r["median_cosine"] >= MOE_HALF_MIN_MEDIAN_COSINE, f"mxfp4/{backend}: {r}"
        assert r["neighbour_cosine"] < r["median_cosine"] - 0.01, f"mxfp4/{backend}: {r}"
        if floor[r["layer"]]["cosine"] >= MIN_COSINE:
            assert r["cosine"] >= MIN_COSINE, f"mxfp4/{backend}: {r}"
    assert not beyond_bf16_floor(forced["fp32_reference"]), beyond_bf16_floor(forced["fp32_reference"])
    assert not any(r["ok"] for r in forced["off_by_one_rows"]), forced["off_by_one_rows"]
    for layer in forced["routing"]:
        assert layer["disagreement_rate"] <= 0.15 and layer["weight_max_abs_diff"] <= 1e-6, layer


def test_extract_verifies_the_mxfp4_checkpoint_and_records_its_quantization(model, tmp_path):
    out = tmp_path / "out"
    succeeded(
        run_extract(out, "--model", model, "--data", ROOT / "examples" / "corpus.jsonl", "--verify", "8", timeout=900)
    )
    run = open_shard(shard_paths(out)[0]).run
    assert run.quantization == MXFP4_QUANTIZATION_CONFIG and run.compute_dtype == "bfloat16"
    assert run.parity and all(r["ok"] for r in run.parity), run.parity
    assert [layer["layer"] for layer in run.parity_routing] == list(range(8)), run.parity_routing
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["identity"]["quantization"] == MXFP4_QUANTIZATION_CONFIG
