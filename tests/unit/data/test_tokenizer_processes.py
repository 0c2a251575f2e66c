import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from offline_extract.data import corpus
from offline_extract.data.corpus import Reject, rows
from offline_extract.data.sources import open_sources
from offline_extract.data.tokenization import SampleTokenizer, from_rows
from offline_extract.data.tokenizer_processes import AHEAD_PER_PROCESS, TokenizerProcesses
from offline_extract.engine.distributed import Layout, Share
from offline_extract import extraction
from offline_extract.extraction import pending_samples
from offline_extract.summary import Tally


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return SampleTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), max_length=64)


def _lines(n: int) -> list[str]:
    """Chats, texts, chats with no assistant turn (rejected by the tokenizer), lines that are no record (by the
    reader), and ids given twice."""
    out = []
    for i in range(n):
        if i % 5 == 0:
            turns = [{"role": "user", "content": f"question {i} " * (i % 7 + 1)}]
            turns.append({"role": "assistant", "content": f"answer {i} " * (i % 5 + 1)})
            out.append(json.dumps({"id": f"r{i}", "messages": turns}))
        elif i % 5 in (1, 2):
            out.append(json.dumps({"id": f"r{i - 1 if i % 25 == 2 else i}", "text": f"text {i} " * i}))
        elif i % 5 == 3:
            out.append(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"alone {i}"}]}))
        else:
            out.append('{"id": "broken", "text": ')
    return out


def _rows(tmp_path, n: int) -> list:
    path = tmp_path / "c.jsonl"
    path.write_text("".join(line + "\n" for line in _lines(n)))
    return list(rows(open_sources([str(path)])))


def _same(a, b) -> bool:
    if a is None or b is None or isinstance(a, Reject) or isinstance(b, Reject):
        return a == b
    return (
        (a.index, a.id, a.line, a.source_len, a.truncated) == (b.index, b.id, b.line, b.source_len, b.truncated)
        and np.array_equal(a.input_ids, b.input_ids)
        and np.array_equal(a.loss_mask, b.loss_mask)
    )


def test_the_processes_give_each_chunk_what_the_tokenizer_gives_it_here_in_the_chunks_order(tokenizer, tmp_path):
    read = _rows(tmp_path, 60)
    wanted = [i % 7 != 6 for i in range(60)]  # others' rows and done ones: their ids alone
    chunks = [(k, (read[k * 5 : k * 5 + 5], wanted[k * 5 : k * 5 + 5])) for k in range(12)]
    assert len(chunks) > 3 * AHEAD_PER_PROCESS  # more chunks than are ever in flight
    with TokenizerProcesses(3, tokenizer) as apart:
        apart.ready()  # as the bench starts its clock: nothing of it comes out later
        got = list(apart.many_ahead(iter(chunks)))
    assert [key for key, _ in got] == list(range(12))
    made = [m for _, ms in got for m in ms]
    here = from_rows(tokenizer, read, wanted)
    assert len(made) == len(here) == 60
    kinds = {type(m).__name__ for _, m in made}
    assert kinds == {"Sample", "Reject", "NoneType"}
    # A row not wanted is read for its id alone, where it has one.
    assert [i for i, (_, m) in enumerate(made) if m is None] == [i for i in range(60) if not wanted[i] and i % 5 != 4]
    assert all(a[0] == b[0] and _same(a[1], b[1]) for a, b in zip(made, here))


def test_a_run_reads_the_same_samples_and_rejects_with_the_rows_parsed_in_the_processes(
    tokenizer, tmp_path, monkeypatch
):
    # Two replicas' shares, a resume's done records, and ids given twice: the parent settles which are
    # duplicates and which are its own, in order, and parses none of the rows itself.
    _rows(tmp_path, 150)
    data = [str(tmp_path / "c.jsonl")]
    done = np.zeros(40, dtype=bool)
    done[[0, 5, 11, 12, 30]] = True

    def run(layout, apart):
        tally = Tally(None, strict=False, nonfinite="fail")
        rejects = []
        tally.left_out = lambda reject: (rejects.append(reject), Tally.left_out(tally, reject))
        samples = list(pending_samples(data, Share(layout, done), tokenizer, done, tally, apart))
        return samples, rejects, tally.summary

    layouts = [Layout(rank=r, world_size=2) for r in range(2)]
    here = [run(layout, None) for layout in layouts]

    def refused(*args, **kwargs):
        raise AssertionError("a row parsed in the process that runs the forwards")

    monkeypatch.setattr(corpus, "_parse", refused)
    with TokenizerProcesses(2, tokenizer) as apart:
        there = [run(layout, apart) for layout in layouts]
    for (s_here, r_here, sum_here), (s_there, r_there, sum_there) in zip(here, there):
        assert len(s_here) == len(s_there) and all(_same(a, b) for a, b in zip(s_here, s_there))
        assert r_here == r_there and sum_here == sum_there
    assert sum(len(s) for s, _, _ in here) > 0 and all(sum_.resumed for _, _, sum_ in here)
    reasons = [r.reason for _, rs, _ in here for r in rs]
    assert any("duplicate id" in r for r in reasons) and any("invalid JSON" in r for r in reasons)
    assert sum(sum_.records for _, _, sum_ in here) == 150


def test_a_record_the_tokenizer_refuses_whole_gives_its_error_in_its_place(tiny_model_dir, tmp_path):
    # A tokenizer without a chat template: chat records are a configuration problem (`SampleTokenizer`), said
    # where the first chat comes and not for the texts around it.
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf.chat_template = None
    tokenizer = SampleTokenizer(hf, max_length=64)
    read = _rows(tmp_path, 6)  # a chat, two texts, a chat with no answer, a broken line, a chat
    with TokenizerProcesses(2, tokenizer) as apart:
        ((_, made),) = apart.many_ahead([("rows", (read, [True] * len(read)))])
    assert [type(m).__name__ for _, m in made] == ["ValueError", "Sample", "Sample", "Reject", "Reject", "ValueError"]
    assert "no chat template" in str(made[0][1])


@pytest.mark.parametrize("processes", [0, 2])
def test_a_refused_record_stops_the_run_where_it_comes_unless_its_id_is_a_duplicate(
    tiny_model_dir, tmp_path, processes
):
    # As before the rows were parsed in the processes: a duplicate is rejected as such, never tokenized.
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf.chat_template = None
    tokenizer = SampleTokenizer(hf, max_length=64)
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    lines = [{"id": "a", "text": "hello there"}, {"id": "a", "messages": chat}, {"id": "b", "text": "more"}]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(line) + "\n" for line in lines))
    none = np.zeros(0, dtype=bool)

    def run():
        tally = Tally(None, strict=False, nonfinite="fail")
        with TokenizerProcesses(processes, tokenizer) if processes else contextlib.nullcontext() as apart:
            samples = [
                s.id for s in pending_samples([str(corpus)], Share(Layout(), none), tokenizer, none, tally, apart)
            ]
        return samples, tally.summary

    samples, summary = run()
    assert samples == ["a", "b"] and (summary.records, summary.rejected) == (3, 1)
    lines.append({"id": "c", "messages": chat})
    corpus.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match="no chat template"):
        run()


def test_a_worker_killed_from_outside_is_said_and_closing_ends_every_worker(tokenizer, tmp_path):
    apart = TokenizerProcesses(2, tokenizer)
    procs = [w.proc for w in apart._workers]
    # Out of the terminal's process group, which a Ctrl-C signals whole: the parent stops them itself.
    assert all(os.getpgid(p.pid) != os.getpgid(0) for p in procs)
    procs[0].kill()
    procs[0].wait()
    with pytest.raises(RuntimeError, match="tokenizing process .* ended with exit status -9"):
        list(apart.many_ahead([(0, (_rows(tmp_path, 3), [True] * 3))]))
    apart.close()
    assert all(p.poll() is not None for p in procs)


def test_workers_import_the_tokenizers_libraries_before_they_are_handed_it(tokenizer, tmp_path):
    # Started before the run has a tokenizer, a worker spends the wait on its imports (transformers, the Rust
    # tokenizers library, torch), which its tokenizer's unpickling would otherwise pay before the first batch.
    apart = TokenizerProcesses(1)
    try:
        with pytest.raises(RuntimeError, match="no tokenizer yet"):
            list(apart.many_ahead([(0, ([], []))]))
        maps = Path(f"/proc/{apart._workers[0].proc.pid}/maps")
        deadline = time.monotonic() + 120
        while "tokenizers.abi3.so" not in maps.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "tokenizers.abi3.so" in maps.read_text(), "the worker did not import the tokenizers library"
        apart.hand(tokenizer)
        with pytest.raises(RuntimeError, match="handed their tokenizer already"):
            apart.hand(tokenizer)
        read = _rows(tmp_path, 6)
        ((_, made),) = apart.many_ahead([("rows", (read, [True] * len(read)))])
        here = from_rows(tokenizer, read, [True] * len(read))
        assert len(made) == len(here) == 6 and all(_same(m, h) for (_, m), (_, h) in zip(made, here))
    finally:
        apart.close()


def test_a_worker_whose_parent_ends_before_handing_it_a_tokenizer_ends_quietly():
    # Started before the run has its tokenizer, a worker outlives a run stopped during its start-up: the
    # parent's exit closes its stdin, and a traceback would land in the user's terminal seconds after.
    done = subprocess.run(
        [sys.executable, "-m", "offline_extract.data.tokenizer_processes"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stderr) == (0, "")


def test_an_image_models_tokenizer_is_refused_with_the_option_to_give(tokenizer):
    class WithProcessor:
        processor = object()
        model = "org/vl-model"

    with pytest.raises(ValueError, match="org/vl-model prepares image chats.*--tokenizer-processes 0"):
        TokenizerProcesses(2, WithProcessor())


def test_closing_with_results_unread_ends_at_once(tokenizer, tmp_path):
    # Its workers wait to write results nobody reads, its senders to write chunks nobody takes: a run stopped.
    big = [(k, (_rows(tmp_path, 60), [True] * 60)) for k in range(8)]
    apart = TokenizerProcesses(2, tokenizer)
    results = apart.many_ahead(iter(big))
    next(results)
    closing = threading.Thread(target=apart.close)
    closing.start()
    closing.join(timeout=30)
    assert not closing.is_alive()
    assert all(w.proc.poll() is not None for w in apart._workers)


def test_a_replicas_chunks_hold_a_tokenizer_calls_worth_of_its_own_rows(tokenizer, tmp_path, monkeypatch):
    # One replica of four reads every row for the ids, a quarter of them its own: a chunk of 64 rows would give
    # the tokenizer 16 records a call. A resume's done rows give it none: those chunks end at ROWS_TOGETHER.
    _rows(tmp_path, 700)
    monkeypatch.setattr(extraction, "ROWS_TOGETHER", 400)
    done = np.zeros(700, dtype=bool)
    done[:400] = True
    calls = []

    def counting(tokenizer, rows, wanted):
        calls.append((len(rows), sum(wanted)))
        return from_rows(tokenizer, rows, wanted)

    monkeypatch.setattr(extraction, "from_rows", counting)
    layout = Layout(rank=1, world_size=4)
    tally = Tally(None, strict=False, nonfinite="fail")
    data = [str(tmp_path / "c.jsonl")]
    list(pending_samples(data, Share(layout, done), tokenizer, done, tally, None))
    # The done rows for their ids, then 64 of the 75 left to this replica (300 dealt out in four), then the rest.
    assert [w for _, w in calls] == [0, extraction.TOKENIZED_TOGETHER, 11]
    assert calls[0][0] == 400 and sum(rows for rows, _ in calls) == 700
    assert tally.summary.records == 75  # the done rows went with the first row left, to replica 0


def test_a_chunk_of_long_records_ends_at_its_bytes(tokenizer, tmp_path, monkeypatch):
    # The chunks in flight to the processes are held twice in the run's process: long records keep fewer of them.
    _rows(tmp_path, 100)
    sizes = [len(line) + 1 for line in _lines(100)]
    monkeypatch.setattr(extraction, "CHUNK_BYTES", 1000)
    calls = []

    def counting(tokenizer, rows, wanted):
        calls.append(sum(len(row.raw) for row in rows))
        return from_rows(tokenizer, rows, wanted)

    monkeypatch.setattr(extraction, "from_rows", counting)
    tally = Tally(None, strict=False, nonfinite="fail")
    none = np.zeros(0, dtype=bool)
    list(pending_samples([str(tmp_path / "c.jsonl")], Share(Layout(), none), tokenizer, none, tally, None))
    assert sum(calls) == sum(sizes) and len(calls) > 1
    assert all(1000 <= got < 1000 + max(sizes) for got in calls[:-1])
