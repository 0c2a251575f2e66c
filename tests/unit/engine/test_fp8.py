"""FP8 block-quantized checkpoints on CPU: the test builder writes them as the releases are, SGLang's CPU path
is refused before the model loads, and the parity gate's FP8 rule passes what SGLang's W8A8 compute gives
while failing a layer off by one. The engine itself runs them on the GPU (tests/gpu/test_gpu_fp8.py).

SGLang's FP8 compute is reproduced here in HF, for the gate's rule only: every projection's input quantized
to e4m3 per token in groups of 128 channels (SGLang's per_token_group_quant_fp8 before each block-FP8 GEMM,
the routed experts' intermediate activations included), then multiplied in float32.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from arch_parity import FP8_OVERRIDES, LENGTHS
from extract_runs import ROOT, run_extract
from safetensors.torch import load_file

from offline_extract.engine import checkpoint, parity
from offline_extract.engine.reference import load_hf_model
from offline_extract.testing.models import FP8_QUANTIZATION_CONFIG, build_model


@pytest.fixture(scope="module")
def fp8_models(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {
        arch: build_model(
            arch, root / arch, dtype=torch.bfloat16, overrides=overrides, tokenizer_dir=tiny_model_dir, fp8=True
        )
        for arch, overrides in FP8_OVERRIDES.items()
    }


def test_checkpoint_is_written_as_the_fp8_releases_are(fp8_models):
    model = fp8_models["deepseek_v3"]
    config = json.loads((model / "config.json").read_text())
    assert config["quantization_config"] == FP8_QUANTIZATION_CONFIG
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    tensors = load_file(model / "model.safetensors")
    weight = tensors["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"]
    scale = tensors["model.layers.3.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    assert weight.dtype == torch.float8_e4m3fn and tuple(weight.shape) == (576, 256)
    assert scale.dtype == torch.float32 and tuple(scale.shape) == (5, 2)  # 576 rows: 4.5 blocks, the last partial
    for name in (
        "model.layers.3.mlp.experts.5.down_proj.weight",
        "model.layers.3.mlp.shared_experts.up_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.3.self_attn.q_b_proj.weight",
    ):
        assert tensors[name].dtype == torch.float8_e4m3fn and f"{name}_scale_inv" in tensors, name
    # Embeddings, head, norms, the router and its correction bias are left as they are.
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.3.mlp.gate.weight",
        "model.layers.3.input_layernorm.weight",
    ):
        assert tensors[name].dtype == torch.bfloat16 and f"{name}_scale_inv" not in tensors, name
    assert tensors["model.layers.3.mlp.gate.e_score_correction_bias"].dtype != torch.float8_e4m3fn


def test_dequantized_weights_are_the_bf16_weights_within_e4m3_rounding(fp8_models, tiny_model_dir, tmp_path):
    plain = load_file(
        build_model("qwen3", tmp_path / "bf16", dtype=torch.bfloat16, tokenizer_dir=tiny_model_dir)
        / "model.safetensors"
    )
    dequantized, quantized = checkpoint.dequantized_fp8_tensors(str(fp8_models["qwen3"]), torch.float32)
    assert quantized and set(dequantized) == set(plain)
    for name in quantized:
        original = plain[name].float()
        # e4m3 keeps 3 mantissa bits: at most half a step, 1/16 of a value's binade, off; within each
        # 128x128 block the largest magnitude maps to e4m3's largest, so nothing clips.
        assert ((dequantized[name] - original).abs() <= original.abs() / 16 + 1e-6).all(), name
    assert torch.equal(dequantized["model.embed_tokens.weight"], plain["model.embed_tokens.weight"].float())


def assert_cpu_refuses_before_loading(model, out, refusal):
    """bin/extract.py on CPU stops on `model` with `refusal` and the reason (no Intel AMX kernels), before any
    weight loads and with nothing written."""
    proc = run_extract(out, "--model", model, "--data", ROOT / "examples" / "corpus.jsonl", "--device", "cpu")
    assert proc.returncode != 0
    assert refusal in proc.stderr and "Intel AMX" in proc.stderr, proc.stderr[-2000:]
    assert "Loading weights" not in proc.stderr and "loading shards" not in proc.stderr.lower()
    assert not list(Path(out).glob("shard_*"))


def test_cpu_refuses_an_fp8_checkpoint_before_loading_it(fp8_models, tmp_path):
    assert_cpu_refuses_before_loading(
        fp8_models["qwen3"], tmp_path / "out", f"{fp8_models['qwen3']} is an FP8 checkpoint"
    )


def _fp8_activations(x, group=128):
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    groups = x.float().unflatten(-1, (-1, group))
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / fp8_max
    return ((groups / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn).float() * scale).flatten(-2)


def _w8a8(model, quantized):
    """Run `model`'s FP8 projections as SGLang's W8A8 GEMMs do (see the module docstring)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and f"{name}.weight" in quantized:
            module.forward = lambda x, m=module: F.linear(_fp8_activations(x), m.weight.float()).to(x.dtype)
        elif hasattr(module, "gate_up_proj"):

            def experts(hidden, index, weights, m=module):
                out = torch.zeros_like(hidden)
                for e in index.unique().tolist():
                    token, slot = torch.where(index == e)
                    gate_up = F.linear(_fp8_activations(hidden[token]), m.gate_up_proj[e].float())
                    gate, up = gate_up.to(hidden.dtype).chunk(2, -1)
                    down = F.linear(_fp8_activations(m.act_fn(gate) * up), m.down_proj[e].float()).to(hidden.dtype)
                    out.index_add_(0, token, (down * weights[token, slot, None]).to(out.dtype))
                return out

            module.forward = experts


@pytest.mark.parametrize("arch", list(FP8_OVERRIDES))
def test_fp8_gate_passes_w8a8_states_and_fails_an_off_by_one(arch, fp8_models):
    path = str(fp8_models[arch])
    reference = load_hf_model(path, "bfloat16", "cpu")
    engine_like = load_hf_model(path, "bfloat16", "cpu")
    _w8a8(engine_like, checkpoint.dequantized_fp8_tensors(path, torch.bfloat16)[1])
    moe = parity.ForcedRouting.supports(reference)
    experts: dict[int, list] = {}
    hooks = [
        block.experts.register_forward_pre_hook(
            lambda m, args, layer=int(name.split(".")[2]): experts.setdefault(layer, []).append(args[1])
        )
        for name, block in engine_like.named_modules()
        if hasattr(block, "experts") and hasattr(block, "gate")
    ]
    rng = np.random.default_rng(0)
    seqs = [rng.integers(6, 380, n).tolist() for n in LENGTHS]
    layer_ids = list(range(reference.config.num_hidden_layers - 1))
    states = []
    for i, s in enumerate(seqs):
        hs = parity.hf_hidden_states(engine_like, s, "cpu")
        states.append(
            (
                s,
                torch.cat([hs[k + 1] for k in layer_ids], dim=-1),
                hs[-1],
                {layer: ids[i] for layer, ids in experts.items()},
            )
        )
    for h in hooks:
        h.remove()
    forcing = parity.ForcedRouting(reference) if moe else None  # DeepSeek: HF takes the W8A8 run's experts
    reference_states = []
    for s, _, _, chosen in states:
        if forcing:
            forcing.set(chosen)
        reference_states.append(parity.hf_hidden_states(reference, s, "cpu"))

    def judged(early):
        pairs = (
            (aux, last, [hs[0], *hs[:-1]] if early else hs) for (_, aux, last, _), hs in zip(states, reference_states)
        )
        return parity.compare_states(pairs, layer_ids, "bfloat16", moe=moe, fp8=True)

    rows = judged(early=False)
    for r in rows:
        assert r.ok and r.median_cosine >= parity.FP8_MIN_MEDIAN_COSINE, r
    # W8A8 sits further from the dequantized weights than bf16 rounding would: the dense rule would refuse it.
    assert min(r.cosine for r in rows) < 0.999
    early = judged(early=True)
    assert not any(r.ok for r in early), [(r.layer, r.median_cosine) for r in early]
