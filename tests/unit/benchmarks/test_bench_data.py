"""bin/bench.py --data on CPU: a corpus read, tokenized and batched as bin/extract.py makes it, and both timed
modes through the real engine on exactly those batches; image chats (benchmarks/image_chats.py) on the tiny
Qwen2.5-VL, their pixels in bare prefill too, in a process of its own (SGLang allows one ModelRunner per process),
and the Qwen2.5-VL-7B shape the H200's image row runs."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from bench_modes import both_modes
from click.testing import CliRunner
from extract_runs import ROOT

from benchmarks.extraction_vs_prefill import (
    BenchOptions,
    _fed_figures,
    _ForwardClock,
    _timed,
    bench_corpus,
    fed_batches,
    run_options,
)
from benchmarks.image_chats import write_image_chats
from offline_extract import planning
from offline_extract.commands.extract import main as extract_command
from offline_extract.default_model import TRAINING_TEXT
from offline_extract.engine.distributed import Coordinator, Layout
from offline_extract.extraction import sample_tokenizer
from offline_extract.feed import extract_batches
from offline_extract.store.index import iter_samples
from offline_extract.store.manifest import file_fingerprint
from offline_extract.store.schema import RunInfo
from offline_extract.store.writer import ShardWriter
from offline_extract.testing.models import build_model


def _write_text_corpus(path):
    """Chats of the embedded model's English, a plain text record, and one record of no known format."""
    sentences = [s.strip() + "." for s in TRAINING_TEXT.split(".") if s.strip()]
    records = [
        {
            "id": f"chat-{i}",
            "messages": [
                {"role": "user", "content": sentences[i]},
                {"role": "assistant", "content": " ".join(sentences[i + 1 : i + 1 + i % 5])},
            ],
        }
        for i in range(12)
    ]
    records += [{"id": "prose", "text": " ".join(sentences[:8])}, {"id": "odd", "neither": "text nor messages"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_data_times_both_modes_on_the_batches_extract_makes_of_the_corpus(tiny_engine, tiny_model_dir, tmp_path):
    corpus = _write_text_corpus(tmp_path / "real.jsonl")
    opts = BenchOptions(data=(str(corpus),), tokens_per_batch=256, warmup_batches=1)
    run = run_options(opts, tiny_model_dir)
    coord = Coordinator(Layout(), "bench-data")
    _, samples, batches, facts = bench_corpus(opts, run, tiny_model_dir, coord.layout, coord)
    # The dry run's count: the product's own reading and tokenizing of the corpus.
    plan = planning.plan(opts.data, sample_tokenizer(run, tiny_model_dir), tmp_path, 64, 3)
    assert (
        (facts["records"], facts["samples"], facts["rejected"], facts["tokens"])
        == (plan.records, plan.samples, plan.rejected, plan.tokens)
        == (14, 13, 1, sum(s.num_tokens for s in samples))
    )
    assert facts["corpus"] == [file_fingerprint(corpus)] and facts["image_tokens"] == 0
    assert len(batches) > 2 and all(b.num_tokens <= 256 for b in batches if len(b.samples) > 1)

    bare, extract = both_modes(tiny_engine, batches, tmp_path / "out", coord)
    assert bare["tokens"] == extract["tokens"] == plan.tokens
    assert sum(len(t["input_ids"]) for _, t in iter_samples(tmp_path / "out")) == plan.tokens


def _ids(batches):
    return [[s.id for s in b.samples] for b in batches]


def test_the_fed_extraction_makes_the_timed_batches_again_from_the_records(tiny_engine, tiny_model_dir, tmp_path):
    """What run_bench also times with --data: extraction fed as bin/extract.py is, the timed batches made from
    the records while the forwards run, the warm-up batches' records passed over."""
    corpus = _write_text_corpus(tmp_path / "real.jsonl")
    opts = BenchOptions(data=(str(corpus),), tokens_per_batch=256, warmup_batches=1)
    run = run_options(opts, tiny_model_dir)
    coord = Coordinator(Layout(), "bench-data")
    tokenizer, _, batches, _ = bench_corpus(opts, run, tiny_model_dir, coord.layout, coord)
    warm, timed = batches[:1], batches[1:]
    assert _ids(fed_batches(opts, run, tokenizer, coord.layout, warm, timed)) == _ids(timed)
    clock, host_times = _ForwardClock(tiny_engine), {}
    fed = fed_batches(opts, run, tokenizer, coord.layout, warm, timed)
    info = RunInfo(model=str(tiny_model_dir), layer_ids=tuple(tiny_engine.layer_ids), store="bf16", compress="none")
    writer = ShardWriter(tmp_path / "fed", info, shard_bytes=1 << 16)

    def extract():
        host_times.update(extract_batches(clock, fed, writer))
        writer.close()

    fed_s = _timed(coord, extract, clock)
    tokens = sum(b.num_tokens for b in timed)
    figures = _fed_figures(coord, clock, host_times, writer, timed, tokens, fed_s, 1.0, 1.0)
    assert figures["extract_fed_tok_s"] == pytest.approx(tokens / fed_s) and figures["extract_fed_input_wait_s"] >= 0
    # Its forwards and writes as the extraction's own are reported: they tell a slow forwards' thread from slow
    # writes.
    (rank,) = figures["extract_fed_ranks"]
    assert rank["tokens"] == tokens and len(rank["per_forward"]["host_s"]) == len(timed)
    assert 0 < figures["extract_fed_forward_s"] == rank["forward_s"] <= fed_s
    assert len(rank["shard_writes"]) == len(writer.writes) > 1 and rank["consume_s"] > 0
    # And the host's threads on its cores: the forwards' own and the writers' (a slow forwards' thread queued
    # behind them shows there).
    threads = rank["host_use"]["threads"]
    assert threads["forwards"]["cpu_s"] > 0 and threads["shard-writer"]["cpu_s"] > 0
    with pytest.raises(RuntimeError, match="not the one read at the start"):
        _fed_figures(coord, clock, host_times, writer, timed[1:], tokens, fed_s, 1.0, 1.0)


def test_num_tokens_caps_the_data_at_its_start(tiny_model_dir, tmp_path):
    corpus = _write_text_corpus(tmp_path / "real.jsonl")
    whole = BenchOptions(data=(str(corpus),))
    coord = Coordinator(Layout(), "bench-data")
    _, samples, _, _ = bench_corpus(whole, run_options(whole, tiny_model_dir), tiny_model_dir, coord.layout, coord)
    capped = BenchOptions(data=(str(corpus),), num_tokens=samples[0].num_tokens + 1)
    _, first, _, facts = bench_corpus(capped, run_options(capped, tiny_model_dir), tiny_model_dir, coord.layout, coord)
    assert [s.id for s in first] == [s.id for s in samples[:2]] and facts["records"] == 2


def test_data_beside_the_synthetic_lengths_is_refused_naming_both():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bin" / "bench.py"), "--data", "c.jsonl", "--mean-length", "900"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Error: --mean-length shapes the synthetic corpus, which --data replaces" in proc.stderr


def test_image_threads_is_extract_pys_option_and_prepares_the_datas_image_chats(qwen_vl_dir, tmp_path, monkeypatch):
    """bin/bench.py --image-threads is bin/extract.py's own (help, bounds and default from ExtractOptions), and the
    tokenizer that prepares --data's image chats, for the batches made first and the fed ones, takes it."""
    monkeypatch.syspath_prepend(str(ROOT / "bin"))  # for its `import _bin_path`, which takes it off again
    spec = importlib.util.spec_from_file_location("bin_bench", ROOT / "bin" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for name in ("image_threads", "writers"):  # the options bin/bench.py shares with bin/extract.py
        (ours,) = (p for p in bench.main.params if p.name == name)
        (theirs,) = (p for p in extract_command.params if p.name == name)
        assert ours.to_info_dict() == theirs.to_info_dict(), name
    assert "0 is not in the range x>=1" in CliRunner().invoke(bench.main, ["--image-threads", "0"]).output

    corpus = tmp_path / "chats.jsonl"
    write_image_chats(corpus, 4, sizes="28x56,56x56")
    given = []
    monkeypatch.setattr("benchmarks.extraction_vs_prefill.run_bench", given.append)
    ran = CliRunner().invoke(bench.main, ["--model", str(qwen_vl_dir), "--data", str(corpus), "--image-threads", "3"])
    assert ran.exit_code == 0, ran.output
    (opts,) = given
    coord = Coordinator(Layout(), "bench-image-threads")
    tokenizer, _, _, facts = bench_corpus(opts, run_options(opts, qwen_vl_dir), qwen_vl_dir, coord.layout, coord)
    assert tokenizer.image_threads == 3 and facts["samples_with_images"] == 4


# What run_bench does with --data up to the timing, then both modes, on the tiny Qwen2.5-VL on CPU.
_IMAGE_BENCH = """
import json, sys
from pathlib import Path
from benchmarks.extraction_vs_prefill import BenchOptions, bench_corpus, fed_batches, run_options
from offline_extract.engine.distributed import Coordinator, Layout
from offline_extract.engine.sglang_adapter import Engine
from offline_extract.extraction import engine_config
from bench_modes import both_modes

model, corpus, out = sys.argv[1:]
opts = BenchOptions(data=(corpus,), dtype="float32", tokens_per_batch=1024, warmup_batches=1)
run = run_options(opts, Path(model))
coord = Coordinator(Layout(), "bench-images")
tokenizer, samples, batches, facts = bench_corpus(opts, run, Path(model), coord.layout, coord)
engine = Engine(engine_config(run, coord.layout, Path(model), "cpu", opts.tokens_per_batch, layer_ids=None))
bare, extract = both_modes(engine, batches, Path(out), coord)
fed = fed_batches(opts, run, tokenizer, coord.layout, batches[:1], batches[1:])
fed_same = [[s.id for s in b.samples] for b in fed] == [[s.id for s in b.samples] for b in batches[1:]]
print(json.dumps({"facts": facts, "bare": bare, "extract": extract, "fed_same": fed_same}))
"""


def test_image_chats_run_with_their_pixels_in_both_modes(tiny_model_dir, tmp_path):
    model = build_model("qwen2_5_vl", tmp_path / "model", tokenizer_dir=tiny_model_dir)
    corpus = tmp_path / "chats.jsonl"
    images = write_image_chats(corpus, 6, sizes="28x56,56x56")  # 2 or 4 image tokens each
    proc = subprocess.run(
        [sys.executable, "-c", _IMAGE_BENCH, str(model), str(corpus), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    facts, bare, extract = result["facts"], result["bare"], result["extract"]
    assert facts["samples"] == facts["samples_with_images"] == 6 and 6 < images
    assert 2 * images <= facts["image_tokens"] <= 4 * images
    assert bare["tokens"] == extract["tokens"] == facts["tokens"]
    assert bare["sequences_with_images"] == extract["sequences_with_images"] == 6, "the vision tower ran in bare too"
    stored = sum(int(t["image_mask"].sum()) for _, t in iter_samples(tmp_path / "out"))
    assert stored == facts["image_tokens"]
    assert result["fed_same"], "the fed extraction's batches, images prepared on the feed's thread, are the timed ones"


def test_the_7b_shape_takes_the_image_chats_at_their_own_size(tiny_model_dir, tmp_path):
    """Its processor keeps a 1280 x 720 frame near its size, as the release's does: 46 x 26 tokens of 28 pixels."""
    model = build_model("qwen2_5_vl_7b", tmp_path / "model", weights=False, tokenizer_dir=tiny_model_dir)
    config = json.loads((model / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vision_config"]["depth"]) == (3584, 28, 32)
    corpus = tmp_path / "chats.jsonl"
    write_image_chats(corpus, 1, sizes="1280x720")
    opts = BenchOptions(data=(str(corpus),))
    coord = Coordinator(Layout(), "bench-7b")
    _, _, _, facts = bench_corpus(opts, run_options(opts, model), model, coord.layout, coord)
    assert facts["image_tokens"] in (46 * 26, 2 * 46 * 26)
