"""Streaming reader for corpora in the ShareGPT, OpenAI, plain-text and pre-tokenized formats, from any
of the sources in `sources` (JSONL, gzip JSONL, a JSON array, parquet, saved or hub data sets).

Every record (a non-blank line, an array's element, or a row) becomes either a `Record` or a `Reject`;
nothing is dropped silently, and a bad record never stops the ones after it from being read.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from offline_extract.data.sources import FORMAT_KEYS, LineTooLong, open_sources

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
}
OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}

# Raw UTF-8 bytes cannot encode a surrogate, so an unpaired one can only come from a \uD800-\uDFFF
# escape; lines without such an escape skip the (costlier) full check.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass(frozen=True)
class Record:
    source: str
    line: int
    index: int
    id: str
    format: str
    messages: tuple[tuple[str, str], ...] | None = None
    text: str | None = None
    input_ids: tuple[int, ...] | None = None
    loss_mask: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Reject:
    source: str
    line: int
    index: int
    id: str | None
    reason: str
    kind: str = "rejected"

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "line": self.line,
            "index": self.index,
            "id": self.id,
            "kind": self.kind,
            "reason": self.reason,
        }


class BadRecordError(ValueError):
    """Under --strict, the first record that cannot be extracted, in the words of its Reject."""

    def __init__(self, reject: Reject):
        self.reject = reject
        where = f"{reject.source}:{reject.line}" + (f" (id {reject.id!r})" if reject.id else "")
        super().__init__(f"{where}: {reject.reason} (--strict stops at the first bad record)")


class _BadRecord(Exception):
    pass


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _messages(obj: dict, key: str, role_key: str, content_key: str, roles: dict[str, str]):
    turns = obj[key]
    if not isinstance(turns, list):
        raise _BadRecord(f"{key} is not an array (got {_json_type(turns)})")
    if not turns:
        raise _BadRecord("empty conversation")
    out = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise _BadRecord(f"{where} is not an object (got {_json_type(turn)})")
        for k in (role_key, content_key):
            if k not in turn:
                raise _BadRecord(f"{where} has no {k!r}")
        role = turn[role_key]
        if not isinstance(role, str) or role not in roles:
            raise _BadRecord(f"unknown role {role!r} in {where} ({key} takes the roles {', '.join(roles)})")
        out.append((roles[role], _content(turn[content_key], f"{where}.{content_key}")))
    if not any(role == "assistant" for role, _ in out):
        raise _BadRecord("no assistant turn")
    return tuple(out)


def _content(content, where: str) -> str:
    """A turn's text: a string, or OpenAI's list of content parts, whose text parts are joined with a
    newline (as OpenAI-compatible servers do for a chat template that takes a string). A part that is
    not text (an image, audio) cannot be extracted by a text model and rejects the record."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _BadRecord(f"{where} is not a string or a list of content parts (got {_json_type(content)})")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else _json_type(part)
            raise _BadRecord(f"{where}[{i}] is a part of type {kind!r}; only text parts can be extracted")
        if not isinstance(part.get("text"), str):
            raise _BadRecord(f"{where}[{i}].text is not a string (got {_json_type(part.get('text'))})")
        texts.append(part["text"])
    if not texts:
        raise _BadRecord(f"{where} is an empty list of content parts")
    return "\n".join(texts)


def _int_list(obj: dict, key: str) -> tuple[int, ...]:
    values = obj[key]
    if not isinstance(values, list):
        raise _BadRecord(f"{key} is not an array (got {_json_type(values)})")
    # Type and range checks run at C speed; only a failing list is walked to name the culprit.
    if not (set(map(type, values)) <= {int} and (not values or min(values) >= 0)):
        i, v = next((i, v) for i, v in enumerate(values) if type(v) is not int or v < 0)
        raise _BadRecord(f"{key}[{i}] is not a non-negative integer (got {json.dumps(v)})")
    return tuple(values)


def _tokens(obj: dict) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    ids = _int_list(obj, "input_ids")
    if not ids:
        raise _BadRecord("input_ids is empty")
    if obj.get("loss_mask") is None:
        return ids, None if obj.get("labels") is None else _mask_from_labels(obj["labels"], ids)
    mask = _int_list(obj, "loss_mask")
    if len(mask) != len(ids):
        raise _BadRecord(f"loss_mask length {len(mask)} != input_ids length {len(ids)}")
    if max(mask) > 1:
        i = next(i for i, v in enumerate(mask) if v > 1)
        raise _BadRecord(f"loss_mask[{i}] is {mask[i]}, expected 0 or 1")
    return ids, mask


IGNORE_INDEX = -100  # HF's label for a token out of the loss


def _mask_from_labels(labels, ids: tuple[int, ...]) -> tuple[int, ...]:
    """The loss mask that HF-style labels give: the token itself where it is in the loss, -100 where it is not.
    Labels shifted by one (the next token's id at each place) would move the mask by one token without a word,
    so a label that is neither is refused, naming its place."""
    if not isinstance(labels, list):
        raise _BadRecord(f"labels is not an array (got {_json_type(labels)})")
    if len(labels) != len(ids):
        raise _BadRecord(f"labels length {len(labels)} != input_ids length {len(ids)}")
    if not all(type(label) is int and label in (token, IGNORE_INDEX) for label, token in zip(labels, ids)):
        i, label = next((i, v) for i, v in enumerate(labels) if type(v) is not int or v not in (ids[i], IGNORE_INDEX))
        raise _BadRecord(f"labels[{i}] is {json.dumps(label)} where input_ids[{i}] is {ids[i]}: labels are read as HF "
                         f"gives them, the token itself where it is in the loss and {IGNORE_INDEX} where it is not "
                         "(labels shifted to the next token would move the loss by one); or give loss_mask instead")
    return tuple(int(label != IGNORE_INDEX) for label in labels)


def _check_mask_fields(obj: dict, key: str) -> None:
    """Refuses a loss mask where it would not be read: the record's loss mask would silently be another than its
    author meant (every token, or the assistant turns)."""
    if key != "input_ids" and obj.get("loss_mask") is not None:
        kept = "every token" if key == "text" else "the assistant turns"
        raise _BadRecord(f"loss_mask is read with input_ids only: a {key} record's loss mask covers {kept}; leave loss_mask "
                         "out, or give the record as input_ids with its loss_mask")


def _check_surrogates(raw: bytes, obj: dict, key: str) -> None:
    if not _SURROGATE_ESCAPE.search(raw):
        return
    # Only the fields kept in the Record: extra metadata with odd escapes is not our concern.
    dumped = json.dumps([obj.get("id"), obj[key]], ensure_ascii=False)
    try:
        dumped.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _BadRecord(
            f"contains an unpaired surrogate escape \\u{ord(dumped[e.start]):04x}, which is not valid text"
        ) from None


def _explicit_id(obj: dict) -> str | None:
    if "id" not in obj:
        return None
    value = obj["id"]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _BadRecord(f"id must be a string or an integer (got {_json_type(value)})")
    if value == "":
        raise _BadRecord("id is an empty string")
    return str(value)


def _parse(raw: bytes, first_line: bool):
    """Decode one line into its JSON object; raises _BadRecord with a fixable reason."""
    try:
        # A BOM is only legitimate at the very start of a file.
        text = raw.decode("utf-8-sig" if first_line else "utf-8")
    except UnicodeDecodeError as e:
        raise _BadRecord(f"not valid UTF-8: {e.reason} at byte {e.start + 1}") from None
    # Without its line ending: json would place an error at the end of a cut-short line on a "line 2"
    # (column 1) made of the newline.
    text = text.rstrip("\r\n")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        where = f"column {e.pos + 1}" if e.pos < len(text) else f"the end of the line (column {e.pos + 1})"
        # Some of json's messages end in "at" already ("Unterminated string starting at").
        raise _BadRecord(f"invalid JSON: {e.msg.removesuffix(' at')} at {where}") from None
    except (ValueError, RecursionError) as e:  # integers past Python's digit limit, absurd nesting
        raise _BadRecord(f"invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise _BadRecord(f"expected a JSON object, got {_json_type(obj)}")
    return obj


def _record(obj: dict, raw: bytes, source: str, line: int, index: int, id_: str) -> Record:
    present = [k for k in FORMAT_KEYS if k in obj]
    if not present:
        raise _BadRecord("record has none of conversations/messages/text/input_ids")
    if len(present) > 1:
        raise _BadRecord(f"record has more than one of conversations/messages/text/input_ids: {', '.join(present)}")
    key = present[0]
    fmt = FORMAT_KEYS[key]
    _check_mask_fields(obj, key)
    _check_surrogates(raw, obj, key)
    common = dict(source=source, line=line, index=index, id=id_, format=fmt)
    if fmt == "sharegpt":
        return Record(**common, messages=_messages(obj, key, "from", "value", SHAREGPT_ROLES))
    if fmt == "openai":
        return Record(**common, messages=_messages(obj, key, "role", "content", OPENAI_ROLES))
    if fmt == "text":
        text = obj["text"]
        if not isinstance(text, str):
            raise _BadRecord(f"text is not a string (got {_json_type(text)})")
        if not text:
            raise _BadRecord("text is empty")
        return Record(**common, text=text)
    ids, mask = _tokens(obj)
    return Record(**common, input_ids=ids, loss_mask=mask)


def read_corpus(paths: Sequence[str | Path], owns: Callable[[int], bool] | None = None) -> Iterator[Record | Reject]:
    """Yield a Record or Reject for every record of `paths` (see `sources`), in order, streaming.

    With `owns`, only lines whose record index it accepts are validated and yielded: a data-parallel
    replica still reads every id, for the duplicate check, but validates only its own share.

    Missing sources raise here, before anything is read, so a typo in the last path is caught before
    any work is done on the first, and so is a source given twice. Ids must be unique across all sources: a
    derived id is "NAME:LINE", NAME the file's name, or the entry as given where two sources share a name
    (`sources.open_sources`); an id given twice is reported record by record as a duplicate.
    """
    return _read(open_sources(paths), owns)


def _read(sources: list, owns: Callable[[int], bool] | None) -> Iterator[Record | Reject]:
    # id -> (position in sources, line) of its first occurrence, compact enough for millions of ids.
    seen: dict[str, tuple[int, int]] = {}
    index = 0
    for file_no, source in enumerate(sources):
        for line, raw in source.rows():
            id_ = None
            try:
                if isinstance(raw, LineTooLong):
                    raise _BadRecord(raw.reason)
                obj = _parse(raw, first_line=line == 1) if isinstance(raw, bytes) else raw
                id_ = _explicit_id(obj)
                if id_ is None:
                    id_ = f"{source.label}:{line}"
                # Registered before the format checks so the duplicates reported do not depend
                # on which other lines happen to be malformed.
                first = seen.setdefault(id_, (file_no, line))
                if owns is not None and not owns(index):
                    continue
                if first != (file_no, line):
                    raise _BadRecord(f"duplicate id {id_!r} (first at {sources[first[0]].name}:{first[1]})")
                yield _record(obj, raw if isinstance(raw, bytes) else b"", source.name, line, index, id_)
            except _BadRecord as e:
                if owns is None or owns(index):
                    yield Reject(source.name, line, index, id_, str(e))
            finally:
                index += 1
