"""The CPU-checkable parts of bin/bench.py: its synthetic corpus, FLOP count and output classification."""
from types import SimpleNamespace

import numpy as np
import pytest
from transformers import AutoTokenizer

from offline_extract.benchmarking import BenchOptions, model_flops_per_token, out_kind, synthetic_corpus
from offline_extract.data.tokenization import SampleTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return SampleTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), max_length=8192)


def test_fixed_lengths_are_exact_and_chat_masked(tokenizer):
    samples = synthetic_corpus(tokenizer, BenchOptions(lengths="fixed", mean_length=512, num_tokens=5000))
    assert {s.num_tokens for s in samples} == {512}
    assert sum(s.num_tokens for s in samples) >= 5000
    assert all(0 < s.loss_mask.sum() < s.num_tokens for s in samples), "assistant tokens only"


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


def test_out_kind_tells_tmpfs_from_disk(tmp_path):
    assert out_kind("/dev/shm/some/dir") == "tmpfs"
    assert out_kind("/proc/self") == "disk"  # not tmpfs: anything that is not RAM-backed counts as disk
    assert out_kind("/") == "disk"
