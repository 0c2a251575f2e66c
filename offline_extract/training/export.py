"""Export an output directory to other trainers' offline layouts.

SpecForge (`--format specforge`): one torch.save file per sample,

    DEST/rows_{start}-{start + rows_per_folder}/data_{i}.ckpt      (data_{i}.ckpt.gz with gzip)

with the keys its offline reader takes for the run's recipe (SpecForge's data_preparation.md):

    eagle3  input_ids int64 [T], loss_mask int64 [T] (SpecForge builds its masks as int64),
            hidden_state bf16 [1, T, H] (the final post-norm state), aux_hidden_state bf16 [1, T, k*H]
    dflash  input_ids, loss_mask, hidden_states bf16 [1, T, k*H] (the target layers side by side)
    dspark  the dflash keys plus target_last_hidden_states bf16 [1, T, H] (the final post-norm state)

where i counts samples from 0 in sample-index order, and folder rows_{start}-{end} holds i in
[start, end). That is the layout SpecForge's scripts/prepare_hidden_states.py writes and its offline
training reads; its loader walks DEST recursively for *.ckpt and *.ckpt.gz, so rows_per_folder only
bounds directory sizes (SpecForge's default has been 2000 since its --file-group-size option; 5000
before). SpecForge trains on bf16 tensors only, so an fp8 or nvfp4 run is decoded; gzip (the default for a
run stored so or compressed) keeps the export nearer the run's size, at the cost of SpecForge reading and
inflating each file whole.

speculators (`--format speculators`), its offline training data directory:

    DEST/                          a `datasets` dataset (save_to_disk; torch format) with one row per
                                   sample: input_ids int64, loss_mask int64, seq_len
    DEST/hidden_states/hs_{i}.safetensors
        hidden_states         bf16 [T, k+1, H] (the k layers in ascending order, then the final state)
                              or, from an fp8 run, e4m3 [T, k+1, H] with
        hidden_states_scales  float32 [T, k+1, 1] (the run's per-token per-layer scales)
        token_ids             int64 [T]
    DEST/token_freq.pt             {token id: count} over loss tokens, for its draft-vocabulary mapping
    DEST/speculators_train.yaml    `speculators train --config` file: the verifier, DEST as data path,
                                   the hidden-states backend (`fp8` for an fp8 export) and
                                   `target_layer_ids` in speculators' convention (below)

speculators' fp8 layout (hs-connectors' FP8HiddenStatesConnector) has one scale per token; its reader
(`FP8Transfer`, `--hidden-states-backend fp8`) multiplies values by scales by broadcasting, so the run's
finer scales (per token and layer) are read as they are, with no requantization: the export holds the
run's bytes. A final state converted from post-norm (below) is not the run's fp8 values, and rounding it
to fp8 again would add a second error, so that export is bf16 (and says so), as is one of a run holding any
state in nvfp4 (an nvfp4 final state too), whose block scales that layout has no place for. Scales of runs before the
bf16-rounded ones (store/codecs.py) are rounded to bf16 by that reader, a relative change of at most 2^-9 per token and layer.

speculators names layers by HF `output_hidden_states` index, which is our layer id + 1, and calls the
final state layer `num_layers` (as vLLM's extraction does): the stacked layers of a run with ids
[1, 3, 4] of a 6-layer model are [2, 4, 5, 6], and its `--target-layer-ids` (the aux layers alone, which
size the drafter's input) are [2, 4, 5]. Passing our ids instead would train on the next layers
silently, so the export states them where training reads them (the YAML) and in export_manifest.json.

Final state: SpecForge trains on the post-norm state; speculators takes the last stacked state as the
verifier's pre-norm state and applies the verifier's norm itself. A run holding the other state is
converted with the final norm the run recorded (offline_extract/final_norm.py: pre -> post exactly,
post -> pre up to each token's scale, which speculators' EAGLE-3 training does not see), in float32;
a run that recorded no norm (extracted before runs did, or a norm other than RMSNorm) is refused rather
than silently producing a drafter trained on the wrong state.

DEST also gets export_manifest.json (ignored by both trainers): the format, the source directory, the
run, the options, the final state exported and whether it was converted, and sample i's id at position
i. An interrupted export resumes when rerun with the same source and options: every per-sample file is
renamed into place complete, so existing ones are skipped (but for an empty one, which a power loss leaves), and
the token table and frequencies are made again whole.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import os
import shutil
import signal
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import yaml
from safetensors.torch import save as safetensors_bytes

from offline_extract import final_norm
from offline_extract.lifecycle.progress import RunProgress
from offline_extract.store.atomic import atomic_write
from offline_extract.store.journal import load_json
from offline_extract.store.schema import FINAL_STATE_TENSOR, SCALE_SUFFIX, STATE_DTYPE, STATE_TENSORS, RunInfo
from offline_extract.training.datasets import HiddenStateDataset
from offline_extract.training.formats import DEFAULT_ROWS_PER_FOLDER, EXPORTERS, FORMATS

MANIFEST_NAME = "export_manifest.json"
SPECULATORS_STATES_DIR = "hidden_states"
SPECULATORS_TOKEN_FREQ = "token_freq.pt"
SPECULATORS_TRAIN_CONFIG = "speculators_train.yaml"
# hs-connectors' name for the fp8 scales (its fp8_utils.SCALES_KEY).
SPECULATORS_SCALES = "hidden_states_scales"
# Fast enough not to be the export's bottleneck; higher levels gain little on hidden states.
GZIP_LEVEL = 1


class ExportError(ValueError):
    """This export cannot be made: the run or the destination cannot take it, or a package it needs is missing."""


@dataclass
class ExportSummary:
    dest: Path
    samples_written: int
    samples_skipped: int
    bytes_written: int
    notes: list[str] = field(default_factory=list)  # what the user must know to train on it


def specforge_path(
    dest: str | os.PathLike,
    i: int,
    rows_per_folder: int = DEFAULT_ROWS_PER_FOLDER,
    gzipped: bool = False,
) -> Path:
    start = i // rows_per_folder * rows_per_folder
    return Path(dest) / f"rows_{start}-{start + rows_per_folder}" / f"data_{i}.ckpt{'.gz' if gzipped else ''}"


def specforge_record(item: dict, recipe: str = "eagle3") -> dict[str, torch.Tensor]:
    """A reader item as SpecForge's per-sample dict for `recipe`; each tensor owns a storage of exactly
    its size."""
    record = {"input_ids": item["input_ids"].to(torch.int64), "loss_mask": item["loss_mask"].to(torch.int64)}
    if recipe == "eagle3":
        return {
            **record,
            "hidden_state": item["hidden_states"][None],
            "aux_hidden_state": item["aux_hidden_states"][None],
        }
    record["hidden_states"] = item["aux_hidden_states"][None]
    if recipe == "dspark":
        record["target_last_hidden_states"] = item["hidden_states"][None]
    return record


def _save_specforge(record: dict, path: Path, gzipped: bool) -> None:
    _write_bytes(path, _torch_bytes(record), gzipped)


def _torch_bytes(obj) -> memoryview:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer()


def _write_bytes(path: Path, data: bytes | memoryview, gzipped: bool = False) -> None:
    """Files are serialized in memory and written here, by Python: torch's and safetensors' own file
    writers report a full disk as a bare C++ "iostream error" or a message without errno, where
    Python's OSError carries both the errno and, through atomic_write, the path."""
    with gzip.open(path, "wb", compresslevel=GZIP_LEVEL) if gzipped else open(path, "wb") as f:
        f.write(data)


def speculators_path(dest: str | os.PathLike, i: int) -> Path:
    return Path(dest) / SPECULATORS_STATES_DIR / f"hs_{i}.safetensors"


def speculators_layer_ids(run: RunInfo, out_dir) -> list[int]:
    """The layers stacked in speculators' hidden_states, in its convention (module docstring): the aux
    layers' HF indices, then num_layers for the final state."""
    if run.num_layers is None:
        raise ExportError(f"{out_dir} does not record the model's num_layers, which names speculators' final layer")
    if run.layer_ids is None:
        raise ExportError(f"{out_dir} does not record its layer_ids, which speculators' hidden_states are named by")
    return [k + 1 for k in run.layer_ids] + [run.num_layers]


def speculators_train_config(run: RunInfo, dest: Path, layer_ids: list[int], fp8: bool) -> str:
    """speculators' stage-shaped training config for this export; flags given to `speculators train`
    override it (e.g. --verifier-name-or-path where the model has moved)."""
    config = {
        "train": {
            "speculator_type": "eagle3",
            "verifier": {"verifier_name_or_path": run.model},
            "draft": {"target_layer_ids": layer_ids[:-1]},
            "data": {"data_path": str(dest.resolve()), "hidden_states_backend": "fp8" if fp8 else "file"},
        }
    }
    header = (
        f"# Written by offline_extract's export. Train with: speculators train --config {dest / SPECULATORS_TRAIN_CONFIG}\n"
        f"# hidden_states/hs_*.safetensors stack layers {layer_ids} (HF hidden_states indices; "
        f"{layer_ids[-1]} = the final state).\n"
    )
    return header + yaml.safe_dump(config, sort_keys=False, default_flow_style=None)


def speculators_record(item: dict, num_aux_layers: int) -> dict[str, torch.Tensor]:
    """A reader item as speculators' per-sample states: layers stacked, the final state last."""
    last = item["hidden_states"]
    rows, hidden = last.shape
    layers = item["aux_hidden_states"].reshape(rows, num_aux_layers, hidden)
    return {"hidden_states": torch.cat([layers, last[:, None]], dim=1), "token_ids": item["input_ids"].to(torch.int64)}


def speculators_fp8_record(stored: dict, num_aux_layers: int) -> dict[str, torch.Tensor]:
    """A stored fp8 item (HiddenStateDataset.stored) in speculators' fp8 layout: the values and scales
    stacked as the states are, the scales broadcasting over each layer's row."""
    aux, last = (stored[name] for name in STATE_TENSORS)
    rows, hidden = last.shape
    values = torch.cat([aux.reshape(rows, num_aux_layers, hidden), last[:, None]], dim=1)
    scales = torch.cat([stored[name + SCALE_SUFFIX] for name in STATE_TENSORS], dim=1)
    return {
        "hidden_states": values,
        SPECULATORS_SCALES: scales[:, :, None],
        "token_ids": stored["input_ids"].to(torch.int64),
    }


Convert = Callable[[torch.Tensor], torch.Tensor]


def _final_state_conversion(format: str, run: RunInfo, out_dir) -> Convert | None:
    """None when the run holds the final state `format` trains on, else the float32 conversion to it from
    the run's final norm; refuses a run that recorded no norm to convert with."""
    want, have = EXPORTERS[format].final_state, run.final_state
    if have is None or have == want:
        return None
    norm = final_norm.recorded(run.final_norm)
    if norm is None:
        raise ExportError(
            f"{out_dir} holds the {have} final state, but {format} trains on the {want} one, and the run recorded no "
            f"final norm to convert it with (extracted before runs recorded it, or a norm other than RMSNorm): a "
            f"drafter trained on this export would be silently wrong. Re-extract with --final-state {want}."
        )
    return norm.apply if want == "post-norm" else norm.undo


def _converted(item: dict, convert: Convert | None) -> dict:
    """A decoded item with its final state converted (bf16, as items are)."""
    if convert is None:
        return item
    return {**item, FINAL_STATE_TENSOR: convert(item[FINAL_STATE_TENSOR]).to(STATE_DTYPE)}


def _final_state_manifest(format: str, run: RunInfo, convert: Convert | None) -> dict:
    have = run.final_state
    return {
        "final_state": EXPORTERS[format].final_state if have else None,
        "final_state_converted_from": have if convert else None,
    }


def _conversion_note(format: str, run: RunInfo, convert: Convert | None) -> list[str]:
    if convert is None:
        return []
    have, want = run.final_state, EXPORTERS[format].final_state
    how = (
        "exact"
        if want == "post-norm"
        else "each token's direction, scaled so the model's final norm gives the post-norm state back; "
        "speculators' EAGLE-3 training reads it only through that norm"
    )
    return [f"final state converted from {have} to {want} with the model's final norm ({how})"]


def _comparable(manifest: dict, path: Path) -> dict:
    """An export manifest without its source, the run as this version writes it (an export begun by an
    earlier version resumes)."""
    return {
        **{key: value for key, value in manifest.items() if key != "source"},
        "run": RunInfo.from_json(manifest["run"], str(path)).to_json(),
    }


def _difference(key: str, there, now) -> str:
    """One way an export begun in DEST differs from this one, in words."""
    if key == "run":
        return "of another extraction"
    if key == "ids":
        return "of other samples"
    return f"{key} {json.dumps(there)} there, {json.dumps(now)} now"


def _prepare_dest(dest: Path, manifest: dict) -> None:
    """Creates dest with its manifest, or accepts it as an earlier run of this same export."""
    manifest_path = dest / MANIFEST_NAME
    if manifest_path.is_file():
        # The source may have been moved or copied since; the run and the ids identify the data.
        there, now = _comparable(load_json(manifest_path), manifest_path), _comparable(manifest, manifest_path)
        if there == now:
            return
        differs = [
            _difference(key, there.get(key), now.get(key)) for key in {**there, **now} if there.get(key) != now.get(key)
        ]
        raise ExportError(
            f"{dest} holds another export, so this one cannot resume there: {'; '.join(differs)} (see "
            f"{manifest_path}). Choose an empty destination, or rerun the export as it was begun there"
        )
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ExportError(f"{dest} exists and is not an empty directory")
    dest.mkdir(parents=True, exist_ok=True)
    atomic_write(manifest_path, lambda tmp: tmp.write_text(json.dumps(manifest)))


@contextmanager
def _interrupt_between_samples() -> Iterator[None]:
    """Ctrl-C while a sample is read or saved takes effect once it is done. A KeyboardInterrupt raised
    inside torch's or safetensors' C++ code can surface as an unrelated error (e.g. "could not determine
    the shape of object type 'torch.storage.UntypedStorage'") instead of an interruption."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def _write_samples(
    dataset: HiddenStateDataset,
    path_of: Callable[[int], Path],
    read: Callable[[int], dict],
    save: Callable[[dict, Path], None],
    progress: bool,
    summary: "ExportSummary",
) -> None:
    """One file per sample (item `read(i)` saved by `save`), skipping those an earlier attempt wrote. Not
    fsynced per file (that would dominate an export of millions of small files); the rename still means a
    reader or a resumed export never sees a partial file, but a power loss may leave one empty, which is written
    again (no file of ours is empty)."""
    with RunProgress(lambda: len(dataset), "export", enabled=progress) as bar:
        for i in range(len(dataset)):
            path = path_of(i)
            if path.is_file() and path.stat().st_size:
                summary.samples_skipped += 1
                bar.advance(1, 0, summary.bytes_written)
                continue
            with _interrupt_between_samples():
                item = read(i)
                path.parent.mkdir(exist_ok=True)
                atomic_write(path, lambda tmp: save(item, tmp), durable=False)
            summary.samples_written += 1
            summary.bytes_written += path.stat().st_size
            bar.advance(1, len(item["input_ids"]), summary.bytes_written)


def _manifest(format: str, out_dir, dataset: HiddenStateDataset, **options) -> dict:
    return {
        "format": format,
        "source": str(Path(out_dir).resolve()),
        "run": dataset.run.to_json(),
        **options,
        "ids": dataset.ids,
    }


def export_specforge(
    out_dir: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    rows_per_folder: int = DEFAULT_ROWS_PER_FOLDER,
    gzipped: bool | None = None,
    progress: bool = True,
    allow_partial: bool = False,
) -> ExportSummary:
    """Writes every sample of out_dir to dest in SpecForge's offline layout (see the module docstring);
    gzipped=None gzips the files of a run stored as fp8 or compressed.

    An unfinished extraction is refused unless allow_partial (see `HiddenStateDataset`)."""
    if rows_per_folder <= 0:
        raise ValueError(f"rows_per_folder must be positive, got {rows_per_folder}")
    dataset = HiddenStateDataset(out_dir, allow_partial=allow_partial, verify_checksums=True)
    run = dataset.run
    convert = _final_state_conversion("specforge", run, out_dir)
    if gzipped is None:
        gzipped = run.store != "bf16" or run.compress != "none"
    dest = Path(dest)
    _prepare_dest(
        dest,
        _manifest(
            "specforge",
            out_dir,
            dataset,
            rows_per_folder=rows_per_folder,
            gzip=gzipped,
            **_final_state_manifest("specforge", run, convert),
        ),
    )
    summary = ExportSummary(dest, 0, 0, 0, _conversion_note("specforge", run, convert))
    _write_samples(
        dataset,
        lambda i: specforge_path(dest, i, rows_per_folder, gzipped),
        lambda i: dataset[i],
        lambda item, tmp: _save_specforge(specforge_record(_converted(item, convert), run.recipe), tmp, gzipped),
        progress,
        summary,
    )
    return summary


def export_speculators(
    out_dir: str | os.PathLike, dest: str | os.PathLike, *, progress: bool = True, allow_partial: bool = False
) -> ExportSummary:
    """Writes every sample of out_dir to dest as speculators' offline training data (see the module
    docstring): the per-sample states first, then the token table and frequencies. An unfinished
    extraction is refused unless allow_partial (see `HiddenStateDataset`)."""
    # The token table, written once every sample's states are, is a `datasets` table: checked before any work.
    if importlib.util.find_spec("datasets") is None:
        raise ExportError(
            "--format speculators needs the datasets package, which is not installed: pip install datasets"
        )
    dataset = HiddenStateDataset(out_dir, allow_partial=allow_partial, verify_checksums=True)
    run = dataset.run
    if run.recipe != "eagle3":
        raise ExportError(
            f"{out_dir} was extracted with --recipe {run.recipe}; speculators trains EAGLE-3 drafters "
            f"(export it with --format specforge)"
        )
    if run.final_state is None:
        raise ExportError(f"{out_dir} holds no final state, which speculators needs")
    convert = _final_state_conversion("speculators", run, out_dir)
    layer_ids = speculators_layer_ids(run, out_dir)
    # A converted final state is no longer the run's fp8 values: rounded to e4m3 a second time it would
    # drift from a direct run's (worst token cosine 0.9989 on the tiny model, where one rounding keeps
    # 0.999), and speculators' layout has one tensor for all layers. Such an export is bf16.
    fp8 = all(run.encoding.store_of(name) == "fp8" for name in STATE_TENSORS) and convert is None
    dest = Path(dest)
    _prepare_dest(
        dest,
        _manifest(
            "speculators",
            out_dir,
            dataset,
            layer_ids=layer_ids,
            target_layer_ids=layer_ids[:-1],
            store="fp8" if fp8 else "bf16",
            **_final_state_manifest("speculators", run, convert),
        ),
    )
    summary = ExportSummary(dest, 0, 0, 0, _speculators_notes(run, dest, layer_ids, fp8, convert))
    aux = len(layer_ids) - 1  # the run's aux layers, before the final state's
    read: Callable[[int], dict]
    if fp8:
        read, record = dataset.stored, lambda stored: speculators_fp8_record(stored, aux)
    else:
        read, record = dataset.__getitem__, lambda item: speculators_record(_converted(item, convert), aux)
    _write_samples(
        dataset,
        lambda i: speculators_path(dest, i),
        read,
        lambda item, tmp: _write_bytes(tmp, safetensors_bytes(record(item))),
        progress,
        summary,
    )
    _write_speculators_tokens(dataset, dest)
    config = speculators_train_config(run, dest, layer_ids, fp8)
    atomic_write(dest / SPECULATORS_TRAIN_CONFIG, lambda tmp: tmp.write_text(config))
    return summary


def _speculators_notes(run: RunInfo, dest: Path, layer_ids: list[int], fp8: bool, convert: Convert | None) -> list[str]:
    """What the user must know to train speculators on the export (`ExportSummary.notes`)."""
    notes = [
        f"train with --target-layer-ids {' '.join(map(str, layer_ids[:-1]))} (speculators' ids: ours + 1), "
        f"or --config {dest / SPECULATORS_TRAIN_CONFIG}"
    ]
    stores = {run.encoding.store_of(name) for name in STATE_TENSORS}
    if fp8:
        notes.append("states kept in fp8 with the run's scales: train with --hidden-states-backend fp8")
    elif stores == {"fp8"}:
        notes.append(
            "states written as bf16, not fp8: the converted final state would be rounded to fp8 a second "
            "time; extract with --final-state pre-norm for an fp8 export"
        )
    elif stores != {"bf16"}:
        notes.append(
            f"states written as bf16, decoded from the run's {' and '.join(sorted(stores - {'bf16'}))}: speculators "
            "reads bf16, or fp8 states alone with a scale per token"
        )
    return [*notes, *_conversion_note("speculators", run, convert)]


def _write_speculators_tokens(dataset: HiddenStateDataset, dest: Path) -> None:
    """speculators' token table (each sample's input_ids, loss_mask and seq_len, a datasets table saved in `dest`)
    and the frequencies of the tokens in the loss."""
    import datasets

    def rows():
        for i in range(len(dataset)):
            with _interrupt_between_samples():
                ids, mask = dataset.tokens(i)
                row = {"input_ids": ids.numpy(), "loss_mask": mask.to(torch.int64).numpy(), "seq_len": len(ids)}
            yield row

    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "loss_mask": datasets.Sequence(datasets.Value("int64")),
            "seq_len": datasets.Value("int64"),
        }
    )
    # datasets builds the table in a cache first; ours lives and dies inside DEST.
    cache = dest / ".datasets-cache"
    # Its own bars ("Generating train split", "Saving the dataset") are not ours: the export shows one bar.
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        table = datasets.Dataset.from_generator(rows, features=features, cache_dir=str(cache))
        table.set_format(type="torch")
        table.save_to_disk(str(dest))
        freq = _loss_token_counts(table)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if bars:
            datasets.enable_progress_bars()
    atomic_write(dest / SPECULATORS_TOKEN_FREQ, lambda tmp: _write_bytes(tmp, _torch_bytes(freq)))


def _loss_token_counts(table) -> dict[int, int]:
    """{token id: count} of the loss tokens in the datasets `table`, read from the table itself: `datasets` builds it
    from its cache where an interrupted export left one finished, without reading a sample again."""
    counts: Counter[int] = Counter()
    for batch in table.data.to_batches():
        ids, mask = (batch.column(name).flatten().to_numpy() for name in ("input_ids", "loss_mask"))
        tokens, n = np.unique(ids[mask != 0], return_counts=True)
        counts.update(dict(zip(tokens.tolist(), n.tolist())))
    return dict(counts)


# Each format's writer; what the format is (its --help, final state and options): formats.EXPORTERS.
WRITERS: dict[str, Callable[..., ExportSummary]] = {"specforge": export_specforge, "speculators": export_speculators}


def export(format: str, out_dir: str | os.PathLike, dest: str | os.PathLike, **options) -> ExportSummary:
    if format not in EXPORTERS:
        raise ValueError(f"unknown export format {format!r}; known: {', '.join(FORMATS)}")
    return WRITERS[format](out_dir, dest, **options)
