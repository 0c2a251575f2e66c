import json
import os
import queue
import threading
from pathlib import Path

import pytest

from offline_extract.data.corpus import ImageRef, Record, Reject, read_corpus


def write_lines(path, lines):
    """Write raw JSONL; str items are JSON-encoded dicts or literal text, bytes are written verbatim."""
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            if isinstance(line, str):
                line = line.encode("utf-8")
            f.write(line + b"\n")
    return path


GOOD_TEXT = {"text": "fine"}


def test_sharegpt_roles_are_normalized(tmp_path):
    path = write_lines(
        tmp_path / "c.jsonl",
        [
            {
                "conversations": [
                    {"from": "system", "value": "S"},
                    {"from": "human", "value": "H"},
                    {"from": "gpt", "value": "G"},
                    {"from": "user", "value": "U"},
                    {"from": "chatgpt", "value": "C"},
                    {"from": "assistant", "value": "A"},
                ]
            }
        ],
    )
    [rec] = list(read_corpus([path]))
    assert rec.format == "sharegpt"
    assert rec.messages == (
        ("system", "S"),
        ("user", "H"),
        ("assistant", "G"),
        ("user", "U"),
        ("assistant", "C"),
        ("assistant", "A"),
    )
    assert rec.text is None and rec.input_ids is None and rec.loss_mask is None


def test_each_format(tmp_path):
    path = write_lines(
        tmp_path / "c.jsonl",
        [
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "id": "m"},
            {"text": "plain words", "id": 7},
            {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
            {"input_ids": [5, 6], "loss_mask": None},
            # labels beside a loss_mask (as a trainer's table may hold), and a null one as a table gives it: read
            {"input_ids": [5, 6], "loss_mask": [0, 1], "labels": [-100, 6]},
            {"text": "more words", "loss_mask": None, "labels": None},
            # HF-style labels without a loss_mask: the loss is where a label is not -100
            {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
        ],
    )
    chat, text, toks, toks_nomask, toks_labels, text_nulls, hf_labels = read_corpus([path])
    assert (chat.format, chat.messages, chat.id) == ("openai", (("user", "q"), ("assistant", "a")), "m")
    assert (text.format, text.text, text.id) == ("text", "plain words", "7")
    assert (toks.format, toks.input_ids, toks.loss_mask, toks.id) == ("tokens", (5, 6, 7), (0, 1, 1), "c.jsonl:3")
    assert (toks_nomask.input_ids, toks_nomask.loss_mask) == ((5, 6), None)
    assert (toks_labels.input_ids, toks_labels.loss_mask) == ((5, 6), (0, 1))
    assert (text_nulls.format, text_nulls.text) == ("text", "more words")
    assert (hf_labels.input_ids, hf_labels.loss_mask) == ((5, 6, 7, 8), (0, 0, 1, 1))


def test_openai_content_parts_are_joined_text(tmp_path):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    path = write_lines(
        tmp_path / "c.jsonl",
        [
            {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": [parts[0]]}]},
        ],
    )
    (record,) = read_corpus([path])
    assert record.messages == (("user", "first\nsecond"), ("assistant", "first"))


def test_openai_image_parts_resolve_against_the_corpus_folder(tmp_path, monkeypatch):
    (tmp_path / "corpus").mkdir()
    monkeypatch.chdir(tmp_path)  # a relative --data: the images are still found beside the corpus, not here
    data_url = "data:image/png;base64,iVBORw0KGgo="
    content = [
        {"type": "text", "text": "compare"},
        {"type": "image_url", "image_url": {"url": "pics/a.png"}},
        {"type": "image_url", "image_url": {"url": "file:///srv/b.jpg"}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": "file://localhost/srv/c.jpg"}},
        {"type": "image_url", "image_url": {"url": data_url}},
    ]
    path = write_lines(
        tmp_path / "corpus" / "c.jsonl",
        [
            {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "same"}]},
        ],
    )
    (record,) = read_corpus(["corpus/c.jsonl"])
    assert record.messages == (("user", ("compare", 0, 1, "and", 2, 3)), ("assistant", "same"))
    assert record.images == (
        ImageRef("messages[0].content[1].image_url", str(path.parent / "pics" / "a.png")),
        ImageRef("messages[0].content[2].image_url", "/srv/b.jpg"),
        ImageRef("messages[0].content[4].image_url", "/srv/c.jpg"),
        ImageRef("messages[0].content[5].image_url", data_url),
    )
    assert record.images[3].named == "messages[0].content[5].image_url (a data: URL)"


def test_llava_markers_take_the_listed_images_in_order(tmp_path):
    path = write_lines(
        tmp_path / "c.jsonl",
        [
            {
                "conversations": [
                    {"from": "human", "value": "<image>\nthis, then<image>"},
                    {"from": "gpt", "value": "ok"},
                    {"from": "human", "value": "and <image>?"},
                    {"from": "gpt", "value": "<image> too"},
                ],
                "images": ["one.png", "sub/two.png", "/abs/three.png", "four.png"],
            },
            # Without an images list, "<image>" is text like any other.
            {"conversations": [{"from": "human", "value": "say <image>"}, {"from": "gpt", "value": "<image>"}]},
        ],
    )
    llava, plain = read_corpus([path])
    assert llava.messages == (
        ("user", (0, "\nthis, then", 1)),
        ("assistant", "ok"),
        ("user", ("and ", 2, "?")),
        ("assistant", (3, " too")),
    )
    assert [ref.location for ref in llava.images] == [
        str(tmp_path / "one.png"),
        str(tmp_path / "sub" / "two.png"),
        "/abs/three.png",
        str(tmp_path / "four.png"),
    ]
    assert [ref.where for ref in llava.images] == ["images[0]", "images[1]", "images[2]", "images[3]"]
    assert plain.messages == (("user", "say <image>"), ("assistant", "<image>")) and plain.images == ()


def test_blank_lines_have_no_index_but_count_as_lines(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", ["", GOOD_TEXT, "   ", "\t", GOOD_TEXT, ""])
    recs = list(read_corpus([str(path)]))
    assert [(r.line, r.index) for r in recs] == [(2, 0), (5, 1)]
    assert all(r.source == str(path) for r in recs)


def test_crlf_and_bom(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\r\n{"text": "b"}\r\n')
    recs = list(read_corpus([path]))
    assert [r.text for r in recs] == ["a", "b"]


def test_index_continues_across_files_and_derived_ids_use_the_file_name(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [GOOD_TEXT, "oops"])
    b = write_lines(tmp_path / "b.jsonl", ["", GOOD_TEXT])
    recs = list(read_corpus([a, b]))
    assert [(type(r), r.source, r.line, r.index) for r in recs] == [
        (Record, str(a), 1, 0),
        (Reject, str(a), 2, 1),
        (Record, str(b), 2, 2),
    ]
    assert recs[0].id == "a.jsonl:1" and recs[2].id == "b.jsonl:2"


BAD_LINES = [
    (b'{"text": "a" "b"}', "invalid JSON: Expecting ',' delimiter at column 14", None),
    # A line cut short: the error lies at its end, not on a "line 2" made of the newline.
    (b'{"text": "a"', "invalid JSON: Expecting ',' delimiter at the end of the line (column 13)", None),
    (b'{"text": "abc', "invalid JSON: Unterminated string starting at column 10", None),
    (b"[", "invalid JSON: Expecting value at the end of the line (column 2)", None),
    (b'{"text": "a\tb"}', "invalid JSON: Invalid control character at column 12", None),
    (b"[1, 2]", "expected a JSON object, got array", None),
    (b'{"text": "caf\xe9"}', "not valid UTF-8: invalid continuation byte at byte 14", None),
    (b'{"id": "z"}', "record has none of conversations/messages/text/input_ids", "z"),
    (
        b'{"text": "a", "input_ids": [1]}',
        "record has more than one of conversations/messages/text/input_ids: text, input_ids",
        "bad.jsonl:2",
    ),
    (b'{"conversations": []}', "empty conversation", "bad.jsonl:2"),
    (b'{"conversations": {"from": "gpt"}}', "conversations is not an array (got object)", "bad.jsonl:2"),
    (
        b'{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},'
        b' {"from": "bot", "value": "c"}]}',
        "unknown role 'bot' in conversations[2] (conversations takes the roles system, human, user, gpt, assistant, "
        "chatgpt)",
        "bad.jsonl:2",
    ),
    (b'{"conversations": [{"from": "human", "value": "a"}]}', "no assistant turn", "bad.jsonl:2"),
    (b'{"conversations": ["hi"]}', "conversations[0] is not an object (got string)", "bad.jsonl:2"),
    (b'{"conversations": [{"value": "hi"}]}', "conversations[0] has no 'from'", "bad.jsonl:2"),
    (
        b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": null}]}',
        "messages[1].content is not a string or a list of content parts (got null)",
        "bad.jsonl:2",
    ),
    (
        b'{"messages": [{"role": "tool", "content": "a"}, {"role": "assistant", "content": "b"}]}',
        "unknown role 'tool' in messages[0] (messages takes the roles system, user, assistant)",
        "bad.jsonl:2",
    ),
    (
        b'{"messages": [{"role": "user", "content": []}, {"role": "assistant", "content": "a"}]}',
        "messages[0].content is an empty list of content parts",
        "bad.jsonl:2",
    ),
    (
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}',
        "messages[0].content[0].text is not a string (got integer)",
        "bad.jsonl:2",
    ),
    (
        b'{"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}',
        "messages[0].content[0] is a part of type 'input_audio'; only text and image_url parts can be extracted",
        "bad.jsonl:2",
    ),
    (
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}, '
        b'{"type": "input_audio"}]}, {"role": "assistant", "content": "a"}]}',
        "messages[0].content[1] is a part of type 'input_audio'; only text and image_url parts can be extracted",
        "bad.jsonl:2",
    ),
    (
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
        "messages[0].content[0].image_url has no url (a path, a file:// or a data: URL)",
        "bad.jsonl:2",
    ),
    (
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": '
        b'"https://example.com/cat.png"}}]}, {"role": "assistant", "content": "a"}]}',
        "messages[0].content[0].image_url is a https: URL (https://example.com/cat.png); images are read from files "
        "or data: URLs, never fetched: download them and give their paths",
        "bad.jsonl:2",
    ),
    # The host was dropped, and the path read on this machine.
    (
        b'{"conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "a"}], '
        b'"images": ["file://nas/pics/a.png"]}',
        "images[0] is a file: URL of the host 'nas' (file://nas/pics/a.png); images are read from this machine's "
        "files: give file:///path, or the path",
        "bad.jsonl:2",
    ),
    (
        b'{"conversations": [{"from": "human", "value": "<image> and <image>"}, {"from": "gpt", "value": "a"}], '
        b'"images": ["a.png"]}',
        "the chat has 2 <image> markers and the record lists 1 image: each image needs its <image> marker where it "
        "goes in the text",
        "bad.jsonl:2",
    ),
    (
        b'{"conversations": [{"from": "human", "value": "what is it?"}, {"from": "gpt", "value": "a"}], '
        b'"images": ["a.png", "b.png"]}',
        "the chat has 0 <image> markers and the record lists 2 images: each image needs its <image> marker where it "
        "goes in the text",
        "bad.jsonl:2",
    ),
    (
        b'{"conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "a"}], "images": "a.png"}',
        "images is not an array (got string)",
        "bad.jsonl:2",
    ),
    (
        b'{"conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "a"}], "images": [3]}',
        "images[0] is not a path or URL string (got integer)",
        "bad.jsonl:2",
    ),
    (
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]}, '
        b'{"role": "assistant", "content": "a"}], "images": ["b.png"]}',
        "messages[0].content holds image_url parts and the record lists images too: give a chat's images one way, as "
        "image_url parts or as <image> markers with images",
        "bad.jsonl:2",
    ),
    (
        b'{"text": "<image>", "images": ["a.png"]}',
        "images are read with a chat (conversations or messages), not with text",
        "bad.jsonl:2",
    ),
    (b'{"text": 5}', "text is not a string (got integer)", "bad.jsonl:2"),
    (b'{"text": ""}', "text is empty", "bad.jsonl:2"),
    (b'{"text": "a\\ud800b"}', "contains an unpaired surrogate escape \\ud800, which is not valid text", "bad.jsonl:2"),
    (b'{"input_ids": []}', "input_ids is empty", "bad.jsonl:2"),
    (b'{"input_ids": "1 2"}', "input_ids is not an array (got string)", "bad.jsonl:2"),
    (b'{"input_ids": [1, -2, 3]}', "input_ids[1] is not a non-negative integer (got -2)", "bad.jsonl:2"),
    (b'{"input_ids": [1, 2.0]}', "input_ids[1] is not a non-negative integer (got 2.0)", "bad.jsonl:2"),
    (b'{"input_ids": [true]}', "input_ids[0] is not a non-negative integer (got true)", "bad.jsonl:2"),
    (
        b'{"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [1, 1, 1, 1, 1]}',
        "loss_mask length 5 != input_ids length 6",
        "bad.jsonl:2",
    ),
    (b'{"input_ids": [1, 2], "loss_mask": [0, 2]}', "loss_mask[1] is 2, expected 0 or 1", "bad.jsonl:2"),
    # A field that says which tokens are in the loss, where it would not be read: never silently another mask.
    # HF-style labels, read as the loss mask only where they are unambiguous.
    (
        b'{"input_ids": [1, 2, 3], "labels": [2, 3, -100]}',
        "labels[0] is 2 where input_ids[0] is 1: labels are read as HF gives them, the token itself where it is in "
        "the loss and -100 where it is not (labels shifted to the next token would move the loss by one); or give "
        "loss_mask instead",
        "bad.jsonl:2",
    ),
    (b'{"input_ids": [1, 2, 3], "labels": [-100, 2]}', "labels length 2 != input_ids length 3", "bad.jsonl:2"),
    (b'{"input_ids": [1, 2], "labels": "-100 2"}', "labels is not an array (got string)", "bad.jsonl:2"),
    (
        b'{"input_ids": [1, 2], "labels": [-100, true]}',
        "labels[1] is true where input_ids[1] is 2: labels are read as HF gives them, the token itself where it is "
        "in the loss and -100 where it is not (labels shifted to the next token would move the loss by one); or "
        "give loss_mask instead",
        "bad.jsonl:2",
    ),
    (
        b'{"text": "a b", "loss_mask": [0, 1]}',
        "loss_mask is read with input_ids only: a text record's loss mask covers every token; leave loss_mask out, "
        "or give the record as input_ids with its loss_mask",
        "bad.jsonl:2",
    ),
    (
        b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "loss_mask": [1]}',
        "loss_mask is read with input_ids only: a messages record's loss mask covers the assistant turns; leave "
        "loss_mask out, or give the record as input_ids with its loss_mask",
        "bad.jsonl:2",
    ),
    (b'{"text": "a", "id": 1.5}', "id must be a string or an integer (got number)", None),
    (b'{"text": "a", "id": ""}', "id is an empty string", None),
]


@pytest.mark.parametrize("raw, reason, reject_id", BAD_LINES, ids=[r for _, r, _ in BAD_LINES])
def test_bad_line_is_rejected_and_neighbours_survive(tmp_path, raw, reason, reject_id):
    path = write_lines(tmp_path / "bad.jsonl", [{"text": "before"}, raw, "", {"text": "after"}])
    before, bad, after = read_corpus([path])
    assert (before.text, before.line, before.index) == ("before", 1, 0)
    assert bad == Reject(source=str(path), line=2, index=1, id=reject_id, reason=reason, kind="rejected")
    assert (after.text, after.line, after.index) == ("after", 4, 2)


def test_unpaired_surrogate_in_unused_metadata_is_ignored(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'{"text": "ok \\ud83d\\ude00", "meta": "\\udc00"}\n')
    [rec] = read_corpus([path])
    assert rec.text == "ok \U0001f600"


def test_reject_to_json_round_trips_through_json():
    rej = Reject(source="f.jsonl", line=3, index=2, id=None, reason="empty conversation")
    assert json.loads(json.dumps(rej.to_json())) == {
        "source": "f.jsonl",
        "line": 3,
        "index": 2,
        "id": None,
        "kind": "rejected",
        "reason": "empty conversation",
    }


def test_duplicate_ids(tmp_path):
    a = write_lines(tmp_path / "corpus.jsonl", [{"text": "a", "id": "x"}, {"text": "b", "id": 3}, {"text": "c"}])
    b = write_lines(
        tmp_path / "more.jsonl",
        [
            {"text": "d", "id": "x"},
            {"text": "e", "id": "3"},  # int 3 and str "3" are the same id
            {"text": "f", "id": "corpus.jsonl:3"},  # collides with a derived id
            {"text": "g", "id": "new"},
        ],
    )
    recs = list(read_corpus([a, b]))
    assert [r.id for r in recs if isinstance(r, Record)] == ["x", "3", "corpus.jsonl:3", "new"]
    rejects = [r for r in recs if isinstance(r, Reject)]
    assert [(r.line, r.index, r.id, r.reason) for r in rejects] == [
        (1, 3, "x", f"duplicate id 'x' (first at {a}:1)"),
        (2, 4, "3", f"duplicate id '3' (first at {a}:2)"),
        (3, 5, "corpus.jsonl:3", f"duplicate id 'corpus.jsonl:3' (first at {a}:3)"),
    ]


def test_two_files_of_one_name_derive_ids_from_their_paths_and_lose_no_record(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        write_lines(tmp_path / folder / "train.jsonl", [{"text": f"{folder} one"}, {"text": f"{folder} two"}])
    write_lines(tmp_path / "other.jsonl", [{"text": "alone"}])
    items = list(read_corpus(["a/train.jsonl", "b/train.jsonl", "other.jsonl"]))
    assert all(isinstance(item, Record) for item in items), [getattr(item, "reason", None) for item in items]
    # A name no other source shares keeps the file's name, as a single source's ids always have.
    assert [item.id for item in items] == [
        "a/train.jsonl:1",
        "a/train.jsonl:2",
        "b/train.jsonl:1",
        "b/train.jsonl:2",
        "other.jsonl:1",
    ]


def test_a_source_given_twice_is_named_before_anything_is_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_lines(tmp_path / "c.jsonl", [GOOD_TEXT])
    write_lines(tmp_path / "d.jsonl", [GOOD_TEXT])
    with pytest.raises(
        ValueError,
        match=r"--data c.jsonl is given twice, as entries 1 and 3: each of its records "
        r"would be a duplicate of itself. Give it once",
    ):
        read_corpus(["c.jsonl", "d.jsonl", "c.jsonl"])
    os.symlink("c.jsonl", tmp_path / "link.jsonl")
    with pytest.raises(ValueError, match=r"as entries 1 and 2 \(c.jsonl and ./link.jsonl are one file\)"):
        read_corpus(["c.jsonl", "./link.jsonl"])


def test_id_of_an_invalid_record_still_claims_it(tmp_path):
    # The duplicates reported must not depend on whether the first holder of an id is well formed.
    path = write_lines(tmp_path / "c.jsonl", [{"id": "k", "text": 1}, {"id": "k", "text": "ok"}])
    first, second = read_corpus([path])
    assert first.reason == "text is not a string (got integer)"
    assert second.reason == f"duplicate id 'k' (first at {path}:1)"


def test_missing_file_raises_before_reading_anything(tmp_path):
    good = write_lines(tmp_path / "good.jsonl", [GOOD_TEXT])
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_corpus([good, missing])
    with pytest.raises(IsADirectoryError, match=str(tmp_path)):
        read_corpus([tmp_path])


def test_reading_streams(tmp_path):
    """The first record arrives while the writer still holds the rest of the file back."""
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    got = queue.Queue()

    def consume():
        for rec in read_corpus([fifo]):
            got.put(rec)
        got.put(None)

    threading.Thread(target=consume, daemon=True).start()
    with open(fifo, "wb", buffering=0) as w:
        w.write(b'{"text": "first"}\n')
        assert got.get(timeout=10).text == "first"
        w.write(b'{"text": "second"}\n')
    assert got.get(timeout=10).text == "second"
    assert got.get(timeout=10) is None


def test_a_replica_reads_only_its_share_but_checks_ids_across_all(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(
        "\n".join(
            [
                '{"id": "a", "text": "x"}',
                "{not json",
                '{"id": "d", "text": "y"}',
                '{"id": "a", "text": "duplicate of line 1"}',
            ]
        )
        + "\n"
    )
    everything = list(read_corpus([path]))
    shares = [list(read_corpus([path], owns=lambda i, r=r: i % 2 == r)) for r in range(2)]
    assert sorted(x.index for share in shares for x in share) == [x.index for x in everything] == [0, 1, 2, 3]
    assert [type(x) for x in shares[0]] == [Record, Record]
    # Replica 1 never validates line 1, yet still knows its id: line 4 is a duplicate of it.
    assert [type(x) for x in shares[1]] == [Reject, Reject]
    assert "invalid JSON" in shares[1][0].reason
    assert "duplicate id 'a' (first at" in shares[1][1].reason and shares[1][1].line == 4


def test_a_rows_size_counts_a_table_rows_texts_as_a_lines_bytes():
    # What bounds a chunk of rows in flight to the tokenizing processes (extraction.CHUNK_BYTES), parquet's too.
    from offline_extract.data.corpus import Row

    chat = {"id": 7, "conversations": [{"from": "human", "value": "x" * 100}, {"from": "gpt", "value": "y" * 50}]}
    assert Row(0, "t.parquet", "t.parquet", Path("."), 1, 0, chat).size() == 8 + 5 + 100 + 3 + 50
    assert Row(0, "c.jsonl", "c.jsonl", Path("."), 1, 0, b'{"text": "hi"}\n').size() == 15
