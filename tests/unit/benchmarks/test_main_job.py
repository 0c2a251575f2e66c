"""benchmarks/main_job.py's inputs: the real-English corpus the model-class benches run on is the standard library's
docstrings, the same records on every run of one Python, texts and chats in turn, as bin/extract.py reads them."""

import json

from click.testing import CliRunner

from benchmarks.main_job import main
from offline_extract.data.corpus import Record, read_corpus


def test_the_docstring_corpus_is_the_same_records_every_time_texts_and_chats_in_turn(tmp_path):
    first, again = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path in (first, again):
        result = CliRunner().invoke(main, ["docstrings", str(path), "--records", "6"])
        assert result.exit_code == 0, result.output
    assert first.read_bytes() == again.read_bytes()
    rows = [json.loads(line) for line in first.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["chat-0", "doc-1", "chat-2", "doc-3", "chat-4", "doc-5"]
    assert [r["messages"][1]["role"] for r in rows[::2]] == ["assistant"] * 3
    assert all(len(r["text"]) > 6 * 200 for r in rows[1::2]), "six docstrings of more than 200 characters each"
    records = [r for r in read_corpus([str(first)]) if isinstance(r, Record)]
    assert [r.id for r in records] == [r["id"] for r in rows]
