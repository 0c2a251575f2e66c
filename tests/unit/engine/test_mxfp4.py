"""GPT-OSS as it ships: MXFP4 experts. The test builder writes the released layout, HF transformers' own MXFP4
reader gives exactly the weights the parity gate's reference uses, those are the bf16 weights within e2m1
rounding, and the CPU refuses the checkpoint by name before loading it. The engine runs it on the GPU through
SGLang's MXFP4 path (tests/gpu/test_gpu_mxfp4.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from test_fp8 import assert_cpu_refuses_before_loading

from offline_extract.engine import checkpoint, parity, reference
from offline_extract.testing.models import MXFP4_QUANTIZATION_CONFIG, build_model


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    return {
        name: build_model("gpt_oss", root / name, dtype=torch.bfloat16, tokenizer_dir=tiny_model_dir, mxfp4=mxfp4)
        for name, mxfp4 in (("bf16", False), ("mxfp4", True))
    }


def test_checkpoint_is_laid_out_as_the_gpt_oss_releases_are(checkpoints):
    config = json.loads((checkpoints["mxfp4"] / "config.json").read_text())
    assert config["quantization_config"] == MXFP4_QUANTIZATION_CONFIG
    tensors = load_file(checkpoints["mxfp4"] / "model.safetensors")
    plain = load_file(checkpoints["bf16"] / "model.safetensors")
    experts, hidden, inter = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    prefix = "model.layers.0.mlp.experts."
    shapes = {
        "gate_up_proj_blocks": ((experts, 2 * inter, hidden // 32, 16), torch.uint8),
        "gate_up_proj_scales": ((experts, 2 * inter, hidden // 32), torch.uint8),
        "gate_up_proj_bias": ((experts, 2 * inter), torch.bfloat16),
        "down_proj_blocks": ((experts, hidden, inter // 32, 16), torch.uint8),
        "down_proj_scales": ((experts, hidden, inter // 32), torch.uint8),
        "down_proj_bias": ((experts, hidden), torch.bfloat16),
    }
    assert {name: (tuple(tensors[prefix + name].shape), tensors[prefix + name].dtype) for name in shapes} == shapes
    # Only the experts' projections change; attention (sinks included), router, embeddings and head stay bf16.
    assert set(tensors) - set(plain) == {
        f"model.layers.{i}.mlp.experts.{p}_{part}"
        for i in range(8)
        for p in ("gate_up_proj", "down_proj")
        for part in ("blocks", "scales")
    }
    for name in set(plain) & set(tensors):
        assert torch.equal(tensors[name], plain[name]), name


def test_hfs_own_mxfp4_reader_gives_the_references_weights_which_are_the_bf16_ones_within_e2m1_rounding(checkpoints):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    raw = load_file(checkpoints["mxfp4"] / "model.safetensors")
    plain = load_file(checkpoints["bf16"] / "model.safetensors")
    dequantized, quantized = checkpoint.dequantized_mxfp4_tensors(str(checkpoints["mxfp4"]), torch.float32)
    assert set(dequantized) == set(plain) and len(quantized) == 16
    for name in quantized:
        # transformers' reader of the released checkpoints, on the same bytes.
        theirs = convert_moe_packed_tensors(raw[f"{name}_blocks"], raw[f"{name}_scales"], dtype=torch.float32)
        assert torch.equal(dequantized[name], theirs), name
        # e2m1 rounds to the nearest of 0, .5, 1, 1.5, 2, 3, 4, 6 times the block's scale: at most a quarter of
        # the value off, or a quarter of the scale near zero; the scale puts the block's largest at or below 6.
        original = plain[name].float()
        scale = torch.exp2(raw[f"{name}_scales"].float() - 127).repeat_interleave(32, dim=-1).transpose(1, 2)
        assert ((dequantized[name] - original).abs() <= original.abs() / 4 + scale / 4).all(), name
        assert (original.abs() <= 6 * scale).all(), name


def test_cpu_refuses_an_mxfp4_checkpoint_by_name_before_loading_it(checkpoints, tmp_path):
    # Before SGLang's own GPT-OSS check (attention backends with sinks) could speak.
    assert_cpu_refuses_before_loading(
        checkpoints["mxfp4"], tmp_path / "out", f"{checkpoints['mxfp4']} is an MXFP4 checkpoint"
    )


def test_the_gates_reference_is_hfs_plain_gpt_oss_on_the_dequantized_experts(checkpoints):
    hf = reference.load_hf_model(str(checkpoints["mxfp4"]), "bfloat16", "cpu")
    dequantized, quantized = checkpoint.dequantized_mxfp4_tensors(str(checkpoints["mxfp4"]), torch.bfloat16)
    params = dict(hf.named_parameters())
    # HF's own GPT-OSS experts (no MXFP4 kernels), holding exactly the dequantized weights; nothing quantized left.
    assert {type(m).__name__ for m in hf.modules()} >= {"GptOssExperts", "GptOssMLP"}
    assert not hasattr(hf.config, "quantization_config")
    assert all(torch.equal(params[name], dequantized[name]) for name in quantized)
    assert parity.ForcedRouting.supports(hf)
