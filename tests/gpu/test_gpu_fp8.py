"""FP8 block-quantized checkpoints on CUDA through SGLang's FP8 path: a dense Qwen3 and a DeepSeek-V3 (MLA +
MoE), each against HF on the dequantized weights (DeepSeek with HF on the engine's experts) under the
parity gate's FP8 rule, which must reject the same states compared one layer off; and `bin/extract.py
--verify` on the DeepSeek checkpoint, which records the quantization in the shards and the manifest.

With OFFLINE_EXTRACT_RESULTS set, each model's rows are written to $OFFLINE_EXTRACT_RESULTS/fp8-<arch>.json
with the command that ran them.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from arch_parity import FP8_OVERRIDES, run_report
from extract_runs import ROOT, run_extract, succeeded

from offline_extract.engine.parity import FP8_MIN_MEDIAN_COSINE
from offline_extract.store.index import shard_paths
from offline_extract.store.shard import open_shard
from offline_extract.testing.models import FP8_QUANTIZATION_CONFIG, build_model

pytestmark = pytest.mark.gpu

MOE = {"deepseek_v3"}


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-fp8")
    built = {
        arch: build_model(
            arch,
            root / arch,
            dtype=torch.bfloat16,
            device="cuda",
            overrides=overrides,
            tokenizer_dir=tiny_model_dir,
            fp8=True,
        )
        for arch, overrides in FP8_OVERRIDES.items()
    }
    torch.cuda.empty_cache()  # the engines run in other processes and size their pools by free memory
    return built


@pytest.fixture(scope="module", params=list(FP8_OVERRIDES))
def report(request, models, tmp_path_factory):
    arch = request.param
    out = tmp_path_factory.mktemp(f"fp8-{arch}") / "report.json"
    rep = run_report(
        models[arch],
        out,
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--attention-backend",
        "triton",
        *(["--forced-routing"] if arch in MOE else []),
    )
    results = os.environ.get("OFFLINE_EXTRACT_RESULTS")
    if results:
        Path(results).mkdir(parents=True, exist_ok=True)
        (Path(results) / f"fp8-{arch}.json").write_text(
            json.dumps({"command": " ".join(["python -m pytest", *sys.argv[1:]]), "report": rep}, indent=2) + "\n"
        )
    return arch, rep


def test_sglang_loads_the_checkpoint_as_fp8(report):
    _, rep = report
    assert rep["quantization"] == FP8_QUANTIZATION_CONFIG


def test_fp8_states_pass_the_gate_and_fail_it_one_layer_off(report):
    arch, rep = report
    # The gate's reference: HF on the engine's experts for the MoE model, HF as it routes for the dense one.
    judged = rep["forced_routing"] if arch in MOE else rep["checks"][0]
    for r in judged["rows"]:
        assert r["ok"] and r["median_cosine"] >= FP8_MIN_MEDIAN_COSINE, f"{arch}: {r}"
        assert r["neighbour_cosine"] < r["median_cosine"] - 0.01, f"{arch}: {r}"
    early = judged["off_by_one_rows"]
    assert early and not any(r["ok"] for r in early), f"{arch} one layer off: {early}"


def test_extract_verifies_an_fp8_moe_checkpoint_and_records_its_quantization(models, tmp_path):
    out = tmp_path / "out"
    succeeded(
        run_extract(
            out,
            "--model",
            models["deepseek_v3"],
            "--data",
            ROOT / "examples" / "corpus.jsonl",
            "--verify",
            "8",
            "--attention-backend",
            "triton",
            timeout=900,
        )
    )
    run = open_shard(shard_paths(out)[0]).run
    assert run.quantization == FP8_QUANTIZATION_CONFIG and run.compute_dtype == "bfloat16"
    assert run.parity and all(r["ok"] for r in run.parity), run.parity
    # HF was sent to the engine's experts on every MoE layer (2..7), and where its own router agreed, the
    # weights it computed for them were its own.
    routing = run.parity_routing
    assert [layer["layer"] for layer in routing] == list(range(2, 8))
    assert all(layer["tokens"] > 0 and layer["weight_max_abs_diff"] <= 1e-6 for layer in routing), routing
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["identity"]["quantization"] == FP8_QUANTIZATION_CONFIG
