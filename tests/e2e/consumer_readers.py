"""Reads exports with the trainers' own reading code; run inside the virtual environment that
tests/e2e/consumers.py builds (SpecForge and speculators at their pinned versions), never in the test process.

    python consumer_readers.py JOBS.json

JOBS.json lists {"format": "specforge" | "speculators", "dest": export directory, "dump": output path,
"recipe": "eagle3" | "dflash"}. For each job every sample, as the trainer's dataset hands it to training,
is saved with torch.save to `dump` as {"samples": {export index i: {name: tensor}}, ...}; the test
compares every tensor with our own reader.
"""

import argparse
import json
import re
import sys
from pathlib import Path

import torch


def read_specforge(dest: str, recipe: str) -> dict:
    """SpecForge 0.2.0: the legacy OfflineEagle3Dataset over list_local_files (.ckpt and .ckpt.gz), and the
    runtime's OfflineManifestReader whose file:// refs its feature store opens with load_feature_file."""
    from specforge.data.preprocessing import OfflineEagle3Dataset, list_local_files, process_offline_dflash_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    files = list_local_files(dest)
    refs = OfflineManifestReader(dest, strategy=recipe).read()
    ref_files = [ref.feature_store_uri.removeprefix("file://") for ref in refs]
    if sorted(ref_files) != sorted(str(Path(f).resolve()) for f in files):
        raise SystemExit(f"OfflineManifestReader listed {len(ref_files)} files, list_local_files {len(files)}")
    samples = {}
    if recipe == "eagle3":
        dataset = OfflineEagle3Dataset(files, max_len=1 << 20)
        for k, path in enumerate(files):
            item = dataset[k]
            samples[_index(path)] = {
                name: item[name][0] for name in ("input_ids", "loss_mask", "hidden_state", "target")
            }
    else:
        for path in ref_files:
            item = process_offline_dflash_sample(load_feature_file(path), max_len=1 << 20)
            samples[_index(path)] = {name: t[0] for name, t in item.items()}
    return {"samples": samples, "files": len(files)}


def read_speculators(dest: str) -> dict:
    """speculators 0.9.0 as `speculators train --config DEST/speculators_train.yaml` sets it up: the config
    resolved by its own resolver, the hidden-states backend it names built from it (hs-connectors), and
    its ArrowDataset reading through that backend."""
    from hs_connectors import HiddenStatesBackend
    from speculators.train.config.schema import TrainConfig
    from speculators.train.data import ArrowDataset

    config = TrainConfig.from_sources(cli={}, config_path=str(Path(dest) / "speculators_train.yaml"), argv=[])
    backend = HiddenStatesBackend.registry[config.data.hidden_states_backend]
    transfer = backend.from_train_args(argparse.Namespace(hidden_states_path=None), config.data.data_path)
    dataset = ArrowDataset(max_len=1 << 20, datapath=config.data.data_path, transfer=transfer, on_missing="raise")
    samples = {}
    for i in range(len(dataset)):
        item = dataset[i]
        samples[i] = {
            name: item[name] for name in ("input_ids", "loss_mask", "hidden_states", "verifier_last_hidden_states")
        }
    return {
        "samples": samples,
        "target_layer_ids": list(config.draft.target_layer_ids),
        "hidden_states_backend": config.data.hidden_states_backend,
        "transfer": type(transfer).__name__,
    }


def _index(path: str) -> int:
    return int(re.search(r"data_(\d+)\.ckpt", path).group(1))


def main() -> None:
    for job in json.loads(Path(sys.argv[1]).read_text()):
        if job["format"] == "specforge":
            result = read_specforge(job["dest"], job.get("recipe", "eagle3"))
        else:
            result = read_speculators(job["dest"])
        torch.save(result, job["dump"])


if __name__ == "__main__":
    main()
