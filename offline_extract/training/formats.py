"""The trainers' offline layouts that an export writes, one a `--format`: what each is, as the export
command's --help says it. Apart from their writers (training/export.py), which import torch: --help need
not wait for it."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ROWS_PER_FOLDER = 2000


@dataclass(frozen=True)
class Exporter:
    """A trainer's offline layout, as `--format` names it; its writer is training/export.WRITERS'."""

    final_state: str  # the one its trainer trains on; a run holding the other is converted (training/export.py)
    help: str  # its layout, in bin/export.py --help
    options: tuple[str, ...] = ()  # keyword options of its writer that only this format takes


EXPORTERS = {
    "specforge": Exporter(
        "post-norm",
        options=("rows_per_folder", "gzipped"),
        help="DEST/rows_{start}-{end}/data_{i}.ckpt (.ckpt.gz with --gzip, the default for a run stored as fp8, "
        "nvfp4 or zstd), one torch.save dict per sample with input_ids [T] and loss_mask [T] (int64) and, for an "
        "eagle3 run, hidden_state [1, T, H] (post-norm) and aux_hidden_state [1, T, k*H] (bf16); for a dflash "
        "run hidden_states [1, T, k*H]; for dspark also target_last_hidden_states [1, T, H]. i counts samples "
        "in sample-index order; give DEST to SpecForge's offline training as its hidden-states path.",
    ),
    "speculators": Exporter(
        "pre-norm",
        help="DEST is its training data directory: a datasets table (input_ids, loss_mask, seq_len), "
        "DEST/hidden_states/hs_{i}.safetensors (hidden_states [T, k+1, H], the pre-norm final state last, and "
        "token_ids [T]; from a run of fp8 states alone e4m3 values and hidden_states_scales [T, k+1, 1], read with "
        "--hidden-states-backend fp8), DEST/token_freq.pt, and DEST/speculators_train.yaml for `speculators "
        "train --config`. speculators' layer ids are ours + 1 (HF hidden_states indices; the final state is "
        "num_layers): the YAML and export_manifest.json give its --target-layer-ids for this run.",
    ),
}
FORMATS = tuple(EXPORTERS)
