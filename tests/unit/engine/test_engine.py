"""The SGLang adapter on CPU against HF transformers on the same weights (fp32, the embedded tiny Llama).

SGLang allows one ModelRunner per process, so every test here shares one engine.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from extract_runs import ROOT

from offline_extract.data.images import Images
from offline_extract.engine import parity, reference
from offline_extract.engine.moe import moe_token_counts
from offline_extract.engine.sglang_adapter import Engine, EngineConfig, capture_rule, validate_layer_ids


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return reference.load_hf_model(str(tiny_model_dir), "float32", "cpu")


def _max_diff_over_scale(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Float32 rounding scales with the values, so the difference is stated relative to the expected states'
    largest magnitude (about 7 on the tiny model). Two stacks, or two batch shapes, differ there by a few
    float32 steps, more or fewer with the CPU's GEMM blocking (2.4e-6 absolute, 3.3e-7 relative, on an AMD
    EPYC); a layer off by one by 1e-2 or more."""
    return ((actual - expected).abs().max() / expected.abs().max()).item()


# Two stacks (SGLang against HF, chunked against one pass) agree to this much of the states' scale.
FP32_REL = 1e-5
# One engine against itself with other batch neighbours: the same kernels, summed in other blocks; 16 float32
# steps of the largest value.
SAME_STACK_REL = 16 * torch.finfo(torch.float32).eps


def _seqs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(6, 380, n).astype(np.int32) for n in lengths]


def test_default_layers_are_sglang_eagle3_defaults(engine):
    n = engine.num_layers
    # SGLang's Llama default captures the inputs of layers [2, N//2, N-3], i.e. outputs of [1, N//2-1, N-4].
    assert engine.layer_ids == (1, n // 2 - 1, n - 4)
    assert engine.capture_points == [k + 1 for k in engine.layer_ids]


def test_every_token_matches_hf_hidden_states_in_fp32(engine, hf_model):
    seqs = _seqs([7, 33, 1, 120])
    captured = engine.capture(seqs)
    assert captured.aux.shape == (sum(map(len, seqs)), len(engine.layer_ids) * engine.hidden_size)
    assert captured.last.shape == (sum(map(len, seqs)), engine.hidden_size)
    start = 0
    for ids in seqs:
        hs = parity.hf_hidden_states(hf_model, ids.tolist(), "cpu")
        rows = slice(start, start + len(ids))
        start += len(ids)
        for j, k in enumerate(engine.layer_ids):
            mine = captured.aux[rows, j * engine.hidden_size : (j + 1) * engine.hidden_size]
            assert _max_diff_over_scale(mine, hs[k + 1]) <= FP32_REL, f"aux id {k} vs HF hidden_states[{k + 1}]"
            # The neighbours differ by far more than the tolerance, so an off-by-one cannot pass.
            assert (mine - hs[k]).abs().max().item() > 1e-2
        assert _max_diff_over_scale(captured.last[rows], hs[-1]) <= FP32_REL
        assert (captured.last[rows] - hs[-2]).abs().max().item() > 1e-2, "last state must be after the final norm"


def test_parity_gate_passes_and_catches_an_off_by_one(engine, hf_model):
    seqs = _seqs([12, 40], seed=1)
    states = []
    for ids in seqs:
        c = engine.capture([ids])
        states.append((ids.tolist(), c.aux, c.last))
    rows = parity.compare(states, hf_model, engine.layer_ids, "float32")
    assert all(r.ok for r in rows) and len(rows) == len(engine.layer_ids) + 1
    assert max(r.max_rel for r in rows) <= FP32_REL
    parity.check(rows, "float32", len(seqs))

    shifted = [k - 1 for k in engine.layer_ids]  # states labelled one layer too deep
    bad = parity.compare(states, hf_model, shifted, "float32")
    assert [r.ok for r in bad] == [False] * len(shifted) + [True]
    with pytest.raises(parity.ParityError, match="parity gate failed"):
        parity.check(bad, "float32", len(seqs))


def test_states_do_not_depend_on_batch_composition(engine):
    seqs = _seqs([50, 9, 77], seed=2)
    together = engine.capture(seqs)
    alone = engine.capture([seqs[1]])
    assert _max_diff_over_scale(together.aux[50:59], alone.aux) <= SAME_STACK_REL
    assert _max_diff_over_scale(together.last[50:59], alone.last) <= SAME_STACK_REL


def test_bare_prefill_then_capture_again(engine):
    seqs = _seqs([30, 31], seed=3)
    before = engine.capture(seqs)
    assert engine.prefill(seqs) is None
    after = engine.capture(seqs)
    assert torch.equal(before.aux, after.aux) and torch.equal(before.last, after.last)


def test_batch_over_budget_is_refused(engine):
    with pytest.raises(ValueError, match="exceeds the engine"):
        engine.capture(_seqs([2000, 49]))
    with pytest.raises(ValueError, match="a sequence of 4097 tokens exceeds the context length of 4096"):
        engine.capture(_seqs([4097]))


def test_a_moe_warm_up_over_a_budget_beyond_the_context_keeps_each_sequence_within_it(tiny_model_dir, tmp_path):
    """A MoE model's warm-up compiles the experts' kernels for every token count a forward can hold, up to the
    batch budget (512 here), in sequences no longer than the context (64 here): a longer one would write past its
    row of SGLang's request-to-token pool (on the GPU an illegal memory access; on CPU a shape error). And a
    sequence over the context is refused by name before it reaches the pool. (A fresh interpreter: one engine a
    process.)"""
    from offline_extract.testing.models import build_model

    model = build_model("qwen3_moe", tmp_path / "m", dtype=torch.bfloat16, tokenizer_dir=tiny_model_dir)
    script = (
        "import sys, numpy as np\n"
        "from offline_extract.engine.distributed import free_port\n"
        "from offline_extract.engine.sglang_adapter import Engine, EngineConfig\n"
        "e = Engine(EngineConfig(model_path=sys.argv[1], device='cpu', dtype='bfloat16', max_tokens_per_batch=512,\n"
        "                        context_length=64, nccl_port=free_port()))\n"
        "free = e.runner.token_to_kv_pool_allocator.available_size()\n"
        "e.warm_up()\n"
        "print(max(e.warm_up_token_counts()), e.runner.token_to_kv_pool_allocator.available_size() == free)\n"
        "try:\n"
        "    e.capture([np.arange(1, 66)])\n"
        "except ValueError as err:\n"
        "    print(err)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(model)], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.splitlines()[-2:] == [
        "512 True",
        "a sequence of 65 tokens exceeds the context length of 64 that SGLang's pools were sized for "
        "(raise context_length)",
    ]


def _images(n: int) -> Images:
    return Images({"pixel_values": np.zeros((4, 8), np.float32)}, np.arange(n) < 2, "0" * 64)


def test_images_on_a_text_only_model_are_refused_by_name(engine):
    seqs = _seqs([12, 9])
    with pytest.raises(
        NotImplementedError, match=r"LlamaForCausalLM \(.*\) cannot take image inputs: it is a text-only"
    ):
        engine.capture(seqs, [None, _images(9)])
    with pytest.raises(ValueError, match="1 image entries for 2 sequences"):
        engine.capture(seqs, [_images(12)])
    # None entries throughout are a text batch.
    assert torch.equal(engine.capture(seqs, [None, None]).aux, engine.capture(seqs).aux)


def test_layer_id_validation():
    assert validate_layer_ids([4, 1, 3], 8) == (1, 3, 4)
    with pytest.raises(ValueError, match="last layer"):
        validate_layer_ids([1, 7], 8)
    with pytest.raises(ValueError, match="out of range"):
        validate_layer_ids([-1, 2], 8)
    with pytest.raises(ValueError, match="duplicate"):
        validate_layer_ids([2, 2], 8)


def test_unverified_architecture_is_refused_by_name():
    assert capture_rule("LlamaForCausalLM")
    with pytest.raises(NotImplementedError, match="GPTBigCodeForCausalLM.*not supported"):
        capture_rule("GPTBigCodeForCausalLM", "/models/starcoder")


def test_chunked_prefill_equals_one_pass_and_hf(engine, hf_model):
    ids = _seqs([300], seed=4)[0]
    whole = engine.capture([ids])
    chunked = engine.capture_chunked(ids, 37)
    assert _max_diff_over_scale(chunked.aux, whole.aux) <= FP32_REL
    assert _max_diff_over_scale(chunked.last, whole.last) <= FP32_REL
    rows = parity.compare([(ids.tolist(), chunked.aux, chunked.last)], hf_model, engine.layer_ids, "float32")
    assert all(r.ok for r in rows), rows


def test_chunks_stream_each_chunks_rows_and_may_exceed_the_batch_budget(engine):
    ids = _seqs([3100], seed=6)[0]
    whole = engine.capture_chunked(ids, 1024)
    chunk = engine.cfg.max_tokens_per_batch + 952  # one forward larger than any ragged batch
    bounds, parts = zip(*[((start, stop), states) for start, stop, states in engine.chunks(ids, chunk)])
    assert bounds == ((0, chunk), (chunk, len(ids)))
    assert [p.aux.shape[0] for p in parts] == [chunk, len(ids) - chunk]
    assert _max_diff_over_scale(torch.cat([p.aux for p in parts]), whole.aux) <= FP32_REL
    assert _max_diff_over_scale(torch.cat([p.last for p in parts]), whole.last) <= FP32_REL
    # The pools are free again once the generator is done: an ordinary batch runs.
    assert engine.capture(_seqs([40], seed=7)).aux.shape[0] == 40


def test_a_sequence_over_the_batch_budget_is_chunked_by_forward(engine, hf_model):
    ids = _seqs([engine.cfg.max_tokens_per_batch + 500], seed=5)[0]
    c = engine.capture([ids])
    assert c.aux.shape[0] == len(ids)
    rows = parity.compare([(ids.tolist(), c.aux, c.last)], hf_model, engine.layer_ids, "float32")
    assert all(r.ok for r in rows), rows


@pytest.fixture
def pre_norm(engine):
    engine.final_state = "pre-norm"
    yield engine
    engine.final_state = engine.cfg.final_state


def test_pre_norm_final_state_is_hfs_final_norm_input(pre_norm, hf_model):
    seqs = _seqs([19, 64], seed=6)
    captured = pre_norm.capture(seqs)
    start = 0
    for ids in seqs:
        rows = slice(start, start + len(ids))
        start += len(ids)
        post = parity.hf_hidden_states(hf_model, ids.tolist(), "cpu")
        pre = parity.hf_hidden_states(hf_model, ids.tolist(), "cpu", final_state="pre-norm")
        assert _max_diff_over_scale(captured.last[rows], pre[-1]) <= FP32_REL
        # Neither the normed state nor the layer below passes for it.
        assert (captured.last[rows] - post[-1]).abs().max().item() > 1e-2
        assert (captured.last[rows] - pre[-2]).abs().max().item() > 1e-2
    # The chunked path takes the same state from each chunk.
    ids = _seqs([150], seed=7)[0]
    assert _max_diff_over_scale(pre_norm.capture_chunked(ids, 41).last, pre_norm.capture([ids]).last) <= FP32_REL


def test_parity_gate_judges_the_pre_norm_state_against_the_pre_norm_reference(pre_norm, hf_model):
    ids = _seqs([45], seed=8)[0]
    c = pre_norm.capture([ids])
    states = [(ids.tolist(), c.aux, c.last)]
    rows = parity.compare(states, hf_model, pre_norm.layer_ids, "float32", final_state="pre-norm")
    assert all(r.ok for r in rows) and rows[-1].layer == "last (pre-norm)"
    assert not parity.compare(states, hf_model, pre_norm.layer_ids, "float32")[-1].ok


def test_unknown_final_state_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="final_state must be one of post-norm, pre-norm, got 'mid-norm'"):
        Engine(EngineConfig(model_path=str(tiny_model_dir), device="cpu", final_state="mid-norm"))


def test_warm_up_leaves_the_engine_as_it_found_it(engine):
    """A throwaway batch: the KV pool is free again and capture still on."""
    seqs = _seqs([9, 50], seed=3)
    before = engine.capture(seqs)
    free = engine.runner.token_to_kv_pool_allocator.available_size()
    engine.warm_up()
    assert engine.runner.token_to_kv_pool_allocator.available_size() == free
    after = engine.capture(seqs)
    assert torch.equal(before.aux, after.aux) and torch.equal(before.last, after.last)


def test_moe_warm_up_token_counts_cover_each_tuned_config_at_each_specialization():
    """On SGLang's own tuned table for Qwen3-30B-A3B's experts on the H200 (E=128, N=768), looked up as its
    try_get_optimal_moe_config does (the nearest M in the table)."""
    import json
    from pathlib import Path

    import sglang

    table = Path(sglang.__file__).parent / (
        "srt/layers/moe/moe_runner/triton_utils/configs/triton_3_6_0/E=128,N=768,device_name=NVIDIA_H200.json"
    )
    configs = {int(m): c for m, c in json.loads(table.read_text()).items()}

    def config_of(m: int) -> str:
        return json.dumps(configs[min(configs, key=lambda key: abs(key - m))], sort_keys=True)

    counts = moe_token_counts(config_of, 16384)
    specializations = lambda m: (config_of(m), m == 1, min(m & -m, 16))  # noqa: E731
    # Every forward of 1..16384 tokens launches a variant that one of the warm-up's counts compiled.
    assert {specializations(m) for m in range(1, 16385)} == {specializations(m) for m in counts}
    # Each from the smallest M: about 15k tokens in all (M=4096's config is M=1024's, first taken at 769).
    assert counts[-5:] == [1281, 1282, 1284, 1288, 1296] and sum(counts) < 15000
    assert moe_token_counts(int.bit_length, 100) == [
        1,
        2,
        3,
        4,
        5,
        6,
        8,
        9,
        10,
        12,
        16,
        17,
        18,
        20,
        24,
        32,
        33,
        34,
        36,
        40,
        64,
        65,
        66,
        68,
        72,
    ]


def test_a_cpu_engine_hides_the_gpus_before_torch_first_asks_the_driver():
    """SGLang chooses its kernels at import from whether torch sees a GPU, so on a GPU machine a CPU engine's
    process must see none: started with a GPU named visible, it sees none once prepared (a fresh interpreter,
    since the driver reads CUDA_VISIBLE_DEVICES once)."""
    script = (
        "import os, torch\n"
        "from offline_extract.engine.sglang_adapter import prepare_process\n"
        "prepare_process('cpu')\n"
        "print(repr(os.environ['CUDA_VISIBLE_DEVICES']), torch.cuda.is_available())"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["''", "False"]


def test_a_cpu_engine_where_cuda_already_started_is_refused_with_the_way_out(monkeypatch):
    from offline_extract.engine.sglang_adapter import prepare_process

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the driver started before the GPUs were hidden
    with pytest.raises(
        ValueError,
        match=r"CUDA had already started in this process, so hiding them through "
        r"CUDA_VISIBLE_DEVICES came too late\. Start the process with them hidden: "
        r"CUDA_VISIBLE_DEVICES= python bin/extract\.py \.\.\. --device cpu$",
    ):
        prepare_process("cpu")


def test_the_cpu_engine_prebuilds_no_kernel(engine):
    """The torch_native path calls none of SGLang's nvcc-built modules (and there is no nvcc), and its load and
    forwards compile no Triton kernel."""
    import threading

    report = engine.compiles.report()
    assert engine.compiles.prebuild is None and not any(key.startswith("prebuild") for key in report)
    assert (report["triton_compiled"], report["triton_compiled_in_extraction"]) == (0, 0), report
    assert not [t.name for t in threading.enumerate() if t.name.startswith("prebuild ")]
