"""Offline extraction of EAGLE-3 training hidden states with SGLang's ModelRunner.

The public API::

    from offline_extract import ExtractOptions, extract
    summary = extract(ExtractOptions(data=("corpus.jsonl",), out="out"))

    from offline_extract import HiddenStateDataset, iter_samples, open_shard
    dataset = HiddenStateDataset("out")
    dataset.run.layer_ids  # the run's facts: a RunInfo

Everything else is internal and may change between versions.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# First: a run's clock starts here (timeline.interpreter_age), as every command and bin/ script imports the
# package before anything else of ours.
from offline_extract.lifecycle import timeline  # noqa: F401
from offline_extract.version import __version__

# Public name -> (module, name there). Imported on first use, so that `import offline_extract` (and so
# every bin/ script's start and every check made before the model loads) pays for torch and SGLang only
# when a name that needs them is used.
_EXPORTS = {
    "extract": ("offline_extract.extraction", "run"),
    "dry_run": ("offline_extract.extraction", "dry_run"),
    "ExtractOptions": ("offline_extract.options", "ExtractOptions"),
    "Summary": ("offline_extract.summary", "Summary"),
    "StoppedError": ("offline_extract.output", "StoppedError"),
    "HiddenStateDataset": ("offline_extract.training.datasets", "HiddenStateDataset"),
    "HiddenStateIterableDataset": ("offline_extract.training.datasets", "HiddenStateIterableDataset"),
    "pad_collate": ("offline_extract.training.datasets", "pad_collate"),
    "open_shard": ("offline_extract.store.shard", "open_shard"),
    "Shard": ("offline_extract.store.shard", "Shard"),
    "iter_samples": ("offline_extract.store.index", "iter_samples"),
    "SampleInfo": ("offline_extract.store.schema", "SampleInfo"),
    "RunInfo": ("offline_extract.store.schema", "RunInfo"),
    "ShardError": ("offline_extract.store.schema", "ShardError"),
    "verify": ("offline_extract.store.integrity", "verify"),
    "export": ("offline_extract.training.export", "export"),
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from offline_extract.extraction import dry_run
    from offline_extract.extraction import run as extract
    from offline_extract.options import ExtractOptions
    from offline_extract.output import StoppedError
    from offline_extract.store.index import iter_samples
    from offline_extract.store.integrity import verify
    from offline_extract.store.schema import RunInfo, SampleInfo, ShardError
    from offline_extract.store.shard import Shard, open_shard
    from offline_extract.summary import Summary
    from offline_extract.training.datasets import HiddenStateDataset, HiddenStateIterableDataset, pad_collate
    from offline_extract.training.export import export


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'offline_extract' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
