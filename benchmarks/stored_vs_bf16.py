"""What each store costs on one corpus, from finished runs: the shards' bytes a token, and each stored layer's
worst-token and median cosine to a bf16 run of the same records.

\b
    python benchmarks/stored_vs_bf16.py --reference OUT_BF16 OUT [OUT ...] [--json FILE]

Every output must hold the reference's samples (the same corpus and options but --store and --compress): the
states of one sample are compared token by token, per layer, as the readers decode them (bf16).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import command_line, emit, program  # noqa: E402

from offline_extract.store.index import shard_paths  # noqa: E402
from offline_extract.training.datasets import HiddenStateDataset  # noqa: E402


def _layer_names(ds: HiddenStateDataset) -> list[str]:
    run = ds.run
    return [f"layer {k}" for k in run.layer_ids] + ([f"final ({run.final_state})"] if run.final_state else [])


def _cosines(ds: HiddenStateDataset, reference: HiddenStateDataset) -> list[torch.Tensor]:
    """Each layer's cosine of every token to the reference's, in layer order (the aux layers, then the final state)."""
    k = ds.run.num_aux_layers
    per_layer: list[list[torch.Tensor]] = [[] for _ in _layer_names(ds)]
    for i in range(len(ds)):
        item, ref = ds[i], reference[i]
        if item["id"] != ref["id"]:
            raise click.ClickException(f"sample {i} is {item['id']!r} here but {ref['id']!r} in the reference")
        for name in ("aux_hidden_states", "hidden_states"):
            if name not in item:
                continue
            a, b = item[name].float(), ref[name].float()
            layers = k if name == "aux_hidden_states" else 1
            cos = torch.nn.functional.cosine_similarity(
                a.unflatten(-1, (layers, -1)), b.unflatten(-1, (layers, -1)), dim=-1
            )
            for j in range(layers):
                per_layer[j if name == "aux_hidden_states" else k].append(cos[:, j])
    return [torch.cat(c) for c in per_layer]


def _bytes(out: Path, ds: HiddenStateDataset) -> dict:
    total = sum(p.stat().st_size for p in shard_paths(out))
    tokens = sum(len(ds.tokens(i)[0]) for i in range(len(ds)))
    return {"bytes": total, "tokens": tokens, "bytes_per_token": round(total / tokens, 1)}


@program(__doc__.split("\n\n")[0])
@click.option("--reference", required=True, help="The bf16 run's output directory.")
@click.argument("outs", nargs=-1, required=True)
@click.option("--json", "json_path", default=None, help="Write the result here.")
def main(reference: str, outs: tuple[str, ...], json_path: str | None) -> dict:
    ref = HiddenStateDataset(reference)
    base = _bytes(Path(reference), ref)
    runs = {}
    for out in outs:
        ds = HiddenStateDataset(out)
        sizes = _bytes(Path(out), ds)
        if sizes["tokens"] != base["tokens"]:
            raise click.ClickException(f"{out} holds {sizes['tokens']} tokens, the reference {base['tokens']}")
        runs[out] = {
            "encoding": ds.run.encoding.to_json(),
            **sizes,
            "of_bf16": round(sizes["bytes"] / base["bytes"], 4),
            "cosine_vs_bf16": {
                name: {"worst": round(c.min().item(), 6), "median": round(c.median().item(), 6)}
                for name, c in zip(_layer_names(ds), _cosines(ds, ref))
            },
        }
    result = {
        "command": command_line("python benchmarks/stored_vs_bf16.py"),
        "reference": {reference: base},
        "runs": runs,
    }
    return emit(result, json_path)


if __name__ == "__main__":
    main()
