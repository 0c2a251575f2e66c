"""bin/bench.py on CPU: its synthetic corpus, FLOP count and output classification, and every mode it times
on the GPU (bare prefill, copy-out, extraction in each encoding, fp8 error, chunk sweep, cold start)
through the real engine at tiny size."""

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from extract_runs import ROOT
from transformers import AutoConfig, AutoTokenizer

from benchmarks.extraction_vs_prefill import (
    BenchOptions,
    _bare,
    _chunk_sweep,
    _cold_start,
    _DiscardWriter,
    _first_pass,
    _ForwardClock,
    _fp8_error,
    _host_facts,
    _host_thread_sweep,
    ResultFiles,
    _Bench,
    _rank_report,
    _timed,
    attention_flops,
    jit_cache_entries,
    measure,
    model_flops_per_token,
    out_kind,
    run_options,
    shard_writes,
    summary_line,
    synthetic_corpus,
)
from offline_extract.engine.distributed import Coordinator, Layout
from offline_extract.feed import extract_batches, staging_buffers
from offline_extract.store.index import iter_samples
from offline_extract.store.schema import Encoding
from offline_extract.store.writer import ShardWriter
from offline_extract.testing.shards import synthetic_run
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
    cfg = SimpleNamespace(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        head_dim=128,
        num_key_value_heads=8,
        intermediate_size=14336,
    )
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
        assert sum(attention_flops(cfg, a, b) for a, b in chunk_bounds(131072, chunk)) == pytest.approx(
            one_pass, rel=1e-12
        )
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
def test_the_host_facts_name_the_cpu_and_say_why_the_gpu_clocks_are_missing():
    facts = _host_facts()
    assert facts["cpu"] and facts["cpus"] >= facts["cpus_usable"] >= 1
    if torch.cuda.is_available():
        assert facts["gpu_sm_clock_max_mhz"] >= facts["gpu_sm_clock_mhz"] > 0
    else:  # this host's GPU clocks cannot be read, and the result says why rather than failing the bench
        assert "gpu_sm_clock_mhz" not in facts and facts["gpu_clocks_error"]


def test_bench_without_a_gpu_says_so_in_one_line():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bin" / "bench.py")], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == "Error: bin/bench.py times extraction on a GPU, but torch sees no CUDA GPU here"


@pytest.fixture(scope="module")
def bench_batches(tiny_engine, tokenizer):
    """Short samples in one batch and one sample past the engine's budget, which it takes in chunks."""
    from offline_extract.data.batching import batch_by_tokens

    short = synthetic_corpus(tokenizer, BenchOptions(lengths="fixed", mean_length=100, num_tokens=300))
    budget = tiny_engine.cfg.max_tokens_per_batch
    long = synthetic_corpus(tokenizer, BenchOptions(lengths="fixed", mean_length=budget + 100, num_tokens=budget + 100))
    long = [dataclasses.replace(s, index=len(short) + i, id=f"long-{i}") for i, s in enumerate(long)]
    batches = list(batch_by_tokens(short + long, budget, 16))
    assert [tiny_engine.is_chunked([s.input_ids for s in b.samples]) for b in batches] == [False, True]
    return batches


def test_fp8_error_is_per_token_per_layer_against_the_same_forward(tiny_engine, bench_batches):
    result = _fp8_error(tiny_engine, bench_batches, max_tokens=250)
    assert list(result) == [*(f"layer {i}" for i in tiny_engine.layer_ids), "last"]
    first = bench_batches[0].num_tokens
    for row in result.values():
        assert row["tokens"] == first, "stops once max_tokens are measured"
        assert 0.999 <= row["worst"] <= row["median"] < 1.0


def test_the_timed_modes_run_through_the_real_engine(tiny_engine, bench_batches, tmp_path):
    """What run_bench times on the GPU, on CPU at tiny size: bare prefill, the copy-out alone, extraction
    into shards in each stored encoding, and the chunk sweep, all through the forward clock."""
    layout = Layout(rank=0, world_size=1)
    coord = Coordinator(layout, "bench-test")
    clock = _ForwardClock(tiny_engine)
    tokens = sum(b.num_tokens for b in bench_batches)
    assert _timed(coord, lambda: _bare(clock, bench_batches), clock) > 0
    assert clock.seconds > 0 and clock.phases() == {}, "on CPU the host side only"
    longest = max(s.num_tokens for b in bench_batches for s in b.samples)
    written = {}
    for encoding in (Encoding("bf16"), Encoding("fp8", "zstd")):
        staging = staging_buffers(tiny_engine, encoding)
        widths = encoding.widths(len(tiny_engine.layer_ids), tiny_engine.hidden_size)
        if encoding.store == "fp8":  # the copy-out alone, as --store fp8 --compress zstd measures it
            discard = _DiscardWriter(encoding, longest, widths)
            assert _timed(coord, lambda: extract_batches(clock, bench_batches, discard, staging=staging), clock) > 0
        out = tmp_path / f"{encoding.store}-{encoding.compress}"
        run = synthetic_run(tiny_engine.layer_ids, store=encoding.store, compress=encoding.compress)
        writer = ShardWriter(out, run, shard_bytes=1 << 20, widths=widths)
        host_times = {}
        _timed(
            coord,
            lambda: (host_times.update(extract_batches(clock, bench_batches, writer, staging=staging)), writer.close()),
            clock,
        )
        assert writer.bytes_written > 0
        report = _rank_report(layout, clock, host_times, writer)
        forwards = report["per_forward"]
        # A long sample's chunks are a forward each.
        assert len(forwards["host_s"]) == len(forwards["host_before_s"]) > len(bench_batches)
        assert sum(forwards["host_s"]) == pytest.approx(clock.seconds, abs=1e-3)
        assert 0 < report["forward_s"] < report["wall_s"]
        assert report["consume_s"] > 0 and report["writer_wait_s"] >= 0 and report["writer_buffer_wait_s"] >= 0
        assert len(report["shard_writes"]) == len(writer.headers) >= 1
        assert sum(n for *_, n in report["shard_writes"]) == writer.bytes_written
        assert all(0 <= start and start + seconds <= report["wall_s"] for start, seconds, _ in report["shard_writes"])
        written[encoding.store] = {info.index: t for info, t in iter_samples(out)}
    assert sum(len(t["input_ids"]) for t in written["bf16"].values()) == tokens
    assert written["fp8"].keys() == written["bf16"].keys()
    for index, t in written["fp8"].items():
        for name in ("aux_hidden_states", "hidden_states"):
            cos = torch.nn.functional.cosine_similarity(t[name].float(), written["bf16"][index][name].float(), dim=-1)
            assert cos.min() > 0.999, (index, name)
    rates = _chunk_sweep(tiny_engine, coord, bench_batches[1], (1024,))
    assert list(rates) == ["1024"] and rates["1024"] > 0


class _CompilingEngine:
    """Compiles on the first forward of each token count, as SGLang's fused-MoE Triton kernels do: it takes
    0.2 s and adds a file to its JIT cache."""

    def __init__(self, cache):
        self.jit_caches = {"TRITON_CACHE_DIR": str(cache)}
        self.seen = set()

    def prefill(self, seqs, images=None):
        n = sum(len(s) for s in seqs)
        if n not in self.seen:
            self.seen.add(n)
            time.sleep(0.2)
            (Path(self.jit_caches["TRITON_CACHE_DIR"]) / f"kernel_{n}").write_text("")


def test_the_first_pass_leaves_the_timed_modes_on_warm_kernels(tmp_path, tokenizer):
    from offline_extract.data.batching import batch_by_tokens

    coord = Coordinator(Layout(rank=0, world_size=1), "bench-test")
    samples = synthetic_corpus(tokenizer, BenchOptions(mean_length=100, num_tokens=2000))
    batches = list(batch_by_tokens(samples, 300, 16))
    counts = {b.num_tokens for b in batches}
    engine = _CompilingEngine(tmp_path)
    first = _first_pass(engine, coord, batches)
    assert first["compiled"] == len(counts) == jit_cache_entries(engine.jit_caches)
    assert first["seconds"] >= 0.2 * len(counts)
    # What run_bench then times: no compiling left in it.
    assert _timed(coord, lambda: _bare(engine, batches)) < 0.1
    assert jit_cache_entries(engine.jit_caches) == len(counts)


def test_the_first_pass_runs_through_the_real_engine(tiny_engine, bench_batches):
    first = _first_pass(tiny_engine, Coordinator(Layout(rank=0, world_size=1), "bench-test"), bench_batches)
    assert first["seconds"] > 0 and first["compiled"] == 0, "nothing compiles on CPU"


def test_the_host_thread_sweep_times_extraction_at_each_count_and_puts_the_count_back(tmp_path):
    seen = []

    def extraction(name):  # seconds, as _timed returns them
        seen.append(torch.get_num_threads())
        (tmp_path / name).mkdir()
        return 0.5

    before = torch.get_num_threads()
    assert _host_thread_sweep((1, 2), extraction, tmp_path, 1000) == {"1": 2000.0, "2": 2000.0}
    assert seen == [1, 2] and torch.get_num_threads() == before
    assert not list(tmp_path.iterdir()), "each count's folder is removed once timed"


def test_the_host_thread_sweep_writes_each_count_into_a_fresh_folder(tiny_engine, bench_batches, tmp_path):
    """Each count's extraction through the real engine and writer, as run_bench times them: a writer into
    the folder of the count before it would refuse to overwrite that run's shards. The rates reach the
    result JSON."""
    coord = Coordinator(Layout(rank=0, world_size=1), "bench-test")
    clock = _ForwardClock(tiny_engine)
    store = "bf16"
    encoding = Encoding(store)
    staging = staging_buffers(tiny_engine, encoding)
    widths = encoding.widths(len(tiny_engine.layer_ids), tiny_engine.hidden_size)
    run = synthetic_run(tiny_engine.layer_ids, store=store)
    tokens = sum(b.num_tokens for b in bench_batches)
    root = tmp_path / "rank0"
    written = []

    def timed_into(name):
        writer = ShardWriter(root / name, run, shard_bytes=1 << 20, widths=widths)

        def extract():
            extract_batches(clock, bench_batches, writer, staging=staging)
            writer.close()
            written.append((name, sum(len(t["input_ids"]) for _, t in iter_samples(root / name))))

        return _timed(coord, extract, clock)

    rates = _host_thread_sweep((1, 2), timed_into, root, tokens)
    assert list(rates) == ["1", "2"] and all(r > 0 for r in rates.values())
    assert written == [("threads_1", tokens), ("threads_2", tokens)]
    assert not root.exists() or not list(root.iterdir()), "each count's folder is removed once timed"

    opts = BenchOptions(
        shape="tiny",
        encodings=((store, "none"),),
        outs=(str(tmp_path),),
        results_dir=str(tmp_path / "results"),
        command="bench --host-threads 1,2",
    )
    ResultFiles(opts, Layout()).measured(0, {"command": opts.command, "extract_tok_s_by_host_threads": rates})
    (saved,) = (tmp_path / "results").glob("*.json")
    assert json.loads(saved.read_text())["extract_tok_s_by_host_threads"] == rates


def test_the_summary_line_puts_the_cold_figures_beside_the_warm_ones():
    result = {
        "store": "bf16",
        "compress": "none",
        "out": "/dev/shm/x",
        "out_kind": "tmpfs",
        "timed_compiled": 0,
        "bare_prefill_tok_s": 40000.4,
        "extract_tok_s": 39000,
        "extract_over_bare": 0.975,
        "copy_only_tok_s": 39900,
        "bare_first_pass_tok_s": 20000,
        "bare_first_pass_compiled": 12,
        "cold_tok_s": 2522.1,
    }
    assert summary_line(result) == (
        "bench bf16/none -> /dev/shm/x (tmpfs), tok/s on warm kernels: bare 40,000, extract 39,000 (0.975 of bare), "
        "copy-only 39,900; cold: bare's first pass 20,000 (12 JIT cache files added), warm-up batches 2,522"
    )
    assert "3 JIT cache files added while timed" in summary_line({**result, "timed_compiled": 3})


def test_shard_writes_count_overlaps_and_the_rate_while_writing():
    # From t=10: writes of 1 s at 0 and 0.5 (beside each other), then one from 1.5 that starts after both ended.
    report = shard_writes([(11.5, 1.0, 300), (10.0, 1.0, 100), (10.5, 1.0, 200)], started=10.0)
    assert report["shard_writes"] == [[0.0, 1.0, 100], [0.5, 1.0, 200], [1.5, 1.0, 300]]
    assert report["shards_written_at_once_max"] == 2, "the write starting as another ends is not beside it"
    assert report["write_bytes_s_while_writing"] == pytest.approx(600 / 2.5)
    assert shard_writes([], 0.0) == {
        "shard_writes": [],
        "shards_written_at_once_max": 0,
        "write_bytes_s_while_writing": None,
    }


def test_the_cold_start_times_each_first_batch_after_the_start_up(tiny_engine, tokenizer):
    from offline_extract.data.batching import batch_by_tokens
    from offline_extract.lifecycle.timeline import Timeline

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


def test_every_mode_after_the_load_runs_into_a_result_per_encoding_and_out(
    tiny_engine, tiny_model_dir, bench_batches, tokenizer, tmp_path, monkeypatch
):
    """run_bench once its engine is loaded (`measure`), on CPU at tiny size: bare prefill, then for each encoding
    the copy-out and the extraction into each --out, each result saved with its command as it is measured, the
    shards removed once timed."""
    monkeypatch.setattr("benchmarks.extraction_vs_prefill.disk_write_rate", lambda *args: 1e9)  # 64 MiB a writer
    layout = Layout(rank=0, world_size=1)
    coord = Coordinator(layout, "bench-test")
    outs = (str(tmp_path / "a"), str(tmp_path / "b"))
    opts = BenchOptions(
        model=str(tiny_model_dir),
        outs=outs,
        encodings=(("bf16", "none"), ("fp8", "zstd")),
        tokens_per_batch=tiny_engine.cfg.max_tokens_per_batch,
        writers=2,
        warmup_batches=1,
        fp8_error_tokens=100,
        results_dir=str(tmp_path / "results"),
        command="python bin/bench.py --the-test",
    )
    samples = [s for b in bench_batches for s in b.samples]
    tokens = sum(b.num_tokens for b in bench_batches)
    bench = _Bench(
        opts,
        layout,
        coord,
        run_options(opts, tiny_model_dir),
        tiny_model_dir,
        tokenizer,
        samples,
        bench_batches[:1],
        bench_batches,
        None,
        AutoConfig.from_pretrained(tiny_model_dir),
        ResultFiles(opts, layout),
        timed_tokens=tokens,
    )
    results = measure(bench, tiny_engine, {"cold_tok_s": None}, [])
    assert [(r["store"], r["compress"], r["out"]) for r in results] == [
        (store, compress, out) for store, compress in opts.encodings for out in outs
    ]
    saved = [json.loads(p.read_text()) for p in (tmp_path / "results").glob("*.json")]
    key = lambda r: (r["store"], r["compress"], r["out"])  # noqa: E731
    assert {key(d): d for d in saved} == {key(r): json.loads(json.dumps(r)) for r in results}
    for r in results:
        assert r["command"] == opts.command and r["parts"] == {"done": ["ours"], "left": []}
        assert r["num_tokens"] == tokens and r["longest_sample"] > opts.tokens_per_batch
        assert r["bare_prefill_tok_s"] > 0 and r["extract_tok_s"] > 0 and r["copy_only_tok_s"] > 0
        assert r["extract_over_bare"] == pytest.approx(r["extract_tok_s"] / r["bare_prefill_tok_s"])
        assert r["bytes_per_token_written"] > 0 and r["bare_after_over_bare"] > 0
        assert len(r["extract_ranks"][0]["shard_writes"]) >= 1
        assert ("fp8_cosine_vs_bf16" in r) == (r["store"] == "fp8")
        assert r["device"] == "cpu" and r["gpu_peak_bytes"] is None
    assert results[2]["fp8_cosine_vs_bf16"]["last"]["worst"] > 0.999
    assert all(not (Path(out) / "rank0").exists() for out in outs), "each out's shards removed once timed"
