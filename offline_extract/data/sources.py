"""Where a corpus's records come from: JSONL (plain or gzip), a `.json` file holding one JSON array of
records, parquet, a `datasets.save_to_disk` folder, or a data set on the hub named "org/name" (or
"org/name:split").

Each source yields its records in a fixed order with a 1-based position: the line for JSONL (blank lines
keep their number), the element for a JSON array, the row for the tabular kinds. Records are numbered
across sources in the order given, and a reject names its source and that position, whatever the kind.
"""

from __future__ import annotations

import array
import gzip
import json
import os
import re
import stat
import sys
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from offline_extract import hub
from offline_extract.formatting import human_bytes, plural

_GZIP_MAGIC = b"\x1f\x8b"
# A record's fields that say its format (data/corpus.py reads them); an object with none is no record.
FORMAT_KEYS = {"conversations": "sharegpt", "messages": "openai", "text": "text", "input_ids": "tokens"}
_PARQUET_MAGIC = b"PAR1"
# What datasets.save_to_disk writes beside the arrow files: a Dataset, or a DatasetDict of several.
_SAVED_DATASET = ("state.json", "dataset_dict.json")
# The --data entry that names standard input, as other commands take "-".
STDIN = "-"
# File names that say "a local file", never a hub id, when nothing is found at them.
_FILE_SUFFIXES = (".jsonl", ".json", ".gz", ".parquet", ".arrow")
_ROWS_PER_BATCH = 1024
_BLANK = b" \t\r\n"  # JSON's whitespace
_BLANKS = re.compile(r"[ \t\r\n]*")
_BOM = b"\xef\xbb\xbf"
# The longest JSONL line read into memory: a record costs what --max-length does once read (data/tokenization),
# but reading and parsing a line costs a few times its size. A longer line is rejected without being held whole.
MAX_LINE_BYTES = 256 * 10**6


@dataclass(frozen=True)
class LineTooLong:
    """A JSONL line past MAX_LINE_BYTES, in place of its bytes; the corpus rejects it with `reason`."""

    nbytes: int

    @property
    def reason(self) -> str:
        return (
            f"the line is {human_bytes(self.nbytes)}, past the {human_bytes(MAX_LINE_BYTES)} a record may be: "
            f"split it into records, or cut its text (only --max-length tokens of it are extracted)"
        )


class CorpusReadError(ValueError):
    """A corpus source could not be read to its end; the message names it and how far it got."""


@dataclass(frozen=True)
class Source:
    """One --data entry. `path` is what lies on disk (a hub data set's cached snapshot), `name` the entry
    as given, which rejects and derived ids use; `kind` is one of jsonl, jsonl.gz, json (one JSON array),
    parquet, saved, hub."""

    name: str
    path: Path
    kind: str
    split: str | None = None
    revision: str | None = None  # the commit a hub id resolved to
    # Another source of the run has the same file name: its derived ids start with the entry as given.
    qualified: bool = False

    @property
    def streamed(self) -> bool:
        """A pipe (e.g. <(zcat ...)): its records can be read once only."""
        return self.kind == "jsonl" and not self.path.is_file()

    @property
    def base(self) -> Path:
        """The folder a record's relative image paths start from: the corpus file's, a data set's own folder, the
        working directory for a pipe (whose path says nothing of where its records came from)."""
        if self.kind in ("saved", "hub"):
            return self.path
        return Path.cwd() if self.streamed else self.path.resolve().parent

    @property
    def label(self) -> str:
        """The start of a derived id ("label:line"): the file's name, which keeps a run's ids where its corpus
        moves, unless another source has it too (`open_sources`)."""
        return self.name if self.kind == "hub" or self.qualified else self.path.name

    @property
    def _same_as(self) -> tuple:
        """What makes two entries one source: the file, or the folder with the split taken from it."""
        if self.kind == "hub":
            return (self.name.partition(":")[0], self.split or "train")
        st = self.path.stat()
        return (st.st_dev, st.st_ino, self.split)

    def rows(self) -> Iterator[tuple[int, bytes | dict | LineTooLong]]:
        """(position, raw JSONL line, or LineTooLong) for JSONL, (position, the element's JSON text) for a JSON array,
        (position, row) for the tabular kinds. A file that breaks off part-way (a truncated or damaged gzip,
        an I/O error) raises CorpusReadError naming it; a damaged JSON array does before its first record."""
        position = 0
        try:
            for position, row in self._rows():
                yield position, row
        except CorpusReadError:
            raise
        except (OSError, EOFError, zlib.error, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            past = f" past {'line' if self.kind.startswith('jsonl') else 'row'} {position}" if position else ""
            raise CorpusReadError(
                f"{self.name} cannot be read{past}: {e or type(e).__name__} (a truncated or damaged file?)"
            ) from e

    def _rows(self) -> Iterator[tuple[int, bytes | dict | LineTooLong]]:
        if self.kind in ("jsonl", "jsonl.gz"):
            with (gzip.open if self.kind == "jsonl.gz" else open)(self.path, "rb") as f:
                yield from _lines(f)
            return
        if self.kind == "json":
            text = _json_text(self.path)
            # Every element's place first, so that a damaged array is named before any of its records is used.
            bounds = self._elements(text)
            # Each element's own bytes, which the corpus validates as it does a JSONL line: one rule for both.
            yield from (
                (i + 1, text[bounds[2 * i] : bounds[2 * i + 1]].encode("utf-8", "surrogateescape"))
                for i in range(len(bounds) // 2)
            )
            return
        yield from enumerate((_present(row) for batch in self._batches() for row in batch), start=1)

    def _batches(self) -> Iterator[list[dict]]:
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(self.path).iter_batches(batch_size=_ROWS_PER_BATCH):
                yield batch.to_pylist()
        elif self.kind == "saved":
            for table in self._saved().with_format("arrow").iter(batch_size=_ROWS_PER_BATCH):
                yield table.to_pylist()
        else:
            import datasets

            # Streaming reads the snapshot's files in place: no arrow copy of the corpus in the datasets cache.
            rows = datasets.load_dataset(str(self.path), split=self.split or "train", streaming=True)
            batch = []
            for row in rows:
                batch.append(row)
                if len(batch) == _ROWS_PER_BATCH:
                    yield batch
                    batch = []
            yield batch

    def _elements(self, text: str) -> array.array:
        """Start and end of each element of the JSON array `text`, flat; CorpusReadError naming the file and
        the line and column where it stops being one."""
        decoder = json.JSONDecoder()
        bounds = array.array("q")
        at = _past_blanks(text, _past_blanks(text, 0) + 1)  # past the "[" open_source found
        closed = text.startswith("]", at)
        try:
            while not closed:
                try:
                    _, end = decoder.raw_decode(text, at)
                except json.JSONDecodeError:
                    raise
                except (ValueError, RecursionError) as e:  # integers past Python's digit limit, absurd nesting
                    raise json.JSONDecodeError(f"{e}, in the element starting", text, at) from None
                bounds.extend((at, end))
                at = _past_blanks(text, end)
                closed = text.startswith("]", at)
                if not closed:
                    if not text.startswith(",", at):
                        raise json.JSONDecodeError("Expecting ',' or ']' after an element", text, at)
                    at = _past_blanks(text, at + 1)
            if (after := _past_blanks(text, at + 1)) < len(text):
                raise json.JSONDecodeError("Extra data after the array's closing ']'", text, after)
        except json.JSONDecodeError as e:
            raise CorpusReadError(
                f"{self.name} is not a valid JSON array: {e.msg} at line {e.lineno} column {e.colno} "
                f"(after {plural(len(bounds) // 2, 'element')}; a truncated or damaged file?)"
            ) from e
        return bounds

    def _saved(self):
        import datasets

        saved = datasets.load_from_disk(str(self.path))
        # A DatasetDict of one split (open_source refuses more): that split.
        return next(iter(saved.values())) if isinstance(saved, datasets.DatasetDict) else saved

    def count(self) -> int | None:
        """How many records the source holds (for an ETA); None where only reading it all would tell."""
        if self.kind == "jsonl":
            # Counting a pipe would take the records from the reader.
            return None if self.streamed else _count_lines(self.path)
        if self.kind == "jsonl.gz":
            try:
                return _count_lines(self.path, gzip.open)
            except (OSError, EOFError, zlib.error):
                return None  # a damaged file: the reader names it when it gets there
        if self.kind == "json":
            try:
                return len(self._elements(_json_text(self.path))) // 2
            except (OSError, CorpusReadError):
                return None  # the reader names it
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(self.path).metadata.num_rows
        if self.kind == "saved":
            return len(self._saved())
        return None


def _past_blanks(text: str, at: int) -> int:
    """The first position from `at` on that is not JSON whitespace."""
    blanks = _BLANKS.match(text, at)
    assert blanks is not None, "_BLANKS matches the empty string"
    return blanks.end()


def _lines(f) -> Iterator[tuple[int, bytes | LineTooLong]]:
    """The non-blank lines of the binary file `f` with their 1-based numbers; one past MAX_LINE_BYTES is read
    on to its end in pieces and given as LineTooLong."""
    line, most, readline = 0, MAX_LINE_BYTES, f.readline
    while raw := readline(most + 1):
        line += 1
        if len(raw) > most and not raw.endswith(b"\n"):
            nbytes = len(raw)
            while rest := f.readline(1 << 20):
                nbytes += len(rest)
                if rest.endswith(b"\n"):
                    break
            yield line, LineTooLong(nbytes)
        elif raw.strip():
            yield line, raw


def _present(row: dict) -> dict:
    # A table has every column in every row; a null stands for a field the record does not have.
    return {key: value for key, value in row.items() if value is not None}


def _count_lines(path: Path, opener=open) -> int:
    """Non-empty line starts, counted with numpy over large chunks (a per-line Python loop would contend
    for the GIL with the hot loop for minutes on a large corpus; zlib, for gzip, releases it too). A line
    of only spaces counts, which only skews the ETA."""
    n = 0
    with opener(path, "rb") as f:
        after_newline = True
        while chunk := f.read(16 << 20):
            newline = np.frombuffer(chunk, dtype=np.uint8) == ord("\n")
            n += int(after_newline and not newline[0]) + int((newline[:-1] & ~newline[1:]).sum())
            after_newline = bool(newline[-1])
    return n


def _json_text(path: Path) -> str:
    """A JSON file's text, whole. Bytes that are not UTF-8 are kept (as surrogate escapes) for the element
    that holds them to be rejected as a JSONL line with them is; any other place makes the array invalid."""
    return path.read_bytes().removeprefix(_BOM).decode("utf-8", "surrogateescape")


def _outer_byte(path: Path, last: bool = False) -> bytes:
    """The file's first (last: last) byte that is not JSON whitespace, nor the BOM at its start; b"" for a
    blank file. Reads only as far as it has to."""
    block = 1 << 16
    with open(path, "rb") as f:
        if not last:
            return _first_byte(f)
        end = f.seek(0, os.SEEK_END)
        while end > 0:
            f.seek(start := max(end - block, 0))
            if chunk := f.read(end - start).rstrip(_BLANK):
                return chunk[-1:]
            end = start
    return b""


def _first_byte(f, block: int = 1 << 16) -> bytes:
    """The first byte of the binary file `f`, from where it is, that is not JSON whitespace nor a BOM at the start."""
    chunk = f.read(block).removeprefix(_BOM).lstrip(_BLANK)
    while not chunk and (more := f.read(block)):
        chunk = more.lstrip(_BLANK)
    return chunk[:1]


def _gzipped_first_byte(path: Path) -> bytes | None:
    """`_first_byte` of a gzip file's content; None where its start does not decompress (the reader names that)."""
    try:
        with gzip.open(path, "rb") as f:
            return _first_byte(f)
    except (OSError, EOFError, zlib.error):
        return None


def _first_line(path: Path) -> tuple[str, bool]:
    """The file's first line that is not blank (without the BOM), and whether only blanks follow it."""
    with open(path, "rb") as f:
        first = next(line for line in f if line.strip(_BLANK)).removeprefix(_BOM).decode("utf-8", "surrogateescape")
        return first, not _first_byte(f)


def _one_array(name: str, path: Path) -> bool:
    """Whether the file `path`, which begins with '[', is one JSON array rather than JSON lines whose first record
    is an array: its first line is the whole file, or a value cut off at the line's end (spread over lines)."""
    first, alone = _first_line(path)
    try:
        json.loads(first)
    except ValueError as e:
        return _cut_at_line_end(first, e)
    except RecursionError:
        _refuse_too_deep(name, alone)
        return False  # JSON lines, whose first is rejected with the reason
    return alone


def _refuse_too_deep(name: str, alone: bool) -> None:
    """A first line nested past what Python's json reads cannot say what the file is: JSON lines, where other
    lines follow (that line is then rejected on its own), else one value that holds no record to read."""
    if alone:
        raise CorpusReadError(
            f"{name} is one JSON value nested too deep to read (Python's json stops near "
            f"{sys.getrecursionlimit()} levels of [ and {{), not records: a damaged or generated file?"
        )


def _cut_at_line_end(line: str, error: ValueError) -> bool:
    """Whether `line` failed to parse only because its JSON value goes on past the line's end (a value spread
    over lines), not because it is damaged within the line."""
    return isinstance(error, json.JSONDecodeError) and error.pos >= len(line.rstrip())


def _one_object(name: str, path: Path) -> CorpusReadError | None:
    """Why the .json file `path`, which begins with '{', is not JSON lines but one JSON object (a wrapper such as
    {"data": [...]}, or one record spread over lines), whose every line, read as JSONL, would be rejected on its
    own; None where it is JSON lines (a one-line object that holds no list is left to be judged as a record). Only a
    file whose first line is a JSON value cut off at its end is parsed whole."""
    first, alone = _first_line(path)
    try:
        value = json.loads(first)
    except RecursionError:
        _refuse_too_deep(name, alone)
        return None
    except ValueError as e:
        if not _cut_at_line_end(first, e):
            return None  # a damaged first line of JSONL: judged with the other lines
        try:
            value = json.loads(_json_text(path))
        except (ValueError, RecursionError):
            return None  # damaged as a whole: its lines are judged one by one
        return _object_advice(name, value, spread=True) if isinstance(value, dict) else None
    wrapper = (
        isinstance(value, dict)
        and not FORMAT_KEYS.keys() & value.keys()
        and any(isinstance(field, list) for field in value.values())
    )
    return _object_advice(name, value, spread=False) if wrapper and alone else None


def _object_advice(name: str, value: dict, spread: bool) -> CorpusReadError:
    what = f"{name} holds one JSON object{' spread over lines' if spread else ''}, not records"
    if FORMAT_KEYS.keys() & value.keys():
        return CorpusReadError(
            f"{what} one per line (JSONL) or in a JSON array: it is one record; put it on one "
            f"line (jq -c . {name} > corpus.jsonl)"
        )
    lists = [key for key, field in value.items() if isinstance(field, list)]
    if not lists:
        return CorpusReadError(
            f"{what}: it has no list of records ({', '.join(map(repr, value)) or 'no keys'}). "
            f"A corpus is JSON lines, one record per line, or a .json file of one JSON array of records"
        )
    path = [f".{key}[]" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) else f".[{json.dumps(key)}][]" for key in lists]
    if len(lists) == 1:
        held = plural(len(value[lists[0]]), "element")
        return CorpusReadError(
            f"{what}: the records are presumably its list under {lists[0]!r} ({held}). Convert "
            f"them to JSONL: jq -c '{path[0]}' {name} > corpus.jsonl"
        )
    return CorpusReadError(
        f"{what}: it holds lists under {', '.join(map(repr, lists))}. Convert the one of records "
        f"to JSONL, e.g. jq -c '{path[0]}' {name} > corpus.jsonl"
    )


def _check_parquet_footer(name: str, path: Path) -> None:
    """A parquet file's schema and row groups are in its footer: a cut-off file is unreadable from the
    start, and is named now rather than once the model has loaded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise CorpusReadError(f"{name} is not a readable parquet file: {e} (a truncated or damaged file?)") from e


def open_sources(names: Sequence[str | Path]) -> list[Source]:
    """Every --data entry resolved, before any is read: a typo in the last is caught before work on the first.
    One source given twice is refused, naming both entries: its every record would be a duplicate of itself.
    Sources sharing a file name (a/train.jsonl, b/train.jsonl) derive their ids from the entries as given."""
    sources = [open_source(str(name)) for name in names]
    first: dict[tuple, int] = {}
    for i, source in enumerate(sources):
        j = first.setdefault(source._same_as, i)
        if j != i:
            same = "" if source.name == sources[j].name else f" ({sources[j].name} and {source.name} are one file)"
            raise ValueError(
                f"--data {sources[j].name} is given twice, as entries {j + 1} and {i + 1}{same}: each "
                f"of its records would be a duplicate of itself. Give it once"
            )
    names_used = Counter(source.label for source in sources)
    return [replace(source, qualified=True) if names_used[source.label] > 1 else source for source in sources]


def open_source(name: str) -> Source:
    """The --data entry `name`: standard input (STDIN), a datasets.save_to_disk folder, a corpus file, or a hub data
    set."""
    if name == STDIN:
        return _standard_input()
    path = Path(name)
    if path.is_dir():
        return _saved_dataset(name, path)
    if path.exists():
        return _corpus_file(name, path)
    return _hub_dataset(name)


def _standard_input() -> Source:
    """--data -: a pipe into the command, read once as it streams as any pipe is; a file redirected into it, read as
    that file is when named (so a rerun can tell it is the same corpus)."""
    if os.isatty(0):
        raise ValueError(
            f"--data {STDIN} reads the corpus from standard input, which is a terminal here: pipe the corpus into "
            f"the command (zcat corpus.jsonl.gz | python bin/extract.py --data {STDIN} ...), or name its file"
        )
    stdin = Path("/dev/stdin")
    return _corpus_file(STDIN, stdin.resolve() if stdin.is_file() else stdin)


def _saved_dataset(name: str, path: Path) -> Source:
    """A folder that datasets.save_to_disk wrote, of one split; any other folder is refused, naming the corpus
    files in it."""
    if not any((path / marker).exists() for marker in _SAVED_DATASET):
        files = sorted(p.name for p in path.iterdir() if p.name.endswith(_FILE_SUFFIXES))
        raise IsADirectoryError(
            f"corpus path is a directory that datasets.save_to_disk did not write (no state.json or "
            f"dataset_dict.json): {name}; to read the files in it, give each its own --data"
            + (
                f" (it holds {plural(len(files), 'corpus-like file')}: {', '.join(files[:3])}"
                f"{', ...' if len(files) > 3 else ''})"
                if files
                else ""
            )
        )
    if (path / "dataset_dict.json").exists():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        except (ValueError, KeyError) as e:
            raise CorpusReadError(f"{path / 'dataset_dict.json'} is damaged ({e!r}); save the data set again") from e
        if len(splits) != 1:
            raise ValueError(f"{name} holds the splits {', '.join(splits)}: give one, e.g. --data {path / splits[0]}")
    return Source(name, path, "saved")


def _corpus_file(name: str, path: Path) -> Source:
    """A file (or a pipe) by its bytes: gzipped JSONL, parquet, a .json array, or JSONL; a file that reading it as
    JSONL would reject line by line (a JSON array, a parquet name on other bytes, one JSON object) is refused now."""
    if not path.is_file():
        mode = path.stat().st_mode
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):  # /dev/zero, a disk: no end, or no records
            shown = f"{name} (standard input)" if name == STDIN else name
            raise CorpusReadError(
                f"--data {shown} is {file_kind(mode)}, not a corpus file or a pipe: give the corpus's file, or pipe it in"
            )
        return Source(name, path, "jsonl")  # a pipe (e.g. <(zcat ...)) is read once, as it streams
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:2] == _GZIP_MAGIC:
        if _gzipped_first_byte(path) == b"[":
            # Read as JSONL, each line of the array would be rejected on its own.
            raise CorpusReadError(
                f"{name} is a gzipped JSON array; gzipped, only JSON lines are read. Convert it to JSONL, which "
                f"streams: zcat {name} | jq -c '.[]' | gzip > corpus.jsonl.gz (or decompress it into a .json "
                f"file, read as one array)"
            )
        return Source(name, path, "jsonl.gz")
    if magic == _PARQUET_MAGIC:
        _check_parquet_footer(name, path)
        return Source(name, path, "parquet")
    outer = _outer_byte(path)
    if path.suffix == ".json" and outer == b"[":
        # The usual truncation (a copy cut short) leaves the array open: named now, not once the model has loaded.
        if _outer_byte(path, last=True) != b"]":
            raise CorpusReadError(f"{name} is a JSON array that does not end with its closing ']' (a truncated file?)")
        return Source(name, path, "json")
    # Read as JSONL, each of these would have its every line rejected, far from the cause.
    if path.suffix == ".parquet":
        raise CorpusReadError(
            f"{name} is not a parquet file: it does not begin with parquet's magic bytes PAR1 "
            f"(a Git LFS pointer, or a file of another format?)"
        )
    if outer == b"[" and _one_array(name, path):
        raise CorpusReadError(
            f"{name} holds a JSON array, not JSON lines (it begins with '['): name it .json to "
            f"read it as one array of records, or convert it to JSONL: jq -c '.[]' {name} > "
            f"corpus.jsonl"
        )
    if path.suffix == ".json" and outer == b"{" and (refusal := _one_object(name, path)):
        raise refusal
    return Source(name, path, "jsonl")


def file_kind(mode: int) -> str:
    """What a path that is not a regular file is (its st_mode), in words."""
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "an unusual kind of file"


def _hub_dataset(name: str) -> Source:
    """A hub data set, REPO or REPO:SPLIT (`hub.snapshot`); a name that cannot be one is a corpus file not found."""
    repo_id, _, split = name.partition(":")
    if "/" not in repo_id or name.endswith(_FILE_SUFFIXES) or not hub.looks_like_repo_id(repo_id):
        raise FileNotFoundError(f"corpus file not found: {name}")

    def has_data(snapshot: Path) -> bool:
        return any(f.is_file() and not f.name.startswith(".") and f.suffix != ".md" for f in snapshot.rglob("*"))

    try:
        snap = hub.snapshot(repo_id, "dataset", has_data)
    except hub.HubError as e:
        raise hub.HubError(f"no corpus file or folder at {name}, and {e}") from None
    return Source(name, snap.path, "hub", split=split or None, revision=snap.revision)
