"""Streaming reader for corpora in the ShareGPT, OpenAI, plain-text and pre-tokenized formats, from any
of the sources in `sources` (JSONL, gzip JSONL, a JSON array, parquet, saved or hub data sets).

A chat may hold images: OpenAI `image_url` content parts, or `<image>` markers in its texts beside an `images`
list (the LLaVA style). Their places are resolved here (a path relative to the corpus's folder, a `file://` URL or
a `data:` URL); their bytes are read and decoded with the tokenization (`data/images`).

Every record (a non-blank line, an array's element, or a row) becomes either a `Record` or a `Reject`;
nothing is dropped silently, and a bad record never stops the ones after it from being read.
"""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple, TypeVar

from offline_extract.data.sources import FORMAT_KEYS, LineTooLong, open_sources
from offline_extract.formatting import plural

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


# The marker of an image in a chat's text where the record lists its images beside (the LLaVA style).
IMAGE_MARKER = "<image>"


@dataclass(frozen=True)
class ImageRef:
    """Where one image of a record is: `location` is an absolute path or a `data:` URL, `where` the field of the
    record that gave it (messages[0].content[1], images[2]), which a reject names."""

    where: str
    location: str

    @property
    def named(self) -> str:
        """The image in a message's words: its field, and its path (a data: URL is too long to repeat)."""
        shown = "a data: URL" if self.location.startswith("data:") else self.location
        return f"{self.where} ({shown})"


@dataclass(frozen=True)
class Record:
    """One record of the corpus. A chat's turn is (role, content): the content is its text, or, in a chat with
    `images`, a tuple of parts, each a text (str) or the number of an image in `images` (int)."""

    source: str
    line: int
    index: int
    id: str
    format: str
    messages: tuple[tuple[str, str | tuple[str | int, ...]], ...] | None = None
    text: str | None = None
    input_ids: tuple[int, ...] | None = None
    loss_mask: tuple[int, ...] | None = None
    images: tuple[ImageRef, ...] = ()

    def reject(self, reason: str, kind: str = "rejected") -> Reject:
        """The Reject of this record, for `reason`."""
        return Reject(self.source, self.line, self.index, self.id, reason, kind)


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


class _Images:
    """The images of one chat as its turns are read: OpenAI image_url parts found in its contents, or, where the
    record lists `images` (the LLaVA style), its `<image>` markers, which take those images in order."""

    def __init__(self, obj: dict, base: Path):
        self.base = base
        self.listed = None if obj.get("images") is None else _listed_images(obj["images"])
        self.refs: list[ImageRef] = []
        self.markers = 0  # the <image> markers read so far

    def content(self, content, where: str) -> str | tuple[str | int, ...]:
        """A turn's content: its text (`_content`), or its parts where it holds an image."""
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            if self.listed is not None:
                raise _BadRecord(
                    f"{where} holds image_url parts and the record lists images too: give a chat's "
                    f"images one way, as image_url parts or as {IMAGE_MARKER} markers with images"
                )
            return tuple(self._part(part, f"{where}[{i}]") for i, part in enumerate(content))
        text = _content(content, where)
        if self.listed is None or IMAGE_MARKER not in text:
            return text
        pieces = text.split(IMAGE_MARKER)
        parts: list[str | int] = [pieces[0]] if pieces[0] else []
        for piece in pieces[1:]:
            if self.markers < len(self.listed):
                self.refs.append(
                    ImageRef(
                        f"images[{self.markers}]", self._located(self.listed[self.markers], f"images[{self.markers}]")
                    )
                )
            parts.append(self.markers)
            self.markers += 1
            if piece:
                parts.append(piece)
        return tuple(parts)

    def _part(self, part, where: str) -> str | int:
        if not isinstance(part, dict) or part.get("type") not in ("text", "image_url"):
            kind = part.get("type") if isinstance(part, dict) else _json_type(part)
            raise _BadRecord(f"{where} is a part of type {kind!r}; only text and image_url parts can be extracted")
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise _BadRecord(f"{where}.text is not a string (got {_json_type(part.get('text'))})")
            return part["text"]
        image_url = part.get("image_url")
        # OpenAI's form is {"url": ...}; a bare string is what some exporters write.
        url = image_url.get("url") if isinstance(image_url, dict) else image_url
        if not isinstance(url, str) or not url:
            raise _BadRecord(f"{where}.image_url has no url (a path, a file:// or a data: URL)")
        self.refs.append(ImageRef(f"{where}.image_url", self._located(url, f"{where}.image_url")))
        return len(self.refs) - 1

    def _located(self, url: str, where: str) -> str:
        """An image's URL as a location: a data: URL as it is, a file:// URL's path, a path resolved against the
        corpus's folder; a remote URL is refused, since a run reads no network."""
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme == "data":
            return url
        if scheme == "file":
            parts = urllib.parse.urlsplit(url)
            if parts.netloc not in ("", "localhost"):  # file://host/path: a file of another machine
                raise _BadRecord(
                    f"{where} is a file: URL of the host {parts.netloc!r} ({url[:80]}); images are read from this "
                    f"machine's files: give file:///path, or the path"
                )
            return str(self.base / urllib.request.url2pathname(parts.path))
        if len(scheme) > 1:  # a single letter is a Windows drive, a path
            raise _BadRecord(
                f"{where} is a {scheme}: URL ({url[:80]}); images are read from files or data: URLs, "
                f"never fetched: download them and give their paths"
            )
        return str(self.base / url)

    def check_count(self) -> None:
        if self.listed is not None and self.markers != len(self.listed):
            raise _BadRecord(
                f"the chat has {plural(self.markers, IMAGE_MARKER + ' marker')} and the record lists "
                f"{plural(len(self.listed), 'image')}: each image needs its {IMAGE_MARKER} marker where "
                f"it goes in the text"
            )


def _listed_images(images) -> list[str]:
    if not isinstance(images, list):
        raise _BadRecord(f"images is not an array (got {_json_type(images)})")
    for i, image in enumerate(images):
        if not isinstance(image, str) or not image:
            raise _BadRecord(f"images[{i}] is not a path or URL string (got {_json_type(image)})")
    return images


def _messages(obj: dict, key: str, role_key: str, content_key: str, roles: dict[str, str], base: Path):
    turns = obj[key]
    if not isinstance(turns, list):
        raise _BadRecord(f"{key} is not an array (got {_json_type(turns)})")
    if not turns:
        raise _BadRecord("empty conversation")
    images = _Images(obj, base)
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
        out.append((roles[role], images.content(turn[content_key], f"{where}.{content_key}")))
    if not any(role == "assistant" for role, _ in out):
        raise _BadRecord("no assistant turn")
    images.check_count()
    return tuple(out), tuple(images.refs)


def _content(content, where: str) -> str:
    """A turn's text: a string, or OpenAI's list of content parts, whose text parts are joined with a
    newline (as OpenAI-compatible servers do for a chat template that takes a string). A part that is
    neither text nor an image (`_Images`), audio say, rejects the record."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _BadRecord(f"{where} is not a string or a list of content parts (got {_json_type(content)})")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else _json_type(part)
            raise _BadRecord(f"{where}[{i}] is a part of type {kind!r}; only text and image_url parts can be extracted")
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
        raise _BadRecord(
            f"labels[{i}] is {json.dumps(label)} where input_ids[{i}] is {ids[i]}: labels are read as HF "
            f"gives them, the token itself where it is in the loss and {IGNORE_INDEX} where it is not "
            "(labels shifted to the next token would move the loss by one); or give loss_mask instead"
        )
    return tuple(int(label != IGNORE_INDEX) for label in labels)


def _check_mask_fields(obj: dict, key: str) -> None:
    """Refuses a loss mask where it would not be read: the record's loss mask would silently be another than its
    author meant (every token, or the assistant turns)."""
    if key != "input_ids" and obj.get("loss_mask") is not None:
        kept = "every token" if key == "text" else "the assistant turns"
        raise _BadRecord(
            f"loss_mask is read with input_ids only: a {key} record's loss mask covers {kept}; leave loss_mask "
            "out, or give the record as input_ids with its loss_mask"
        )


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


def _record(obj: dict, raw: bytes, source: str, line: int, index: int, id_: str, base: Path) -> Record:
    present = [k for k in FORMAT_KEYS if k in obj]
    if not present:
        raise _BadRecord("record has none of conversations/messages/text/input_ids")
    if len(present) > 1:
        raise _BadRecord(f"record has more than one of conversations/messages/text/input_ids: {', '.join(present)}")
    key = present[0]
    fmt = FORMAT_KEYS[key]
    _check_mask_fields(obj, key)
    _check_surrogates(raw, obj, key)
    record = partial(Record, source=source, line=line, index=index, id=id_, format=fmt)
    if fmt in ("sharegpt", "openai"):
        fields = ("from", "value", SHAREGPT_ROLES) if fmt == "sharegpt" else ("role", "content", OPENAI_ROLES)
        messages, images = _messages(obj, key, *fields, base)
        return record(messages=messages, images=images)
    if obj.get("images") is not None:
        raise _BadRecord(f"images are read with a chat (conversations or messages), not with {key}")
    if fmt == "text":
        text = obj["text"]
        if not isinstance(text, str):
            raise _BadRecord(f"text is not a string (got {_json_type(text)})")
        if not text:
            raise _BadRecord("text is empty")
        return record(text=text)
    ids, mask = _tokens(obj)
    return record(input_ids=ids, loss_mask=mask)


class Row(NamedTuple):
    """One record of the corpus as read, not yet parsed: what `parse` needs, and no more (a tokenizing process
    parses rows a run reads; `base` is its source's, the same object for every row of it)."""

    file_no: int  # the source's position among the run's
    source: str  # its name, as rejects give it
    label: str  # the start of a derived id
    base: Path  # where its relative image paths start
    line: int
    # Across all sources, as Record.index; it shadows tuple.index, which nothing calls on a Row.
    index: int  # type: ignore[assignment]
    raw: bytes | dict | LineTooLong

    def size(self) -> int:
        """About the bytes it holds: its line's, or a table row's texts and numbers."""
        return _size(self.raw)


def _size(value) -> int:
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, dict):
        return sum(_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 8


def read_corpus(paths: Sequence[str | Path], owns: Callable[[int], bool] | None = None) -> Iterator[Record | Reject]:
    """Yield a Record or Reject for every record of `paths` (see `sources`), in order, streaming.

    With `owns`, only lines whose record index it accepts are validated and yielded: a data-parallel
    replica still reads every id, for the duplicate check, but validates only its own share.

    Missing sources raise here, before anything is read, so a typo in the last path is caught before
    any work is done on the first, and so is a source given twice. Ids must be unique across all sources: a
    derived id is "NAME:LINE", NAME the file's name, or the entry as given where two sources share a name
    (`sources.open_sources`); an id given twice is reported record by record as a duplicate.
    """
    sources = open_sources(paths)
    parsed = ((row, *parse(row, owns is None or owns(row.index))) for row in rows(sources))
    return _validated(in_order(sources, parsed, owns))


def _validated(items: Iterable[tuple[Row, Record | Reject | None]]) -> Iterator[Record | Reject]:
    for _, item in items:
        assert item is not None, "in_order passes only the rows `owns` accepts, and parse validated those"
        yield item


def rows(sources: Sequence) -> Iterator[Row]:
    """Every row of `sources` (`open_sources`), in order, numbered across them."""
    index = 0
    for file_no, source in enumerate(sources):
        name, label, base = source.name, source.label, source.base
        for line, raw in source.rows():
            yield Row(file_no, name, label, base, line, index, raw)
            index += 1


def parse(row: Row, validate: bool = True) -> tuple[str | None, Record | Reject | None]:
    """A row's id (None where its line cannot be read as a record), and its Record or the Reject saying why it is
    none; without `validate` its id alone (a row another replica validates, or one done already). Whether the id
    is the first of its kind is `in_order`'s to say: it depends on every row before."""
    id_ = None
    try:
        if isinstance(row.raw, LineTooLong):
            raise _BadRecord(row.raw.reason)
        raw, obj = (
            (row.raw, _parse(row.raw, first_line=row.line == 1)) if isinstance(row.raw, bytes) else (b"", row.raw)
        )
        id_ = _explicit_id(obj)
        if id_ is None:
            id_ = f"{row.label}:{row.line}"
        if not validate:
            return id_, None
        return id_, _record(obj, raw, row.source, row.line, row.index, id_, row.base)
    except _BadRecord as e:
        return id_, Reject(row.source, row.line, row.index, id_, str(e))


T = TypeVar("T")


def in_order(
    sources: Sequence, parsed: Iterable[tuple[Row, str | None, T]], owns: Callable[[int], bool] | None
) -> Iterator[tuple[Row, T | Reject]]:
    """(row, what `parse` made of it) for the rows `owns` accepts (all without it), of `parsed`: every row in
    corpus order with its id and what was made of it. An id seen before is the row's Reject instead: each id is
    registered where it first comes, before any check of its record, so which rows are called duplicates does not
    depend on which other rows happen to be malformed."""
    # id -> (position in sources, line) of its first occurrence, compact enough for millions of ids.
    seen: dict[str, tuple[int, int]] = {}
    for row, id_, made in parsed:
        first = None if id_ is None else seen.setdefault(id_, (row.file_no, row.line))
        if owns is not None and not owns(row.index):
            continue
        if first is not None and first != (row.file_no, row.line):
            duplicate = f"duplicate id {id_!r} (first at {sources[first[0]].name}:{first[1]})"
            yield row, Reject(row.source, row.line, row.index, id_, duplicate)
        else:
            yield row, made
