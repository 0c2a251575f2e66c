"""Every supported architecture in bf16 on CUDA against HF transformers, on SGLang's triton and flashinfer
attention backends, neither of which needs a FlashAttention-3 build (MLA included), and every MoE family
also on fa3, the default on Hopper; except where SGLang supports only some backends for an architecture
(ARCH_BACKENDS: GPT-OSS's sinks, Llama 4's chunked attention). MoE models are compared against HF routed to
the experts the engine chose (tests/arch_parity.py --forced-routing), as --verify does, and against HF in
fp32 on those experts, which shows how far bf16 arithmetic alone moves each family.

One process per (architecture, backend), through tests/arch_parity.py. With OFFLINE_EXTRACT_RESULTS set,
each run's parity rows (and, for MoE models, the forced-routing rows, routing disagreements and the fp32
comparison) are written to $OFFLINE_EXTRACT_RESULTS/<architecture>-<backend>.json with the command that ran
them. `-m "gpu and moe"` selects the MoE part.
"""

import pytest
import torch
from arch_parity import beyond_bf16_floor, run_report, write_result

from offline_extract.engine.families import FAMILIES
from offline_extract.engine.parity import MOE_HALF_MIN_MEDIAN_COSINE
from offline_extract.testing.models import VISION_LANGUAGE, build_model

pytestmark = pytest.mark.gpu

# Every family, with its config overrides: the tiny Llama's head dim 16 has no FlashInfer kernel, so it gets 64
# (test_gpu.py covers the 8B shape through the CLI). HF loads each from the same checkpoint SGLang runs, as the
# product's --verify does (the vision-language ones, Llama 4's on fa3 among them, as HF's own class with the tower).
GPU_OVERRIDES = {"llama": {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}}
GPU_MODELS = {f.name: GPU_OVERRIDES.get(f.name, {}) for f in FAMILIES}
# Every mixture-of-experts family whose HF routing can be forced (Llama 4's top-1 MoE runs without a forceable
# HF block and is held to the dense rule, which it passes).
MOE_ARCHS = {f.name for f in FAMILIES if f.routing}
BACKENDS = ["triton", "flashinfer"]
MOE_BACKENDS = BACKENDS + ["fa3"]
# Where SGLang runs a family on some backends only (GPT-OSS's sinks; Llama 4's chunked attention, fa3 alone, so
# it needs FA3 installed).
ARCH_BACKENDS = {f.name: list(f.gpu_backends) for f in FAMILIES if f.gpu_backends}
LAYER_SETS = "0,3,6;2,5"
MIN_COSINE = 0.999


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    """Architecture -> its checkpoint, built on first use: a run of a few architectures builds only theirs."""
    root, built = tmp_path_factory.mktemp("gpu-archs"), {}

    def model(name):
        if name not in built:
            built[name] = build_model(
                name,
                root / name,
                dtype=torch.bfloat16,
                device="cuda",
                overrides=GPU_MODELS[name],
                tokenizer_dir=tiny_model_dir,
            )
            torch.cuda.empty_cache()  # the engines run in other processes and size their pools by free memory
        return built[name]

    return model


def backends(arch):
    return ARCH_BACKENDS.get(arch, MOE_BACKENDS if arch in MOE_ARCHS else BACKENDS)


_REPORTS: dict = {}  # (arch, backend) -> report: one engine run serves both fixtures below


def _report(arch, backend, models, tmp_path_factory) -> dict:
    if (arch, backend) in _REPORTS:
        return _REPORTS[arch, backend]
    out = tmp_path_factory.mktemp(f"{arch}-{backend}") / "report.json"
    rep = run_report(
        models(arch),
        out,
        "--hf-reference",
        str(models(arch)),
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--attention-backend",
        backend,
        "--layer-sets",
        LAYER_SETS,
        *(["--forced-routing", "--fp32-reference"] if arch in MOE_ARCHS else []),
    )
    write_result(rep, arch, backend)
    _REPORTS[arch, backend] = rep
    return rep


def _params(archs):
    """(architecture, backend) pairs, the MoE ones marked `moe` so that scripts pick either half with -m."""
    return [
        pytest.param((a, b), id=f"{a}-{b}", marks=[pytest.mark.moe] if a in MOE_ARCHS else [])
        for a in archs
        for b in backends(a)
    ]


@pytest.fixture(scope="module", params=_params(GPU_MODELS))
def report(request, models, tmp_path_factory):
    arch, backend = request.param
    return arch, backend, _report(arch, backend, models, tmp_path_factory)


@pytest.fixture(scope="module", params=_params(sorted(MOE_ARCHS)))
def moe_report(request, models, tmp_path_factory):
    arch, backend = request.param
    return arch, backend, _report(arch, backend, models, tmp_path_factory)


def test_runs_on_the_requested_backend(report):
    _, backend, rep = report
    assert rep["attention_backend"] == backend


def test_layer_convention(report):
    _, _, rep = report
    n = rep["num_layers"]
    default = rep["checks"][0]
    assert default["layer_ids"] == [1, n // 2 - 1, n - 4]
    assert default["capture_points"] == [2, n // 2, n - 3]
    for check in rep["checks"][1:]:
        assert check["layer_ids"] == sorted(check["requested"])
        assert check["capture_points"] == [k + 1 for k in check["layer_ids"]]


def test_every_state_matches_hf_in_bf16(report):
    arch, backend, rep = report
    for check in rep["checks"]:
        rows = {r["layer"]: r for r in check["rows"]}
        assert list(rows) == [f"aux {k}" for k in check["layer_ids"]] + ["last"]
        for name, r in rows.items():
            where = f"{arch}/{backend} {name} vs HF hidden_states[{r['hf_index']}]: {r}"
            # The typical token is far closer to its HF state than to the neighbouring one.
            assert r["neighbour_cosine"] < r["median_cosine"] - 0.01, where
            if arch not in MOE_ARCHS:
                # The product's own gate on every token, and stricter than it on the median.
                assert r["ok"] and r["median_cosine"] >= MIN_COSINE, where
        if arch in MOE_ARCHS:
            # The product's gate as --verify applies it to a MoE model: HF on the engine's experts, the median
            # token (test_moe_matches_every_token_with_the_engines_routing holds every token). Unforced, tokens
            # after a routing flip differ far more, and the flips move the median of GPT-OSS's and Qwen3-Next's
            # deep layers below 0.995 (H200, 2026-11-30).
            forced = check["forced_rows"] if check["requested"] else rep["forced_routing"]["rows"]
            for r in forced:
                assert r["median_cosine"] >= MOE_HALF_MIN_MEDIAN_COSINE, f"{arch}/{backend} forced {r['layer']}: {r}"


def test_the_qk_norm_module_is_prebuilt_where_the_cuda_forwards_ask_for_it(report):
    """On CUDA, SGLang's QK-norm compiles a module per (head size, dtype) on its first call: what the start-up
    prebuilds (`kernel_shapes(...).qk_norm`) is what every backend's forwards hand it, or nothing is asked."""
    arch, backend, rep = report
    shapes = rep["qk_norm_shapes"]
    assert rep["qk_norm_asked"] == ([[shapes["head_dim"], shapes["dtype"]]] if shapes["qk_norm"] else []), arch


def test_image_chats_match_hf_in_bf16(report):
    arch, backend, rep = report
    checked = [c for c in rep["checks"] if "images" in c]
    assert bool(checked) == (arch in VISION_LANGUAGE), arch
    for check in checked:
        for kind in ("rows", "image_token_rows"):
            for r in check["images"][kind]:
                where = f"{arch}/{backend} ids {check['layer_ids']} {kind} {r['layer']}: {r}"
                assert r["ok"] and r["median_cosine"] >= MIN_COSINE, where
                assert r["neighbour_cosine"] < r["median_cosine"] - 0.01, where


def test_moe_matches_every_token_with_the_engines_routing(moe_report):
    arch, backend, rep = moe_report
    forced = rep["forced_routing"]
    floor = {r["layer"]: r for r in forced["fp32_reference"]["hf_bf16_rows"]}
    rows = [*forced["rows"], *(r for check in rep["checks"][1:] for r in check.get("forced_rows", []))]
    for r in rows:
        # The dense bf16 gate on every token, with HF sent to the experts SGLang's CUDA top-k chose (DeepSeek:
        # grouped top-k with e_score_correction_bias, weights scaled by routed_scaling_factor), wherever HF's
        # own bf16 run is itself that close to fp32 on those experts; where it is not (bf16 alone moves the
        # model further), the bf16 floor below holds the engine instead.
        if r["layer"] not in floor or floor[r["layer"]]["cosine"] >= MIN_COSINE:
            assert r["ok"] and r["cosine"] >= MIN_COSINE, f"{arch}/{backend} forced routing: {r}"
    # Against HF in fp32 on the same experts, the engine's bf16 states are about as close as HF's own bf16.
    assert not beyond_bf16_floor(forced["fp32_reference"]), (arch, backend, beyond_bf16_floor(forced["fp32_reference"]))
    for layer in forced["routing"]:
        # SGLang's own choice differs from HF's only on near-ties (a few %), and where they agree the forced
        # weights are HF's own.
        assert layer["disagreement_rate"] <= 0.15 and layer["weight_max_abs_diff"] <= 1e-6, f"{arch}/{backend}: {layer}"


def test_bare_prefill_turns_capture_off_and_back_on(report):
    _, _, rep = report
    assert rep["bare_prefill_returned"] is False
    # Same inputs, same kernels: capture after a bare prefill reproduces the states within HF's own tolerance.
    assert rep["recapture_max_abs"] <= max(r["max_abs"] for r in rep["checks"][0]["rows"])
