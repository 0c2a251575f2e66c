"""Corpora in the forms people keep them: JSONL, gzip JSONL, a .json file of one JSON array, parquet, a
datasets.save_to_disk folder and a hub data set (from the local cache, offline), read into the same records and rejects."""

import gzip
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from extract_runs import hub_cache

from offline_extract import hub
from offline_extract.data.corpus import Record, read_corpus
from offline_extract.data import sources
from offline_extract.data.sources import CorpusReadError, open_source
from offline_extract.store import manifest

ROWS = [
    {"id": "a", "text": "hello"},
    {"id": "b", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    {"id": "c", "text": ""},
    {"text": "no id"},
    {"id": "e", "messages": [{"role": "user", "content": "no answer"}]},
]


def _table(rows):
    # A table has every column in every row: the fields a record lacks are nulls.
    keys = sorted({key for row in rows for key in row})
    return [{key: row.get(key) for key in keys} for row in rows]


@pytest.fixture
def forms(tmp_path, offline_hub):
    """The same five records in every supported form, by name as --data takes it."""
    import datasets

    text = "".join(json.dumps(row) + "\n" for row in ROWS)
    (tmp_path / "c.jsonl").write_text(text)
    # Pretty-printed, as ShareGPT-style files are: an element spans many lines.
    (tmp_path / "c.json").write_text(json.dumps(ROWS, indent=2))
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write(text)
    pq.write_table(pa.Table.from_pylist(_table(ROWS)), tmp_path / "c.parquet")
    datasets.Dataset.from_list(_table(ROWS)).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "chats" / "data").mkdir(parents=True)
    (tmp_path / "chats" / "data" / "train.jsonl").write_text(text)
    hub_cache(offline_hub, "org/chats", tmp_path / "chats", kind="datasets")
    return {name: str(tmp_path / name) for name in ("c.jsonl", "c.jsonl.gz", "c.json", "c.parquet", "saved")} | {
        "hub": "org/chats"
    }


def _outcome(item):
    """What a record came to, its numbering, and its id unless the id was derived from the source's name."""
    own_id = item.id if item.id and ":" not in item.id else None
    if isinstance(item, Record):
        return ("record", item.line, item.index, own_id, item.messages or item.text)
    return ("reject", item.line, item.index, own_id, item.reason)


def test_every_form_gives_the_same_records_numbering_and_rejects(forms):
    expected = [_outcome(item) for item in read_corpus([forms["c.jsonl"]])]
    assert [kind for kind, *_ in expected] == ["record", "record", "reject", "record", "reject"]
    assert expected[2][4] == "text is empty" and expected[4][4] == "no assistant turn"
    for name, data in forms.items():
        items = list(read_corpus([data]))
        assert [_outcome(item) for item in items] == expected, name
        assert {item.source for item in items} == {data}, name
    assert next(r for r in read_corpus([forms["c.parquet"]]) if r.index == 3).id == "c.parquet:4"
    assert next(r for r in read_corpus([forms["c.json"]]) if r.index == 3).id == "c.json:4"
    assert next(r for r in read_corpus([forms["hub"]]) if r.index == 3).id == "org/chats:4"


def test_records_are_numbered_across_sources_of_different_kinds(forms):
    items = list(read_corpus([forms["c.parquet"], forms["c.jsonl.gz"]]))
    assert [item.index for item in items] == list(range(10))
    assert [item.line for item in items] == [1, 2, 3, 4, 5] * 2
    # The same explicit ids in both sources are duplicates, whatever the kinds.
    assert items[5].reason == f"duplicate id 'a' (first at {forms['c.parquet']}:1)"


def test_sources_say_how_many_records_they_hold_where_they_can(forms):
    counts = {name: open_source(data).count() for name, data in forms.items()}
    assert counts == {"c.jsonl": 5, "c.jsonl.gz": 5, "c.json": 5, "c.parquet": 5, "saved": 5, "hub": None}


def test_a_saved_dataset_dict_needs_its_split_named(tmp_path):
    import datasets

    splits = {name: datasets.Dataset.from_list(_table(ROWS)) for name in ("train", "test")}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=f"holds the splits train, test: give one, e.g. --data {tmp_path}/dd/train"):
        open_source(str(tmp_path / "dd"))
    assert len(list(read_corpus([tmp_path / "dd" / "train"]))) == len(ROWS)


def test_what_is_not_a_corpus_is_named(tmp_path, offline_hub):
    with pytest.raises(FileNotFoundError, match="corpus file not found: missing.jsonl"):
        open_source("missing.jsonl")
    with pytest.raises(IsADirectoryError, match="did not write"):
        open_source(str(tmp_path))
    for name in ("b.jsonl", "a.jsonl", "notes.txt"):
        (tmp_path / "jsonl" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "jsonl" / name).write_text("")
    with pytest.raises(
        IsADirectoryError,
        match=r"jsonl; to read the files in it, give each its own --data \(it holds 2 "
        r"corpus-like files: a.jsonl, b.jsonl\)$",
    ):
        open_source(str(tmp_path / "jsonl"))
    with pytest.raises(hub.HubError) as e:
        open_source("nobody/nothing:train")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("no corpus file or folder at nobody/nothing:train, and dataset nobody/nothing is not")
    assert message.endswith("HF_HUB_OFFLINE is set")


def test_a_folder_corpus_has_a_fingerprint_that_follows_its_files(forms, tmp_path):
    saved = forms["saved"]
    before = manifest.file_fingerprint(saved)
    copy = tmp_path / "elsewhere" / "saved"
    shutil.copytree(saved, copy)
    assert {k: manifest.file_fingerprint(copy)[k] for k in manifest.CORPUS_KEYS} == {
        k: before[k] for k in manifest.CORPUS_KEYS
    }
    arrow = next(copy.glob("*.arrow"))
    data = bytearray(arrow.read_bytes())
    data[-20] ^= 1
    arrow.write_bytes(data)
    assert manifest.file_fingerprint(copy)["sampled_sha256"] != before["sampled_sha256"]


def _jsonl_gz(path, n: int) -> bytes:
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps({"text": f"record {i} " * 50}) + "\n" for i in range(n))
    return path.read_bytes()


def test_a_truncated_or_corrupt_gzip_is_named_with_how_far_it_was_read(tmp_path):
    path = tmp_path / "c.jsonl.gz"
    data = _jsonl_gz(path, 2000)
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorpusReadError, match=rf"^{path} cannot be read past line \d+: .*truncated or damaged") as e:
        list(read_corpus([path]))
    assert isinstance(e.value.__cause__, EOFError), "the case click would print as a bare 'Aborted!'"

    assert open_source(str(path)).count() is None, "counting for the ETA leaves the error to the reader"

    corrupt = bytearray(data)
    corrupt[-8] ^= 0xFF  # the CRC in the trailer
    path.write_bytes(bytes(corrupt))
    with pytest.raises(CorpusReadError, match=rf"^{path} cannot be read past line 2000: CRC check failed"):
        list(read_corpus([path]))


def test_a_truncated_parquet_file_is_named_before_anything_is_read(tmp_path):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), path)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(CorpusReadError, match=rf"^{path} is not a readable parquet file: .*magic bytes"):
        open_source(str(path))


def test_a_parquet_name_on_other_bytes_is_named_before_anything_is_read(tmp_path):
    # A Git LFS pointer checked out in place of the data: it was read as JSONL, every line rejected as invalid JSON.
    path = tmp_path / "train.parquet"
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 42\n")
    with pytest.raises(CorpusReadError, match=rf"^{path} is not a parquet file: it does not begin with .*PAR1"):
        open_source(str(path))


def test_a_json_array_is_read_element_by_element_and_each_is_judged_as_a_jsonl_line_is(tmp_path):
    path = tmp_path / "chats.json"
    # A BOM and blank lines around the array, an element that is not an object, bytes that are not UTF-8 and an
    # unpaired surrogate escape, each inside one element: that element alone is rejected, as its line would be.
    path.write_bytes(
        b"\xef\xbb\xbf\n  [\n"
        + b",\n".join(
            [
                json.dumps(ROWS[0], indent=2).encode(),
                b"[1, 2]",
                b'{"text": "caf\xe9"}',
                b'{"text": "\\ud800"}',
                json.dumps(ROWS[1]).encode(),
            ]
        )
        + b"\n]\n\n"
    )
    items = list(read_corpus([path]))
    assert [(item.line, item.index) for item in items] == [(i, i - 1) for i in range(1, 6)]
    assert [item.reason if not isinstance(item, Record) else item.id for item in items] == [
        "a",
        "expected a JSON object, got array",
        "not valid UTF-8: invalid continuation byte at byte 14",
        "contains an unpaired surrogate escape \\ud800, which is not valid text",
        "b",
    ]
    assert [item.id for item in items[1:4]] == [None, None, "chats.json:4"]
    assert open_source(str(path)).count() == 5
    path.write_text(" [ ] ")
    assert list(read_corpus([path])) == [] and open_source(str(path)).count() == 0


def test_a_json_file_of_jsonl_is_still_read_line_by_line(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    assert open_source(str(path)).kind == "jsonl"
    assert [(item.line, item.index) for item in read_corpus([path])] == [(i, i - 1) for i in range(1, 6)]


ARRAY = json.dumps(ROWS[:2], indent=2)
NOT_LINES = {
    # name: (content, the refusal after the name)
    "c.json.gz": (
        gzip.compress(ARRAY.encode()),
        " is a gzipped JSON array; gzipped, only JSON lines are read. Convert "
        "it to JSONL, which streams: zcat {path} | jq -c '.[]' | gzip > corpus.jsonl.gz (or decompress it "
        "into a .json file, read as one array)",
    ),
    "c.jsonl": (
        ARRAY,
        " holds a JSON array, not JSON lines (it begins with '['): name it .json to read it as one array "
        "of records, or convert it to JSONL: jq -c '.[]' {path} > corpus.jsonl",
    ),
    "one_line.jsonl": (
        json.dumps(ROWS) + "\n",
        " holds a JSON array, not JSON lines (it begins with '['): name it .json "
        "to read it as one array of records, or convert it to JSONL: jq -c '.[]' {path} > corpus.jsonl",
    ),
    "wrapped.json": (
        json.dumps({"version": 1, "data": ROWS}, indent=2),
        " holds one JSON object spread over lines, "
        "not records: the records are presumably its list under 'data' (5 elements). Convert them to "
        "JSONL: jq -c '.data[]' {path} > corpus.jsonl",
    ),
    "compact.json": (
        json.dumps({"my data": ROWS}) + "\n",
        " holds one JSON object, not records: the records are "
        "presumably its list under 'my data' (5 elements). Convert them to JSONL: jq -c "
        "'.[\"my data\"][]' {path} > corpus.jsonl",
    ),
    "splits.json": (
        json.dumps({"train": ROWS, "test": ROWS}, indent=1),
        " holds one JSON object spread over lines, not "
        "records: it holds lists under 'train', 'test'. Convert the one of records to JSONL, e.g. jq -c "
        "'.train[]' {path} > corpus.jsonl",
    ),
    "record.json": (
        json.dumps(ROWS[1], indent=1),
        " holds one JSON object spread over lines, not records one per line "
        "(JSONL) or in a JSON array: it is one record; put it on one line (jq -c . {path} > corpus.jsonl)",
    ),
}


@pytest.mark.parametrize("name", NOT_LINES)
def test_json_that_is_not_json_lines_is_named_with_how_to_convert_it_before_anything_is_read(name, tmp_path):
    # Each was read as JSONL, every line of it rejected on its own (or, on one line, the wrapper as one bad record).
    content, refusal = NOT_LINES[name]
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(CorpusReadError) as refused:
        open_source(str(path))
    assert str(refused.value) == f"{path}{refusal.format(path=path)}"


def test_json_lines_with_a_damaged_or_unknown_first_record_are_still_read_line_by_line(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"text": "cut off"\n' + "".join(json.dumps(row) + "\n" for row in ROWS))
    items = list(read_corpus([path]))
    assert [isinstance(item, Record) for item in items] == [False, True, True, False, True, False]
    path.write_text(json.dumps({"prompt": "a field no format has", "tags": ["x"]}) + "\n" + json.dumps(ROWS[0]) + "\n")
    assert open_source(str(path)).kind == "jsonl", "one object per line, whatever its fields, is JSON lines"
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(ROWS[:2]) + "\n" + json.dumps(ROWS[0]) + "\n")  # a first record that is an array
    assert [isinstance(item, Record) for item in read_corpus([path])] == [False, True]


def test_a_damaged_json_array_is_named_with_its_line_and_column_before_any_record_is_read(tmp_path):
    path = tmp_path / "c.json"
    text = json.dumps(ROWS, indent=2)
    path.write_text(text[: len(text) // 2] + "\n\n")
    with pytest.raises(
        CorpusReadError,
        match=rf"^{path} is a JSON array that does not end with its closing '\]' "
        rf"\(a truncated file\?\)$",
    ):
        open_source(str(path))

    # Damage that leaves the closing bracket: a missing comma between the second and third elements.
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line == "  },") + 1
    lines[at - 1] = "  }"
    path.write_text("\n".join(lines))
    read = read_corpus([path])
    with pytest.raises(
        CorpusReadError,
        match=rf"^{path} is not a valid JSON array: Expecting ',' or '\]' after an "
        rf"element at line {at + 1} column 3 \(after 1 element; a truncated",
    ):
        next(read)  # the first record is not handed out before the damage after it is found
    assert open_source(str(path)).count() is None, "counting for the ETA leaves the error to the reader"

    path.write_text(text + "\n[]")
    with pytest.raises(CorpusReadError, match=r"Extra data after the array's closing '\]' at line \d+ column 1 "):
        list(read_corpus([path]))


@pytest.mark.parametrize("name, opening, closing", [("c.jsonl", "[", "]"), ("c.json", '{"a": ', "}")])
def test_a_value_nested_too_deep_to_read_is_named_with_its_file(name, opening, closing, tmp_path):
    # Telling JSON lines from one value parsed the first line, whose RecursionError escaped naming no file.
    deep = opening * 10_000 + "1" * (opening == '{"a": ') + closing * 10_000 + "\n"
    path = tmp_path / name
    path.write_text(deep)
    with pytest.raises(
        CorpusReadError,
        match=rf"^{path} is one JSON value nested too deep to read \(Python's json "
        rf"stops near \d+ levels of \[ and {{\), not records",
    ):
        open_source(str(path))
    # Followed by records, it is the first line of JSON lines, rejected on its own.
    path.write_text(deep + json.dumps(ROWS[0]) + "\n")
    first, second = read_corpus([path])
    assert first.line == 1 and "invalid JSON: maximum recursion depth exceeded" in first.reason
    assert isinstance(second, Record) and second.id == "a"


@pytest.mark.parametrize("name", ["c.jsonl", "c.jsonl.gz"])
def test_a_line_past_the_most_a_record_may_be_is_rejected_without_being_read_whole(name, tmp_path, monkeypatch):
    # A 50 MB line was read, parsed and tokenized whole; the reader now holds at most MAX_LINE_BYTES of a line.
    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 1000)
    at_most = json.dumps({"text": "x" * (1000 - 12)})
    assert len(at_most) == 1000
    lines = [json.dumps(ROWS[0]), json.dumps({"text": "y" * 5_000}), "", at_most, json.dumps({"text": "after"})]
    text = "".join(line + "\n" for line in lines).encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    held, lines = [], sources._lines

    class Watched:
        def __init__(self, f):
            self.f = f

        def readline(self, size=-1):
            held.append(size)
            return self.f.readline(size)

    monkeypatch.setattr(sources, "_lines", lambda f: lines(Watched(f)))
    items = list(read_corpus([path]))
    assert [(item.line, type(item).__name__) for item in items] == [
        (1, "Record"),
        (2, "Reject"),
        (4, "Record"),
        (5, "Record"),
    ]
    assert items[1].reason == (
        "the line is 5.0 KB, past the 1.0 KB a record may be: split it into records, or cut "
        "its text (only --max-length tokens of it are extracted)"
    )
    assert items[2].text == "x" * 988 and items[3].id == f"{name}:5"
    assert held and all(0 < size <= 1 << 20 for size in held), "no read of a line without a bound"


# Reads --data - in a process of its own, whose standard input the test chooses, and prints what it found.
_READ_STDIN = """
import json
from offline_extract.data.corpus import read_corpus
from offline_extract.data.sources import open_source

try:
    source = open_source("-")
except ValueError as e:
    print(json.dumps({"refused": str(e)}))
else:
    ids = [record.id for record in read_corpus(["-"])]
    print(json.dumps({"kind": source.kind, "streamed": source.streamed, "path": str(source.path), "ids": ids}))
"""


def _read_stdin(stdin) -> dict:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _READ_STDIN], stdin=stdin, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_dash_reads_a_pipe_as_it_streams_and_a_redirected_file_as_that_file(tmp_path):
    # It said "corpus file not found: -".
    import subprocess

    corpus = tmp_path / "c.jsonl.gz"
    with gzip.open(corpus, "wt") as f:
        f.write('{"text": "one"}\n{"text": "two"}\n')
    with open(corpus, "rb") as f:
        redirected = _read_stdin(f)
    # As if the file were named: its kind by its bytes, its fingerprint (so a rerun can resume), ids by its name.
    assert redirected == {
        "kind": "jsonl.gz",
        "streamed": False,
        "path": str(corpus),
        "ids": ["c.jsonl.gz:1", "c.jsonl.gz:2"],
    }
    zcat = subprocess.Popen(["zcat", str(corpus)], stdout=subprocess.PIPE)
    streamed = _read_stdin(zcat.stdout)
    zcat.wait()
    assert streamed == {"kind": "jsonl", "streamed": True, "path": "/dev/stdin", "ids": ["stdin:1", "stdin:2"]}


def test_a_dash_with_a_terminal_on_standard_input_is_refused_instead_of_waiting_for_typing():
    import os
    import pty

    leader, terminal = pty.openpty()
    try:
        refused = _read_stdin(terminal)
    finally:
        os.close(leader)
        os.close(terminal)
    assert refused == {
        "refused": "--data - reads the corpus from standard input, which is a terminal here: pipe the corpus into the "
        "command (zcat corpus.jsonl.gz | python bin/extract.py --data - ...), or name its file"
    }


def test_a_device_is_no_corpus_and_is_refused_before_it_is_read():
    # --data /dev/zero read on for ever, with no line end in sight.
    with pytest.raises(CorpusReadError) as refused:
        open_source("/dev/zero")
    assert str(refused.value) == (
        "--data /dev/zero is a character device, not a corpus file or a pipe: give the corpus's file, or pipe it in"
    )
    with open("/dev/null", "rb") as nothing:
        assert _read_stdin(nothing) == {
            "refused": "--data - (standard input) is a character device, not a corpus file or a pipe: give the "
            "corpus's file, or pipe it in"
        }
