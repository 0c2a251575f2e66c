"""Summaries of extracted shards for humans and tests.

`summarize` and `sample_view` compute plain JSON-able dicts; `render_summary` and `render_sample` draw
them with rich. Statistics stream over shards in row chunks so memory stays bounded whatever the
output size.
"""

from __future__ import annotations

import bisect
import difflib
import math
import os
import warnings
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from offline_extract.formatting import number
from offline_extract.store import manifest
from offline_extract.store.index import index_mismatch, not_shards, scan, shard_paths
from offline_extract.store.schema import FINAL_STATE_TENSOR, SHARD_GLOB, STATE_TENSORS, STORES, RunInfo, ShardError
from offline_extract.store.shard import Shard, open_shard, read_header

# Upper bound on the float32 copy of one chunk of rows; the float64 reduction temporaries double it.
CHUNK_BYTES = 256 << 20
LOSS_STYLE = "bold green"
CONTEXT_STYLE = "dim"
# Where the output takes no styles (a pipe, a file, TERM=dumb), the loss spans are bracketed instead:
# unstyled, they would look like the context around them.
LOSS_MARKS = ("[[", "]]")


def resolve_shards(path: str | os.PathLike) -> list[Path]:
    """The shard files a path names: the file itself, or a directory's shards (those there, whatever
    index.json lists: see `_find_sample`)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.exists():
        raise ShardError(
            f"{path} does not exist: give an extraction's output directory (its --out) or one of its shards"
        )
    if not path.is_dir():
        raise ShardError(f"{path} is neither a shard file nor an output directory")
    paths = shard_paths(path)
    ignored = not_shards(path)
    if ignored:
        warnings.warn(ignored)
    if not paths:
        raise ShardError(f"{path} contains no {SHARD_GLOB} files")
    return paths


class _RunningStats:
    """Count, mean, M2 (Chan et al.'s parallel update), absmax and non-finite counts over many chunks.

    Mean/std/absmax cover finite values only, so one stray NaN does not hide the distribution; NaN and
    Inf are counted separately. Chunk reductions run in float64 so billions of values do not drift.
    """

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.absmax = 0.0
        self.nan = 0
        self.inf = 0

    def update(self, x: torch.Tensor) -> None:
        nan = int(torch.isnan(x).sum())
        inf = int(torch.isinf(x).sum())
        self.nan += nan
        self.inf += inf
        finite = x[torch.isfinite(x)] if nan or inf else x
        n = finite.numel()
        if n == 0:
            return
        mean = float(finite.mean(dtype=torch.float64))
        m2 = float(((finite.double() - mean) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total
        self.absmax = max(self.absmax, float(finite.abs().max()))

    def result(self, name: str, layer_id: int | None) -> dict:
        empty = self.count == 0
        return {
            "name": name,
            "layer_id": layer_id,
            "count": self.count,
            "mean": None if empty else self.mean,
            "std": None if empty else math.sqrt(self.m2 / self.count),
            "absmax": None if empty else self.absmax,
            "nan": self.nan,
            "inf": self.inf,
        }


def _layer_names(run: RunInfo, num_aux: int) -> list[tuple[str, int | None]]:
    if run.layer_ids is None:
        return [(f"aux[{j}]", None) for j in range(num_aux)]
    return [(f"layer {lid}", lid) for lid in run.layer_ids]


def _state_widths(shard: Shard) -> dict[str, int]:
    sample = shard.read(0, 1, shard.encoding.states) if shard.samples else {}
    return {name: t.shape[1] for name, t in sample.items()}


def summarize(path: str | os.PathLike, allow_partial: bool = False) -> dict:
    """Counts, run facts, and per captured layer mean/std/absmax/NaN/Inf for a shard or directory.

    A directory whose extraction has not finished (or has lost shards) is refused unless allow_partial:
    its counts would read as the whole run's. One sample (`sample_view`) is shown either way.
    """
    shards = _shards_to_summarize(path, allow_partial)
    run = shards[0].run
    states = shards[0].encoding.states
    widths, hidden, num_aux = _state_shape(shards)
    names = _layer_names(run, num_aux)
    if FINAL_STATE_TENSOR in states:
        names.append((f"last ({run.final_state})", None))
    stats = [_RunningStats() for _ in names]

    chunk_rows = max(1, CHUNK_BYTES // (sum(widths.values()) * 4))
    loss_tokens = image_tokens = 0
    for shard in shards:
        loss_tokens += int(shard.tensor("loss_mask").sum(dtype=torch.int64))
        if shard.encoding.image_mask:  # shards of earlier versions hold no image
            image_tokens += int(shard.tensor("image_mask").sum(dtype=torch.int64))
        _add_states(shard, stats, num_aux, hidden, chunk_rows)

    num_tokens = sum(s.num_tokens for s in shards)
    return {
        "path": str(path),
        "num_shards": len(shards),
        "num_samples": sum(len(s.samples) for s in shards),
        "num_tokens": num_tokens,
        "loss_tokens": loss_tokens,
        "loss_fraction": loss_tokens / num_tokens if num_tokens else None,
        "image_tokens": image_tokens,
        "layer_ids": run.to_json()["layer_ids"],
        "layer_convention": run.layer_convention,
        "stored_dtype": str(run.stored_dtype).removeprefix("torch."),
        "compute_dtype": run.compute_dtype,
        "encoding": shards[0].encoding.to_json(),
        "hidden_size": hidden,
        "num_aux_layers": num_aux,
        "layer_stats": [st.result(name, lid) for st, (name, lid) in zip(stats, names)],
    }


def _shards_to_summarize(path: str | os.PathLike, allow_partial: bool) -> list[Shard]:
    """The shards of `path`, a shard or a directory; an unfinished directory refused unless allow_partial, and an
    index.json that does not describe the shards warned of."""
    reason = manifest.unfinished(path) if Path(path).is_dir() else None
    if reason and not allow_partial:
        refused = (manifest.load(path) or {}).get("status") == manifest.REFUSED
        raise ShardError(reason if refused else f"{reason}, or summarize what is there with --allow-partial")
    shards = [open_shard(p) for p in resolve_shards(path)]
    if Path(path).is_dir() and not reason:
        mismatch = index_mismatch(path, *scan(path, shards))
        if mismatch:
            warnings.warn(mismatch)
    return shards


def _state_shape(shards: list[Shard]) -> tuple[dict[str, int], int, int]:
    """The states' widths, which every shard must share, the hidden size and the number of captured layers."""
    run = shards[0].run
    states = shards[0].encoding.states
    # Widths from a decoded sample: compressed shards record their states as bytes, not as [T, width].
    widths = _state_widths(shards[0])
    for s in shards:
        if s.encoding.states != states or _state_widths(s) != widths:
            raise ShardError(f"{s.path} holds states {_state_widths(s)}, unlike {shards[0].path}'s {widths}")
    aux_width = widths[STATE_TENSORS[0]]
    num_aux = run.num_aux_layers
    hidden = widths.get(FINAL_STATE_TENSOR) or run.hidden_size or (num_aux and aux_width // num_aux)
    if not hidden or aux_width % hidden:
        raise ShardError(f"{shards[0].path}: aux width {aux_width} is not a multiple of hidden size {hidden}")
    if num_aux is None:  # a run that records no layer ids (shards written through the library): count them
        num_aux = aux_width // hidden
    elif aux_width != num_aux * hidden:
        raise ShardError(
            f"run lists {num_aux} layer_ids {list(run.layer_ids or ())} but aux_hidden_states holds {aux_width // hidden} layers"
        )
    return widths, hidden, num_aux


def _add_states(shard: Shard, stats: list[_RunningStats], num_aux: int, hidden: int, chunk_rows: int) -> None:
    """`shard`'s states added to `stats`: one a captured layer, then the final state where the shard holds it."""
    states = shard.encoding.states
    # Whole samples at a time, about chunk_rows tokens: a compressed sample is decoded as a unit.
    first = 0
    while first < len(shard.samples):
        stop = first + 1
        while stop < len(shard.samples) and shard.offsets[stop + 1] - shard.offsets[first] <= chunk_rows:
            stop += 1
        rows = shard.read(first, stop, states)
        aux = rows[STATE_TENSORS[0]].float()
        for j in range(num_aux):
            stats[j].update(aux[:, j * hidden : (j + 1) * hidden])
        if FINAL_STATE_TENSOR in states:
            stats[-1].update(rows[FINAL_STATE_TENSOR].float())
        first = stop


def _find_sample(path: str | os.PathLike, sample_id: str) -> tuple[Shard, int]:
    """The shard and row of the sample of this id, or of this SOURCE:LINE as the run's --data named the source
    (the metadata shows it so); a miss names the nearest ids. Found from the shards' headers: index.json only
    repeats them, and one edited or damaged since (or not yet rewritten by a run still writing) would show
    another sample."""
    source, _, line = sample_id.rpartition(":")
    where = (os.path.normpath(source), int(line)) if source and line.isdigit() else None
    ids = []
    for p in resolve_shards(path):
        samples = read_header(p).samples
        for row, info in enumerate(samples):
            if info.id == sample_id or (os.path.normpath(info.source), info.line) == where:
                return open_shard(p), row
        ids += [info.id for info in samples]
    raise SampleNotFound(f"no sample with id {sample_id!r} in {path}", _nearest_ids(sample_id, ids))


class SampleNotFound(ShardError):
    """No sample has the id asked for; `nearest` holds the ids most like it."""

    def __init__(self, what: str, nearest: list[str]):
        self.what, self.nearest = what, nearest
        super().__init__(f"{what} (the nearest: {', '.join(map(repr, nearest))})" if nearest else what)


def _nearest_ids(wanted: str, ids: list[str], n: int = 3) -> list[str]:
    """The `n` ids most like `wanted`: among its neighbours in sorted order (a shared start) and, for a
    NAME:LINE, the ids of that line in any source (another spelling of the source), the closest by difflib.
    Ranking every id by difflib would take minutes on a million."""
    ordered = sorted(ids)
    at = bisect.bisect_left(ordered, wanted)
    candidates = set(ordered[max(at - n, 0) : at + n])
    _, colon, line = wanted.rpartition(":")
    if colon and line:
        candidates.update(islice((i for i in ids if i.endswith(colon + line)), 100))
    likeness = {i: difflib.SequenceMatcher(None, wanted, i).ratio() for i in candidates}
    return sorted((i for i in candidates if likeness[i] >= 0.3), key=lambda i: (-likeness[i], i))[:n]


@dataclass(frozen=True)
class _Decoded:
    decode: Callable[[list[int]], str] | None  # None when only ids can be shown
    note: str | None


def _load_decoder(run: RunInfo) -> _Decoded:
    tokenizer_path = run.tokenizer_path
    if not tokenizer_path:
        return _Decoded(None, "the run records no tokenizer_path; showing token ids")
    if not Path(tokenizer_path).exists():
        return _Decoded(None, f"tokenizer not found at {tokenizer_path}; showing token ids")
    from transformers import AutoTokenizer  # slow to import, and only --sample needs it

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except Exception as e:  # any tokenizer failure should degrade to ids, not abort the inspection
        return _Decoded(None, f"could not load tokenizer at {tokenizer_path} ({e}); showing token ids")
    return _Decoded(lambda ids: tokenizer.decode(ids, skip_special_tokens=False), None)


def sample_view(path: str | os.PathLike, sample_id: str) -> dict:
    """One sample's metadata and tokens, split into runs of equal loss mask (decoded when possible)."""
    shard, row = _find_sample(path, sample_id)
    tensors = shard.sample(row)
    ids = tensors["input_ids"].numpy()
    mask = tensors["loss_mask"].numpy().astype(bool)
    decoded = _load_decoder(shard.run)
    bounds = [0, *(np.flatnonzero(np.diff(mask)) + 1).tolist(), len(ids)]
    spans = []
    for a, b in zip(bounds, bounds[1:]):
        if a == b:
            continue
        span_ids = ids[a:b].tolist()
        spans.append(
            {
                "loss": bool(mask[a]),
                "ids": span_ids,
                "text": decoded.decode(span_ids) if decoded.decode else None,
            }
        )
    return {
        **asdict(shard.samples[row]),
        "shard": str(shard.path),
        "row": row,
        "num_tokens": len(ids),
        "loss_tokens": int(mask.sum()),
        "image_tokens": int(tensors["image_mask"].sum()),
        "tokenizer_path": shard.run.tokenizer_path,
        "tokenizer_note": decoded.note,
        "spans": spans,
    }


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _stored_as(encoding: dict) -> str:
    """An Encoding's JSON in words: its keys and raw values read as "final_state True"."""
    store = STORES[encoding["store"]].words
    if encoding.get("final_store"):
        store += f", the final state {STORES[encoding['final_store']].words}"
    words = [store, "uncompressed" if encoding["compress"] == "none" else encoding["compress"]]
    return ", ".join(words + ([] if encoding["final_state"] else ["no final state"]))


def render_summary(summary: dict, console: Console) -> None:
    overview = Table(title=f"offline_extract: {summary['path']}", show_header=False)
    overview.add_column(style="bold")
    overview.add_column()
    for label, value in [
        ("shards", number(summary["num_shards"])),
        ("samples", number(summary["num_samples"])),
        ("tokens", number(summary["num_tokens"])),
        ("loss tokens", f"{number(summary['loss_tokens'])} ({_percent(summary['loss_fraction'])} of tokens)"),
        *([("image tokens", number(summary["image_tokens"]))] if summary["image_tokens"] else []),
        ("layer ids", summary["layer_ids"]),
        ("layer convention", summary["layer_convention"]),
        ("stored dtype", summary["stored_dtype"]),
        ("compute dtype", summary["compute_dtype"]),
        ("stored as", _stored_as(summary["encoding"])),
        ("hidden size", summary["hidden_size"]),
    ]:
        overview.add_row(label, Text("-" if value is None else str(value)))
    console.print(overview)

    layers = Table(title="captured layers (finite values, as decoded; float32)")
    for column in ("layer", "mean", "std", "absmax", "NaN", "Inf"):
        layers.add_column(column, justify="left" if column == "layer" else "right")
    for layer in summary["layer_stats"]:
        bad = "bold red" if layer["nan"] or layer["inf"] else None
        layers.add_row(
            layer["name"],
            _fmt(layer["mean"]),
            _fmt(layer["std"]),
            _fmt(layer["absmax"]),
            Text(str(layer["nan"]), style=bad or ""),
            Text(str(layer["inf"]), style=bad or ""),
        )
    console.print(layers)


def render_sample(view: dict, console: Console) -> None:
    meta = Table(title=f"sample {view['id']}", show_header=False)
    meta.add_column(style="bold")
    meta.add_column()
    keys: tuple[str, ...] = (
        "index",
        "source",
        "line",
        "source_len",
        "truncated",
        "shard",
        "row",
        "num_tokens",
        "loss_tokens",
    )
    keys += ("image_tokens", "images_sha256") if view["image_tokens"] else ()
    for key in keys:
        meta.add_row(key, Text(str(view[key])))
    console.print(meta)
    if view["tokenizer_note"]:
        console.print(f"[yellow]{view['tokenizer_note']}[/yellow]")
    opening, closing = ("", "") if console.color_system else LOSS_MARKS
    body = Text()
    for span in view["spans"]:
        piece = span["text"] if span["text"] is not None else " ".join(map(str, span["ids"])) + " "
        if span["loss"]:
            words = piece.rstrip()  # the marks close before the span's trailing space or line break
            body.append(f"{opening}{words}{closing}{piece[len(words) :]}", style=LOSS_STYLE)
        else:
            body.append(piece, style=CONTEXT_STYLE)
    console.print(
        Text.assemble("legend: ", (f"{opening}loss tokens{closing}", LOSS_STYLE), " / ", ("context", CONTEXT_STYLE))
    )
    console.print(body)
