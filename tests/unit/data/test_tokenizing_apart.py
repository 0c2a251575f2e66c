import os
import threading

import numpy as np
import pytest
from transformers import AutoTokenizer

from offline_extract.data.corpus import Record, Reject
from offline_extract.data.tokenization import Sample, SampleTokenizer
from offline_extract.data.tokenizing_apart import AHEAD_PER_PROCESS, TokenizingApart


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return SampleTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), max_length=64)


def _records(n: int) -> list[Record]:
    out = []
    for i in range(n):
        if i % 3 == 0:
            messages = (("user", f"question {i} " * (i % 7 + 1)), ("assistant", f"answer {i} " * (i % 5 + 1)))
            out.append(Record(source="c.jsonl", line=i + 1, index=i, id=f"r{i}", format="openai", messages=messages))
        elif i % 3 == 1:
            out.append(Record(source="c.jsonl", line=i + 1, index=i, id=f"r{i}", format="text", text=f"text {i} " * i))
        else:  # no assistant turn: a reject
            messages = (("user", f"alone {i}"),)
            out.append(Record(source="c.jsonl", line=i + 1, index=i, id=f"r{i}", format="openai", messages=messages))
    return out


def _same(a, b) -> bool:
    if isinstance(a, Reject) or isinstance(b, Reject):
        return a == b
    return (
        (a.index, a.id, a.line, a.source_len, a.truncated) == (b.index, b.id, b.line, b.source_len, b.truncated)
        and np.array_equal(a.input_ids, b.input_ids)
        and np.array_equal(a.loss_mask, b.loss_mask)
    )


def test_the_processes_give_each_chunk_what_the_tokenizer_gives_it_here_in_the_chunks_order(tokenizer):
    records = _records(60)
    chunks = [(k, records[k * 5 : k * 5 + 5]) for k in range(12)]  # more chunks than are ever in flight
    assert len(chunks) > 3 * AHEAD_PER_PROCESS
    with TokenizingApart(tokenizer, 3) as apart:
        got = list(apart.many_ahead(iter(chunks)))
    assert [key for key, _ in got] == list(range(12))
    made = [m for _, ms in got for m in ms]
    here = tokenizer.many(records)
    assert len(made) == len(here) == 60
    assert any(isinstance(m, Reject) for m in made) and any(isinstance(m, Sample) for m in made)
    assert all(_same(a, b) for a, b in zip(made, here))


def test_an_error_raised_there_is_raised_here_where_its_chunk_would_have_come(tiny_model_dir):
    # A tokenizer without a chat template: chat records are a configuration problem (`SampleTokenizer`).
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf.chat_template = None
    tokenizer = SampleTokenizer(hf, max_length=64)
    records = _records(6)
    texts = [r for r in records if r.format == "text"]
    with TokenizingApart(tokenizer, 2) as apart:
        results = apart.many_ahead([("texts", texts), ("chats", records)])
        key, made = next(results)
        assert key == "texts" and len(made) == len(texts)
        with pytest.raises(ValueError, match="no chat template"):
            next(results)


def test_a_worker_killed_from_outside_is_said_and_closing_ends_every_worker(tokenizer):
    apart = TokenizingApart(tokenizer, 2)
    procs = [w.proc for w in apart._workers]
    # Out of the terminal's process group, which a Ctrl-C signals whole: the parent stops them itself.
    assert all(os.getpgid(p.pid) != os.getpgid(0) for p in procs)
    procs[0].kill()
    procs[0].wait()
    with pytest.raises(RuntimeError, match="tokenizing process .* ended with exit status -9"):
        list(apart.many_ahead([(0, _records(3))]))
    apart.close()
    assert all(p.poll() is not None for p in procs)


def test_an_image_models_tokenizer_is_refused_with_the_option_to_give(tokenizer):
    class WithProcessor:
        processor = object()
        model = "org/vl-model"

    with pytest.raises(ValueError, match="org/vl-model prepares image chats.*--tokenizer-processes 0"):
        TokenizingApart(WithProcessor(), 2)


def test_closing_with_results_unread_ends_at_once(tokenizer):
    # Its workers wait to write results nobody reads, its senders to write chunks nobody takes: a run stopped.
    big = [(k, _records(60)) for k in range(8)]
    apart = TokenizingApart(tokenizer, 2)
    results = apart.many_ahead(iter(big))
    next(results)
    closing = threading.Thread(target=apart.close)
    closing.start()
    closing.join(timeout=30)
    assert not closing.is_alive()
    assert all(w.proc.poll() is not None for w in apart._workers)
