"""Every supported architecture's EAGLE-3 capture, checked two ways on CPU.

1. The id mapping against SGLang's own set_eagle3_layers_to_capture code, for every possible set of layer
   ids, on stand-ins that carry only the attributes those methods touch (in-process, fast).
2. The engine on a seeded random checkpoint against HF transformers in fp32, one process per
   architecture (SGLang allows one ModelRunner per process), through tests/arch_parity.py: SGLang's
   default ids, then ids starting at 0, at 1 and above 1, each compared with HF hidden_states[k+1].
"""

import importlib
import json
import re
from itertools import combinations
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from arch_parity import run_report, write_result
from safetensors.torch import load_file

from offline_extract.engine import parity, reference
from offline_extract.engine.distributed import free_port
from offline_extract.engine.families import FAMILIES, cpu_models, ids_for_deepseek
from offline_extract.engine.multimodal import IMAGE_MODELS
from offline_extract.engine.sglang_adapter import (
    Engine,
    EngineConfig,
    CAPTURE_RULES,
    model_capture_rule,
    prepare_process,
    resolve_capture,
    route_capture,
)
from offline_extract.testing.models import build_model


# Architecture -> (its class in SGLang, the HF-loadable model with the same weights): every family SGLang runs
# on CPU, HF loading each from its own checkpoint (Kimi-K2.5's as the DeepSeek-V3 of its text_config, as the
# product's gate does; Qwen2.5-VL's and Qwen3-VL's through HF's own vision-language classes, image chats included).
ENGINE_ARCHS = {name: (f.sglang_class, name) for name, f in cpu_models().items()}
DEEPSEEK_FAMILY = {f.sglang_class for f in FAMILIES if f.capture.ids_for_points is ids_for_deepseek}
# Starting at 0 (which deepseek_v2 must not see as a leading 1), at 1 (which it would shift) and above 1, up
# to the last capturable id; and id 0 alone, which deepseek_v2 cannot express.
LAYER_SETS = [[0, 3, 6], [1, 2], [2, 5], [0]]
# fp32 rounding grows with the states' scale, so every architecture is judged relative to it (the product's
# fp32 gate, parity.TOLERANCES). The scale reaches about 10 after a few random layers of MLA, whose CPU run
# takes the absorbed form (q W_UK)·c, the same attention in another association, and about 11 on GLM-4.5,
# whose routed scaling factor (2.5) stacks on a shared expert: up to 3.5e-5 absolute there, 2.4e-6 of the
# scale at worst, while an off-by-one lands at least 2.5 away. The bound also holds on CPUs whose GEMM
# blocking rounds otherwise (an AMD EPYC's differed from an Intel Xeon's by 3.3e-7 of the scale).
MAX_REL = 1e-5
MIN_NEIGHBOUR_GAP = 1e-2


def _stand_in_class(cls):
    return type(
        cls.__name__,
        (),
        {"set_eagle3_layers_to_capture": cls.set_eagle3_layers_to_capture, "__module__": cls.__module__},
    )


def _stand_in(cls, num_layers, decoder_cls=None):
    """What `cls`.set_eagle3_layers_to_capture touches on a loaded model, without building any weights."""
    decoder = _stand_in_class(decoder_cls)() if decoder_cls else SimpleNamespace()
    decoder.layers = [SimpleNamespace() for _ in range(num_layers)]
    decoder.layers_to_capture = []
    model = _stand_in_class(cls)()
    model.pp_group = SimpleNamespace(is_last_rank=True)
    model.config = SimpleNamespace(num_hidden_layers=num_layers)
    model.model = decoder
    model.capture_aux_hidden_states = False
    return model


# The causal LM a multimodal wrapper delegates capture to: (its sglang/srt/models file, its class).
WRAPPED_LMS = {
    "KimiK25ForConditionalGeneration": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "Llama4ForConditionalGeneration": ("llama4", "Llama4ForCausalLM"),
}


def _sglang_class(module, name):
    return getattr(importlib.import_module(f"sglang.srt.models.{module}"), name)


def _stand_ins(num_layers):
    """Every family's stand-in, by SGLang class; a decoder that keeps per-layer flags is the model file's
    `<Name>Model` beside its `<Name>ForCausalLM`."""
    prepare_process("cpu")
    stand_ins = {}
    for f in FAMILIES:
        cls = _sglang_class(f.sglang_module, f.sglang_class)
        if f.capture.language_model:
            wrapper = _stand_in_class(cls)()
            setattr(
                wrapper, f.capture.language_model, _stand_in(_sglang_class(*WRAPPED_LMS[f.sglang_class]), num_layers)
            )
            stand_ins[f.sglang_class] = wrapper
        else:
            decoder = f.sglang_class.replace("ForCausalLM", "Model") if f.capture.in_layer_flags else None
            stand_ins[f.sglang_class] = _stand_in(cls, num_layers, decoder and _sglang_class(f.sglang_module, decoder))
    return stand_ins


def test_every_rule_is_checked_here():
    assert set(_stand_ins(4)) == set(CAPTURE_RULES)


@pytest.mark.parametrize("num_layers", [8, 11])
def test_every_id_set_reaches_the_next_layers_input_through_sglangs_own_method(num_layers, monkeypatch):
    prepare_process("cpu")
    # minimax_m2 asks the process-wide pipeline group, not the model, whether it is the last stage: SGLang 0.5.17
    # through get_pp_group(), 0.5.23 through get_parallel().pp_group.
    last = SimpleNamespace(is_last_rank=True)
    minimax = importlib.import_module("sglang.srt.models.minimax_m2")
    if hasattr(minimax, "get_pp_group"):
        monkeypatch.setattr(minimax, "get_pp_group", lambda: last)
    else:
        monkeypatch.setattr(minimax, "get_parallel", lambda: SimpleNamespace(pp_group=last))
    for name, model in _stand_ins(num_layers).items():
        rule = model_capture_rule(model)
        # SGLang's default, as its model files write it: the inputs of layers [2, N//2, N-3].
        assert resolve_capture(model, rule, None) == [2, num_layers // 2, num_layers - 3], name
        # The same stand-in throughout, so flags left over from an earlier set would show.
        for r in range(1, num_layers):
            for ids in combinations(range(num_layers - 1), r):
                points = [k + 1 for k in ids]
                if name in DEEPSEEK_FAMILY and points == [1]:
                    with pytest.raises(ValueError, match="layer id 0 alone"):
                        resolve_capture(model, rule, points)
                    continue
                assert resolve_capture(model, rule, points) == points, (name, ids)
        lm = rule.causal_lm(model)
        route_capture(lm, rule, [])
        assert rule.captured_points(model) == [] and not lm.capture_aux_hidden_states, name
        assert not any(getattr(layer, "_is_layer_to_capture", False) for layer in lm.model.layers), name


def test_a_model_file_without_eagle3_capture_is_refused_with_the_reason():
    prepare_process("cpu")
    from sglang.srt.models.mixtral import MixtralForCausalLM

    with pytest.raises(
        NotImplementedError,
        match=r"MixtralForCausalLM \(/m/mixtral\).*sglang\.srt\.models\.mixtral "
        r"defines no set_eagle3_layers_to_capture",
    ):
        model_capture_rule(object.__new__(MixtralForCausalLM), "/m/mixtral")  # never built: only its type counts
    from sglang.srt.models.apertus import ApertusForCausalLM

    # It has a convention, but what it captures is not the layer's output.
    from sglang.srt.models.gemma3_causal import Gemma3ForCausalLM

    with pytest.raises(NotImplementedError, match=r"Gemma3ForCausalLM .* not supported: .* without the residual"):
        model_capture_rule(_stand_in_class(Gemma3ForCausalLM)())
    # It can capture, but its convention is not one verified here.
    with pytest.raises(NotImplementedError, match="ApertusForCausalLM .* not supported"):
        model_capture_rule(_stand_in_class(ApertusForCausalLM)())


def test_gpt_oss_reference_is_hfs_eager_attention_with_the_sinks_in_play(tiny_model_dir, tmp_path):
    # SGLang runs GPT-OSS on GPU attention backends only (docs/supported-models.md), so its parity is in the GPU
    # suite; this is the HF side of it, which transformers implements in eager attention alone.
    model = reference.load_hf_model(
        str(build_model("gpt_oss", tmp_path / "m", tokenizer_dir=tiny_model_dir)), "float32", "cpu"
    )
    assert model.config._attn_implementation == "eager"
    ids = list(range(6, 70))
    with_sinks = parity.hf_hidden_states(model, ids, "cpu")
    for layer in model.model.layers:
        layer.self_attn.sinks.data.fill_(float("-inf"))
    without = parity.hf_hidden_states(model, ids, "cpu")
    # The test model's sinks move every layer's output well beyond any bf16 tolerance.
    assert min((a - b).abs().max().item() for a, b in zip(with_sinks[1:], without[1:])) > 0.1


def test_qwen3_next_is_refused_on_cpu_with_the_reason(tiny_model_dir, tmp_path):
    # Refused from the config, before any weight is loaded; its parity runs in the GPU suite.
    model = build_model("qwen3_next", tmp_path / "m", tokenizer_dir=tiny_model_dir, weights=False)
    with pytest.raises(NotImplementedError, match=r"Qwen3NextForCausalLM .* CPU path: .*sgl_kernel\.mamba"):
        Engine(EngineConfig(model_path=str(model), device="cpu", dtype="float32", nccl_port=free_port()))


@pytest.mark.parametrize("arch, reason", [("minimax_m2", "CUDA tensors"), ("qwen2_moe", "Triton kernel")])
def test_an_architecture_sglang_cannot_run_on_cpu_is_refused_with_the_reason(arch, reason, tiny_model_dir, tmp_path):
    model = build_model(arch, tmp_path / "m", tokenizer_dir=tiny_model_dir, weights=False)
    with pytest.raises(NotImplementedError, match=rf"ForCausalLM .* CPU path: .*{reason}"):
        Engine(EngineConfig(model_path=str(model), device="cpu", dtype="float32", nccl_port=free_port()))


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return {a: build_model(a, root / a, tokenizer_dir=tiny_model_dir) for a in ENGINE_ARCHS}


def test_a_wrapped_checkpoint_holds_exactly_its_text_models_weights(tiny_model_dir, tmp_path):
    wrapped_dir, text_dir = (
        build_model(a, tmp_path / a, tokenizer_dir=tiny_model_dir) for a in ("kimi_k25", "kimi_k2")
    )
    wrapped = load_file(wrapped_dir / "model.safetensors")
    plain = load_file(text_dir / "model.safetensors")
    assert set(wrapped) == {f"language_model.{k}" for k in plain}
    assert all(torch.equal(wrapped[f"language_model.{k}"], v) for k, v in plain.items())
    assert json.loads((wrapped_dir / "config.json").read_text())["text_config"] == json.loads(
        (text_dir / "config.json").read_text()
    )


def test_llama4_is_refused_where_sglang_cannot_run_its_chunked_attention(tiny_model_dir, tmp_path):
    # Refused from the config, before any weight is loaded: only fa3 has Llama 4's chunked attention.
    model = build_model("llama4", tmp_path / "m", tokenizer_dir=tiny_model_dir, weights=False)
    with pytest.raises(NotImplementedError, match=r"attention_chunk_size=16.*only in the fa3 .* on torch_native"):
        Engine(EngineConfig(model_path=str(model), device="cpu", dtype="float32", nccl_port=free_port()))


@pytest.fixture(scope="module", params=list(ENGINE_ARCHS))
def report(request, models, tmp_path_factory):
    arch = request.param
    rep = run_report(
        models[arch],
        tmp_path_factory.mktemp(f"report-{arch}") / "report.json",
        "--hf-reference",
        str(models[ENGINE_ARCHS[arch][1]]),
        "--layer-sets",
        ";".join(",".join(map(str, s)) for s in LAYER_SETS),
    )
    write_result(rep, arch, "cpu")
    return arch, rep


def test_a_moe_models_warm_up_covers_every_token_count_class_of_its_expert_kernels(report):
    arch, rep = report
    counts = rep["warm_up_token_counts"]
    assert "error" not in rep, rep.get("traceback")
    if not rep["is_moe"]:
        assert counts == [], "a dense model's warm-up is its one batch"
        return
    # Each launch config from the smallest M that takes it, at each power of two up to 16 dividing M.
    assert counts == sorted(set(counts)) and counts[:4] == [1, 2, 3, 4] and counts[-1] <= 1024, counts
    assert {min(m & -m, 16) for m in counts} == {1, 2, 4, 8, 16}


def test_a_moe_model_on_triton_kernels_prebuilds_its_routing_as_its_top_k_calls_it(report):
    """The routing the GPU's warm-up compiles ahead (`moe.triton_kernels_routing`; GPT-OSS's runner on
    Hopper, whose SGLang model has no CPU path): on SGLang's CPU path none; with the triton_kernels runner,
    the config's routed experts and top-k, softmax first where the model does not renormalize the k chosen
    (SGLang's TopK takes norm_topk_prob as renormalize), in the engine's dtype, on Qwen3-MoE at least; a
    dense model never."""
    arch, rep = report
    assert "error" not in rep, rep.get("traceback")
    routing = rep["triton_kernels_routing"]
    assert routing["chosen"] is None, routing
    if not rep["is_moe"]:
        assert routing["forced"] is None, routing
        return
    config = json.loads((Path(rep["model"]) / "config.json").read_text())
    text = config.get("text_config", config)
    experts = next(text[k] for k in ("num_experts", "n_routed_experts", "num_local_experts") if text.get(k))
    expected = {
        "experts": experts,
        "top_k": text["num_experts_per_tok"],
        "sm_first": not text.get("norm_topk_prob", True),
        "dtype": "float32",
    }
    # A model whose TopK names its own output format (DeepSeek-V3's) never routes through triton_kernels.
    assert routing["forced"] == expected or (arch != "qwen3_moe" and routing["forced"] is None), routing


def test_the_qk_norm_module_is_prebuilt_where_the_loaded_model_asks_for_it(report):
    """What the start-up reads from the family table and the config before the weights load
    (`kernel_shapes(...).qk_norm`) is what the loaded model's attention hands SGLang's QK-norm in its forwards:
    the model's head size in its dtype, or nothing (Qwen3, Qwen3-MoE, GLM-4.5 and Qwen3-VL ask; Llama asks
    nothing)."""
    arch, rep = report
    assert "error" not in rep, rep.get("traceback")
    shapes = rep["qk_norm_shapes"]
    assert rep["qk_norm_asked"] == ([[shapes["head_dim"], shapes["dtype"]]] if shapes["qk_norm"] else [])


def test_runs_the_expected_sglang_class(report):
    arch, rep = report
    assert rep["architecture"] == ENGINE_ARCHS[arch][0]
    assert rep["attention_backend"] == "torch_native"


def test_default_layer_ids_are_sglangs_eagle3_default(report):
    _, rep = report
    n, default = rep["num_layers"], rep["checks"][0]
    assert default["requested"] is None
    # Every supported model file defaults to capture points [2, N//2, N-3]: outputs of [1, N//2-1, N-4].
    assert default["layer_ids"] == [1, n // 2 - 1, n - 4]
    assert default["capture_points"] == [2, n // 2, n - 3]
    assert len(set(default["layer_ids"])) == 3


def test_capture_points_are_the_layer_ids_plus_one(report):
    arch, rep = report
    requested = [c for c in rep["checks"] if c["requested"] is not None]
    assert [c["requested"] for c in requested] == LAYER_SETS
    for c in requested:
        if ENGINE_ARCHS[arch][0] in DEEPSEEK_FAMILY and c["requested"] == [0]:
            assert "layer id 0 alone cannot be captured" in c["error"]
            continue
        assert c["layer_ids"] == sorted(c["requested"])
        assert c["capture_points"] == [k + 1 for k in c["layer_ids"]]


def test_every_state_matches_hf_in_fp32(report):
    arch, rep = report
    compared = [c for c in rep["checks"] if "rows" in c]
    assert len(compared) >= 4
    for c in compared:
        rows = {r["layer"]: r for r in c["rows"]}
        assert list(rows) == [f"aux {k}" for k in c["layer_ids"]] + ["last"]
        for name, r in rows.items():
            where = f"{arch} ids {c['layer_ids']} {name} vs HF hidden_states[{r['hf_index']}]"
            assert r["max_rel"] <= MAX_REL, where
            # HF's neighbouring states are far off, so a state taken one layer early or late cannot pass.
            # (A "last" taken before the final norm fails the tolerance itself: the norm rescales it.)
            assert r["neighbour_gap"] > MIN_NEIGHBOUR_GAP, where
        assert rows["last"]["hf_index"] == rep["num_layers"]
    # The gate itself rejects every state compared one layer early.
    assert not any(r["ok"] for r in rep["checks"][0]["off_by_one_rows"]), arch


def test_image_chats_match_hfs_vision_language_class_in_fp32(report):
    arch, rep = report
    checked = [c for c in rep["checks"] if "images" in c]
    if ENGINE_ARCHS[arch][0] not in IMAGE_MODELS:
        assert checked == [], arch
        return
    # SGLang's vision tower runs on CPU through torch's SDPA (layers/attention/vision.py's platform default).
    assert rep["vision_attention"] == ["sdpa"]
    assert len(checked) == len([c for c in rep["checks"] if "rows" in c])
    for c in checked:
        images = c["images"]
        # 28x56 pixels: 2 tokens; 56x56 and 28x28: 4 and 1 (14-pixel patches merged 2 x 2).
        assert images["image_tokens"] == [2, 5]
        for kind in ("rows", "image_token_rows"):
            for r in images[kind]:
                where = f"{arch} ids {c['layer_ids']} {kind} {r['layer']} vs HF hidden_states[{r['hf_index']}]"
                assert r["max_rel"] <= MAX_REL and r["neighbour_gap"] > MIN_NEIGHBOUR_GAP, where
    assert not any(r["ok"] for r in checked[0]["images"]["off_by_one_rows"]), arch
    assert re.match(
        r"a sequence with images of \d{4} tokens exceeds one forward's budget of 1024 tokens", rep["image_over_budget"]
    )


def test_bare_prefill_turns_capture_off_and_back_on(report):
    _, rep = report
    assert rep["bare_prefill_returned"] is False
    assert rep["recapture_max_abs"] == 0.0
