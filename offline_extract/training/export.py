"""Export an output directory to other trainers' offline layouts.

SpecForge (`--format specforge`): one torch.save file per sample,

    DEST/rows_{start}-{start + rows_per_folder}/data_{i}.ckpt
        input_ids         int64    [T]
        loss_mask         int64    [T]         (SpecForge builds its masks as int64)
        hidden_state      bfloat16 [1, T, H]   (final post-norm state: SpecForge's training target)
        aux_hidden_state  bfloat16 [1, T, k*H] (EAGLE-3 layers, ascending layer order)

where i counts samples from 0 in sample-index order, and folder rows_{start}-{end} holds i in
[start, end). That is the layout SpecForge's scripts/prepare_hidden_states.py writes and its offline
training reads; its loader walks DEST recursively for *.ckpt, so rows_per_folder only bounds directory
sizes (SpecForge's default has been 2000 since its --file-group-size option; 5000 before).

DEST also gets export_manifest.json (ignored by SpecForge, which reads only *.ckpt): the source
directory, the run, and data_i's sample id at position i. An interrupted export resumes when rerun
with the same source and rows_per_folder: every file is renamed into place complete, so existing
ones are skipped.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from offline_extract.progress import RunProgress
from offline_extract.store.journal import load_json
from offline_extract.store.shards import atomic_write
from offline_extract.training.datasets import HiddenStateDataset

FORMATS = ("specforge",)
MANIFEST_NAME = "export_manifest.json"
DEFAULT_ROWS_PER_FOLDER = 2000


class ExportError(ValueError):
    """The destination cannot take this export."""


@dataclass
class ExportSummary:
    dest: Path
    samples_written: int
    samples_skipped: int
    bytes_written: int


def specforge_path(dest: str | os.PathLike, i: int, rows_per_folder: int = DEFAULT_ROWS_PER_FOLDER) -> Path:
    start = i // rows_per_folder * rows_per_folder
    return Path(dest) / f"rows_{start}-{start + rows_per_folder}" / f"data_{i}.ckpt"


def specforge_record(item: dict) -> dict[str, torch.Tensor]:
    """A reader item as SpecForge's per-sample dict; each tensor owns a storage of exactly its size."""
    return {
        "input_ids": item["input_ids"].to(torch.int64),
        "loss_mask": item["loss_mask"].to(torch.int64),
        "hidden_state": item["hidden_states"].unsqueeze(0),
        "aux_hidden_state": item["aux_hidden_states"].unsqueeze(0),
    }


def _without_source(manifest: dict) -> dict:
    return {key: value for key, value in manifest.items() if key != "source"}


def _prepare_dest(dest: Path, manifest: dict) -> None:
    """Creates dest with its manifest, or accepts it as an earlier run of this same export."""
    manifest_path = dest / MANIFEST_NAME
    if manifest_path.is_file():
        earlier = load_json(manifest_path)
        # The source may have been moved or copied since; the run and the ids identify the data.
        if _without_source(earlier) == _without_source(manifest):
            return
        raise ExportError(
            f"{dest} holds an export of different data or with a different rows_per_folder "
            f"(see {manifest_path}); choose an empty destination"
        )
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ExportError(f"{dest} exists and is not an empty directory")
    dest.mkdir(parents=True, exist_ok=True)
    atomic_write(manifest_path, lambda tmp: tmp.write_text(json.dumps(manifest)))


def export_specforge(
    out_dir: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    rows_per_folder: int = DEFAULT_ROWS_PER_FOLDER,
    progress: bool = True,
) -> ExportSummary:
    """Writes every sample of out_dir to dest in SpecForge's offline layout (see the module docstring)."""
    if rows_per_folder <= 0:
        raise ValueError(f"rows_per_folder must be positive, got {rows_per_folder}")
    dataset = HiddenStateDataset(out_dir)
    dest = Path(dest)
    _prepare_dest(
        dest,
        {
            "format": "specforge",
            "source": str(Path(out_dir).resolve()),
            "run": dataset.run,
            "rows_per_folder": rows_per_folder,
            "ids": dataset.ids,
        },
    )
    summary = ExportSummary(dest, 0, 0, 0)
    with RunProgress(lambda: len(dataset), "export", enabled=progress) as bar:
        for i in range(len(dataset)):
            path = specforge_path(dest, i, rows_per_folder)
            if path.exists():
                summary.samples_skipped += 1
                bar.advance(1, 0, summary.bytes_written)
                continue
            item = dataset[i]
            path.parent.mkdir(exist_ok=True)
            # Not fsynced per file (that would dominate an export of millions of small files); the
            # rename still means a reader or a resumed export never sees a partial file.
            tmp = path.with_name(f".{path.name}.tmp")
            try:
                torch.save(specforge_record(item), tmp)
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            summary.samples_written += 1
            summary.bytes_written += path.stat().st_size
            bar.advance(1, len(item["input_ids"]), summary.bytes_written)
    return summary


def export(format: str, out_dir: str | os.PathLike, dest: str | os.PathLike, **options) -> ExportSummary:
    if format == "specforge":
        return export_specforge(out_dir, dest, **options)
    raise ValueError(f"unknown export format {format!r}; known: {', '.join(FORMATS)}")

