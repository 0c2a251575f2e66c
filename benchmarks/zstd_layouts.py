#!/usr/bin/env python
"""Which zstd layout for `--compress zstd`: ratio and single-thread speed on CPU, per candidate.

\b
Candidates, each over the same samples' hidden states (aux + final, bf16 or fp8 values):
  shard        one frame over the shard's concatenated tensor bytes (the whole file compressed)
  tensor       one frame per tensor, bytes as they lie
  tensor+planes one frame per tensor, bytes grouped by significance (byte planes)
  sample+planes one frame per sample per tensor, byte planes (random access per sample)

The states come from a randomly initialised Llama (HF transformers, on CPU) run over random tokens:
random-weight activations are not a trained model's, so the ratios are indicative only; what this
decides is the relative order of the layouts, and their speed.

\b
    python -m benchmarks.zstd_layouts --hidden 2048 --layers 8 --tokens 8192 --repeat 2 \\
        --json benchmarks/results/zstd_layouts_cpu.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import torch
import zstandard

from benchmarks import command_line, program
from offline_extract.store.codecs import (
    ZSTD_LEVEL,
    compress_frame,
    compressor,
    decompress_frame,
    decompressor,
    fp8_quantize,
)


def activations(
    hidden: int, layers: int, tokens: int, sample_tokens: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, 3H], final [T, H]) in bf16 from a random Llama: ids [1, N/2-1, N-4] + the post-norm state."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 512),
        vocab_size=32000,
        max_position_embeddings=sample_tokens,
    )
    model = LlamaForCausalLM(config).eval()
    ids = [1, layers // 2 - 1, layers - 4]
    aux, last = [], []
    with torch.no_grad():
        for start in range(0, tokens, sample_tokens):
            n = min(sample_tokens, tokens - start)
            out = model(input_ids=torch.randint(0, 32000, (1, n)), output_hidden_states=True, use_cache=False)
            hs = out.hidden_states
            aux.append(torch.cat([hs[k + 1][0] for k in ids], dim=-1).bfloat16())
            last.append(hs[-1][0].bfloat16())
    return torch.cat(aux), torch.cat(last)


def measure(name: str, tensors: list[torch.Tensor], frames_of, repeat: int) -> dict:
    """frames_of(tensor) -> list of (chunk tensor) to compress each as one frame."""
    cctx, dctx = compressor(), decompressor()
    raw = sum(t.numel() * t.element_size() for t in tensors)
    chunks = [c for t in tensors for c in frames_of(t)]
    best_c = best_d = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        frames = [
            compress_frame(c, cctx)
            if name.endswith("planes")
            else cctx.compress(c.contiguous().view(torch.uint8).numpy())
            for c in chunks
        ]
        best_c = min(best_c, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for c, f in zip(chunks, frames):
            if name.endswith("planes"):
                decompress_frame(f, c.dtype, c.shape[0], dctx)
            else:
                dctx.decompress(f)
        best_d = min(best_d, time.perf_counter() - t0)
    packed = sum(len(f) for f in frames)
    return {
        "layout": name,
        "frames": len(frames),
        "raw_bytes": raw,
        "compressed_bytes": packed,
        "ratio": raw / packed,
        "compress_MBps": raw / best_c / 1e6,
        "decompress_MBps": raw / best_d / 1e6,
    }


@program(__doc__)
@click.option("--hidden", default=2048, show_default=True)
@click.option("--layers", default=8, show_default=True)
@click.option("--tokens", default=16384, show_default=True)
@click.option("--sample-tokens", default=1700, show_default=True)
@click.option("--repeat", default=3, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the result to this file.",
)
def main(
    hidden: int, layers: int, tokens: int, sample_tokens: int, repeat: int, seed: int, json_path: Path | None
) -> None:
    torch.set_num_threads(1)
    aux, last = activations(hidden, layers, tokens, sample_tokens, seed)
    bounds = list(range(0, tokens, sample_tokens)) + [tokens]
    stores = {
        "bf16": [aux, last],
        "fp8": [fp8_quantize(aux, 3)[0], fp8_quantize(last, 1)[0]],
    }
    layouts = {
        "shard": lambda t: [t],  # the tensors are concatenated below
        "tensor": lambda t: [t],
        "tensor+planes": lambda t: [t],
        "sample+planes": lambda t: [t[s:e] for s, e in zip(bounds, bounds[1:])],
    }
    rows = []
    for store, tensors in stores.items():
        for name, frames_of in layouts.items():
            if name == "shard":
                whole = torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in tensors])
                row = measure(name, [whole], frames_of, repeat)
            else:
                row = measure(name, tensors, frames_of, repeat)
            rows.append({"store": store, **row})
            print(
                f"{store:5} {name:14} ratio {row['ratio']:.3f}  compress {row['compress_MBps']:7.0f} MB/s  "
                f"decompress {row['decompress_MBps']:7.0f} MB/s  ({row['frames']} frames)",
                flush=True,
            )
    if json_path:
        args = {
            "hidden": hidden,
            "layers": layers,
            "tokens": tokens,
            "sample_tokens": sample_tokens,
            "repeat": repeat,
            "seed": seed,
            "json": str(json_path),
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(
            json.dumps(
                {
                    "command": command_line("python -m benchmarks.zstd_layouts"),
                    "args": args,
                    "zstd_level": ZSTD_LEVEL,
                    "zstandard": zstandard.__version__,
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
