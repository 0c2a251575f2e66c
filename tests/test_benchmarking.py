"""The CPU-checkable parts of bin/bench.py: its synthetic corpus, FLOP count, output classification and fp8
error measure."""
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from extract_runs import ROOT
from transformers import AutoTokenizer

from benchmarks.extraction_vs_prefill import (
    BenchOptions, _cold_start, _fp8_error, attention_flops, model_flops_per_token, out_kind, synthetic_corpus,
)
from offline_extract.data.tokenization import SampleTokenizer
from offline_extract.engine.sglang_adapter import chunk_bounds


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return SampleTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), max_length=8192)


def test_fixed_lengths_are_exact_and_chat_masked(tokenizer):
    samples = synthetic_corpus(tokenizer, BenchOptions(lengths="fixed", mean_length=512, num_tokens=5000))
    assert {s.num_tokens for s in samples} == {512}
    assert sum(s.num_tokens for s in samples) >= 5000
    assert all(0 < s.loss_mask.sum() < s.num_tokens for s in samples), "assistant tokens only"


def test_fixed_lengths_beyond_the_lognormal_cap_are_kept_whole(tiny_model_dir):
    opts = BenchOptions(lengths="fixed", mean_length=20000, max_length=8192, num_tokens=20000)
    tokenizer = SampleTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), max_length=opts.longest)
    assert [s.num_tokens for s in synthetic_corpus(tokenizer, opts)] == [20000]


def test_lognormal_lengths_have_the_asked_mean_and_cap(tokenizer):
    opts = BenchOptions(mean_length=600, max_length=2000, num_tokens=150_000)
    lengths = np.array([s.num_tokens for s in synthetic_corpus(tokenizer, opts)])
    assert lengths.max() <= 2000
    assert 450 < lengths.mean() < 750, lengths.mean()
    assert lengths.std() > 150, "a realistic spread, not a constant"


def test_data_parallel_ranks_split_the_same_corpus(tokenizer):
    opts = BenchOptions(mean_length=300, num_tokens=20_000)
    whole = [s.index for s in synthetic_corpus(tokenizer, opts)]
    parts = [s.index for r in range(2) for s in synthetic_corpus(tokenizer, opts, r, 2)]
    assert sorted(parts) == whole


def test_flops_per_token_counts_weights_and_causal_attention():
    cfg = SimpleNamespace(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, head_dim=128,
                          num_key_value_heads=8, intermediate_size=14336)
    one = SimpleNamespace(num_tokens=1)
    matmul_params = 32 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336)  # 6.98e9: Llama-3-8B minus embeddings
    assert model_flops_per_token(cfg, [one]) == pytest.approx(2 * matmul_params + 4 * 32 * 4096, rel=1e-9)
    long = SimpleNamespace(num_tokens=2048)
    assert model_flops_per_token(cfg, [long]) - 2 * matmul_params == pytest.approx(4 * 32 * 4096 * 2049 / 2)


def test_chunked_attention_flops_add_up_to_one_pass():
    cfg = SimpleNamespace(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, head_dim=128)
    one_pass = attention_flops(cfg, 0, 131072)
    assert one_pass == pytest.approx(4 * 32 * 32 * 128 * 131072 * 131073 / 2, rel=1e-12)
    for chunk in (16384, 5000, 131072):
        assert sum(attention_flops(cfg, a, b) for a, b in chunk_bounds(131072, chunk)) == pytest.approx(one_pass, rel=1e-12)
    # A later chunk costs more than the first: it attends to its prefix as well.
    assert attention_flops(cfg, 16384, 32768) == pytest.approx(3 * attention_flops(cfg, 0, 16384), rel=1e-3)


def test_chunk_bounds_cover_the_sequence_once():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(8, 4) == [(0, 4), (4, 8)]
    assert chunk_bounds(3, 4) == [(0, 3)]
    with pytest.raises(ValueError, match="positive"):
        chunk_bounds(10, 0)


def test_out_kind_tells_tmpfs_from_disk(tmp_path):
    assert out_kind("/dev/shm/some/dir") == "tmpfs"
    assert out_kind("/proc/self") == "disk"  # not tmpfs: anything that is not RAM-backed counts as disk
    assert out_kind("/") == "disk"


@pytest.mark.skipif(torch.cuda.is_available(), reason="what bin/bench.py says on a machine without a GPU")
def test_bench_without_a_gpu_says_so_in_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "bin" / "bench.py")], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "Error: bin/bench.py times extraction on a GPU, but torch sees no CUDA GPU here"


def test_fp8_error_is_per_token_per_layer_against_the_same_forward(tokenizer):
    from offline_extract.engine.sglang_adapter import Captured

    g = torch.Generator().manual_seed(0)

    class Engine:
        layer_ids = (1, 3, 4)

        def __init__(self):
            self.forwards = 0

        def forward(self, seqs):
            self.forwards += 1
            tokens = sum(len(s) for s in seqs)
            x = torch.randn(tokens, 4, 32, generator=g) * (torch.rand(tokens, 4, 1, generator=g) * 5 + 0.1)
            return Captured(aux=x[:, :3].reshape(tokens, 96), last=x[:, 3])

    samples = synthetic_corpus(tokenizer, BenchOptions(lengths="fixed", mean_length=100, num_tokens=1000))
    batches = [SimpleNamespace(samples=samples[i : i + 2], num_tokens=200) for i in range(0, 10, 2)]
    engine = Engine()
    result = _fp8_error(engine, batches, max_tokens=300)
    assert engine.forwards == 2, "stops once max_tokens are measured"
    assert list(result) == ["layer 1", "layer 3", "layer 4", "last"]
    for row in result.values():
        assert row["tokens"] == 400
        assert 0.999 <= row["worst"] <= row["median"] < 1.0


def test_the_cold_start_times_each_first_batch_after_the_start_up(tiny_engine, tokenizer):
    from offline_extract.data.batching import batch_by_tokens
    from offline_extract.timeline import Timeline

    timeline = Timeline()
    timeline.mark("engine")
    timeline.mark("loaded")
    samples = synthetic_corpus(tokenizer, BenchOptions(mean_length=200, num_tokens=1500))
    batches = list(batch_by_tokens(samples, 512, 16))[:2]
    cold = _cold_start(tiny_engine, batches, timeline)
    assert len(cold["cold_batch_s"]) == 2 and min(cold["cold_batch_s"]) > 0
    assert cold["cold_tok_s"] == pytest.approx(sum(b.num_tokens for b in batches) / sum(cold["cold_batch_s"]))
    assert 0 < cold["startup_to_engine_s"] <= cold["startup_to_first_forward_s"]
    assert cold["engine_load_s"] >= 0


def test_process_age_counts_from_the_command():
    code = "import time; time.sleep(0.5); from offline_extract.timeline import process_age; print(process_age())"
    age = float(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    assert 0.5 <= age < 30
