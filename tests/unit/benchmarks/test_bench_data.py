"""bin/bench.py --data on CPU: a corpus read, tokenized and batched as bin/extract.py makes it, and both timed
modes through the real engine on exactly those batches."""

import json
import subprocess
import sys

from bench_modes import both_modes
from extract_runs import ROOT

from benchmarks.extraction_vs_prefill import BenchOptions, bench_corpus, run_options
from offline_extract import planning
from offline_extract.default_model import TRAINING_TEXT
from offline_extract.engine.distributed import Coordinator, Layout
from offline_extract.extraction import sample_tokenizer
from offline_extract.store.index import iter_samples
from offline_extract.store.manifest import file_fingerprint


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
