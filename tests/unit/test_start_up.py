"""The start-up's order (docs/start-up.md, issue 26): the tokenizer loads on a thread of its own beside
SGLang's model load, a tokenizer that fails stops that load at once, and the timings count as ours only
the part of the tokenizer's load that the run waited for.

In-process, with the session's engine handed out where the run builds its own (SGLang cannot start a
second engine in one process), so that the test decides how long the "load" lasts; bin/extract.py runs the
real load end to end in tests/e2e/test_extract_cli.py, whose start-up test checks the same marks."""
import json
import signal
import threading
import time

import pytest
from extract_runs import ROOT

from offline_extract import extraction
from offline_extract.options import ExtractOptions

CORPUS = str(ROOT / "examples" / "corpus.jsonl")


def _run(tmp_path, model_dir, **changes):
    settings = dict(data=(CORPUS,), out=str(tmp_path / "out"), model=str(model_dir), device="cpu", parity_samples=0,
                    tokens_per_batch=1024, seqs_per_batch=16, max_length=1024, progress=False, progress_every=0)
    opts = ExtractOptions(**{**settings, **changes})
    summary = extraction.run(opts)
    return summary, json.loads((tmp_path / "out" / "manifest.json").read_text())["timings"]


@pytest.fixture
def tokenizer_loaded(monkeypatch):
    """Set once the run's tokenizer is loaded and fingerprinted, on whichever thread loads it."""
    loaded = threading.Event()
    load = extraction.Job._tokenizer_now

    def loading(job):
        load(job)
        loaded.set()

    monkeypatch.setattr(extraction.Job, "_tokenizer_now", loading)
    return loaded


def test_the_tokenizer_loads_while_the_model_does_and_only_the_wait_for_it_is_ours(
        tiny_engine, tiny_model_dir, tmp_path, monkeypatch, tokenizer_loaded):
    def engine(cfg):
        # A load that ends only once the tokenizer is in: were the tokenizer loaded before or after the
        # model, it would not be.
        assert tokenizer_loaded.wait(120), "the tokenizer did not load while the model did"
        return tiny_engine

    monkeypatch.setattr(extraction, "Engine", engine)
    summary, t = _run(tmp_path, tiny_model_dir)
    assert summary.extracted == 24
    m = t["marks"]
    assert m["sglang imported"] <= m["tokenizer loading"] < m["tokenizer loaded"] < m["loaded"] <= m["tokenizer waited"]
    assert t["tokenizer_beside_load"]
    assert t["tokenizer_s"] == pytest.approx(m["tokenizer loaded"] - m["tokenizer loading"])
    # Loaded in full during the load, the tokenizer cost the run only the join after it.
    assert t["tokenizer_waited_s"] == pytest.approx(m["tokenizer waited"] - m["warm"]) and t["tokenizer_waited_s"] < 0.05
    assert t["ours_s"] + t["sglang_s"] + t["parity_gate_s"] == pytest.approx(t["startup_s"])
    assert t["ours_s"] == pytest.approx(t["imports_and_checks_s"] + t["tokenizer_waited_s"] + t["ours_other_s"])


def test_under_strict_the_tokenizer_loads_before_the_model_and_counts_as_ours(
        tiny_engine, tiny_model_dir, tmp_path, monkeypatch, tokenizer_loaded):
    """--strict tokenizes every record before the model loads, so it cannot wait for the load."""

    def engine(cfg):
        assert tokenizer_loaded.is_set(), "the model loaded before the tokenizer"
        return tiny_engine

    monkeypatch.setattr(extraction, "Engine", engine)
    summary, t = _run(tmp_path, tiny_model_dir, strict=True)
    assert summary.extracted == 24
    m = t["marks"]
    assert m["checked"] <= m["tokenizer loading"] < m["tokenizer loaded"] <= m["loading"]
    assert not t["tokenizer_beside_load"] and "tokenizer waited" not in m
    assert t["tokenizer_waited_s"] == t["tokenizer_s"] > 0


@pytest.fixture
def ctrl_c_raises():
    """SIGINT as a command runs with it (cli._Command.invoke): Python's handler, which raises
    KeyboardInterrupt. Importing offline_extract.commands, as other tests of this session do, installs the
    handler that ends a command still importing, under which the run rightly sends no interrupt."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_tokenizer_that_fails_stops_the_model_load_at_once(tiny_model_dir, tmp_path, monkeypatch, ctrl_c_raises):
    loads = []

    def tokenizer(opts, model_dir):
        raise OSError(f"{model_dir} holds no tokenizer")

    def engine(cfg):
        started = time.monotonic()
        while time.monotonic() - started < 120:  # a long load, in Python as SGLang's is
            time.sleep(0.01)
        loads.append(cfg)

    monkeypatch.setattr(extraction, "_sample_tokenizer", tokenizer)
    monkeypatch.setattr(extraction, "Engine", engine)
    started = time.monotonic()
    with pytest.raises(OSError, match="holds no tokenizer"):
        _run(tmp_path, tiny_model_dir)
    assert not loads and time.monotonic() - started < 60


def test_a_tokenizer_that_fails_after_the_load_is_raised_once_and_interrupts_nothing_later(
        tiny_engine, tiny_model_dir, tmp_path, monkeypatch):
    loaded = threading.Event()

    def tokenizer(opts, model_dir):
        assert loaded.wait(120)
        raise ValueError("the chat template does not parse")

    def engine(cfg):
        loaded.set()
        return tiny_engine

    monkeypatch.setattr(extraction, "_sample_tokenizer", tokenizer)
    monkeypatch.setattr(extraction, "Engine", engine)
    with pytest.raises(ValueError, match="the chat template does not parse"):
        _run(tmp_path, tiny_model_dir)
    for _ in range(20):  # an interrupt sent by the failed thread and left pending would land here
        time.sleep(0.01)


def test_the_last_forward_is_marked_after_a_long_last_samples_last_chunk(tiny_engine, tiny_model_dir, tmp_path, monkeypatch):
    """The feed reads a batch ahead, so the batches run out during the last batch's first forward; the
    tail is counted from its last (here the last chunk of a sample longer than the engine's budget)."""
    from offline_extract.timeline import Timeline

    corpus = tmp_path / "long_last.jsonl"
    long = tiny_engine.cfg.max_tokens_per_batch + 500
    records = [{"input_ids": [5 + i % 300 for i in range(n)]} for n in (40, 60, long)]  # within the vocabulary
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    chunked_at = []
    chunks = tiny_engine.chunks

    def timed_chunks(ids, chunk):
        for part in chunks(ids, chunk):
            chunked_at.append(Timeline().now())
            yield part

    monkeypatch.setattr(tiny_engine, "chunks", timed_chunks)
    monkeypatch.setattr(extraction, "Engine", lambda cfg: tiny_engine)
    summary, t = _run(tmp_path, tiny_model_dir, data=(str(corpus),), max_length=4096)
    assert summary.extracted == 3 and len(chunked_at) == 2
    assert chunked_at[-1] <= t["marks"]["last forward"] <= t["marks"]["drained"]
