#!/usr/bin/env python
"""How well `--compress zstd` compresses the states of a model that has learned something, against the
same model with random weights (the only kind the GPU benchmarks have: `load_format=dummy`).

The project's tiny Llama (offline_extract.default_model: hidden 64, 8 layers, its own 384-token BPE) is
trained briefly on CPU on real English prose shipped with Python itself (the reference documentation in
`pydoc_data.topics`), then both it and its random initialisation run over held-out documentation. Each
sample's EAGLE-3 states (layers [1, 3, 4] and the final post-norm state) go through the product's own
codecs (store/codecs.py: bf16 or fp8 values, one byte-plane zstd frame per sample per tensor), and the
ratio is the bytes before over the bytes after (fp8: its float32 scales, stored raw, counted on both
sides).

A 64-wide model trained for minutes is still far from an 8B model's activations; this replaces random
weights as the source of the ratio, it does not predict a large model's to the percent.

    python -m benchmarks.realistic_compression --train-seconds 150 \
        --json benchmarks/results/realistic_compression_cpu.json
"""

from __future__ import annotations

import time

import click
import numpy as np
import torch

from benchmarks import command_line, emit, program

from offline_extract.default_model import ensure_tiny_model
from offline_extract.engine import reference
from offline_extract.store.codecs import compress_frame, compressor, fp8_quantize

LAYER_IDS = (1, 3, 4)  # SGLang's EAGLE-3 default for the tiny model; HF hidden_states index = id + 1


def documentation() -> list[str]:
    import pydoc_data.topics

    return [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]


def token_stream(tokenizer, documents: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for doc in documents:
        ids += tokenizer(doc)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def train(model, stream: torch.Tensor, seconds: float, seq: int, batch: int, lr: float, seed: int) -> dict:
    """AdamW on random windows of `stream` for `seconds`; the loss at the start and the end."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses, start, step = [], time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        offsets = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
        x = torch.stack([stream[o : o + seq] for o in offsets.tolist()])
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        step += 1
    model.eval()
    return {
        "steps": step,
        "seconds": round(time.perf_counter() - start, 1),
        "first_loss": round(losses[0], 3),
        "last_loss": round(float(np.mean(losses[-20:])), 3),
    }


@torch.no_grad()
def held_out_loss(model, samples: list[torch.Tensor]) -> float:
    return float(np.mean([model(input_ids=s[None], labels=s[None]).loss.item() for s in samples]))


@torch.no_grad()
def ratios(model, samples: list[torch.Tensor], layer_ids: tuple[int, ...] = LAYER_IDS) -> dict:
    """zstd ratios of the samples' states as the product stores them, bf16 and fp8."""
    cctx = compressor()
    raw = {"bf16": 0, "fp8": 0}
    packed = {"bf16": 0, "fp8": 0}
    for s in samples:
        hidden = model(input_ids=s[None], output_hidden_states=True).hidden_states
        aux = torch.cat([hidden[k + 1][0] for k in layer_ids], dim=-1).bfloat16()
        last = hidden[-1][0].bfloat16()
        for state, layers in ((aux, len(layer_ids)), (last, 1)):
            raw["bf16"] += state.numel() * 2
            packed["bf16"] += len(compress_frame(state, cctx))
            values, scales = fp8_quantize(state, layers)
            raw["fp8"] += values.numel() + scales.numel() * 4
            packed["fp8"] += len(compress_frame(values, cctx)) + scales.numel() * 4
    return {
        "bf16_zstd_ratio": round(raw["bf16"] / packed["bf16"], 3),
        "fp8_zstd_ratio": round(raw["fp8"] / packed["fp8"], 3),
        "fp8_zstd_vs_bf16_ratio": round(raw["bf16"] / packed["fp8"], 3),
        "state_bytes_bf16": raw["bf16"],
    }


@program(__doc__.split("\n\n")[0])
@click.option("--train-seconds", default=150.0, show_default=True)
@click.option("--seq", default=256, show_default=True, help="Training window, tokens.")
@click.option("--batch", default=16, show_default=True)
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--samples", default=48, show_default=True, help="Held-out samples measured.")
@click.option("--sample-tokens", default=512, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--model-dir", default=None, help="Where the tiny model is built (default: the user cache).")
@click.option(
    "--threads",
    default=1,
    show_default=True,
    help="Torch threads (a model this small runs 4-5x slower on 2 threads of a busy 2-core machine).",
)
@click.option("--json", "json_path", default=None, help="Write the result here.")
def main(
    train_seconds: float,
    seq: int,
    batch: int,
    lr: float,
    samples: int,
    sample_tokens: int,
    seed: int,
    model_dir: str | None,
    threads: int,
    json_path: str | None,
) -> dict:
    torch.manual_seed(seed)
    torch.set_num_threads(threads)

    model_dir = ensure_tiny_model(model_dir)
    model = reference.load_hf_model(str(model_dir), "float32", "cpu")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    docs = documentation()
    cut = int(len(docs) * 0.85)
    train_stream, test_stream = token_stream(tokenizer, docs[:cut]), token_stream(tokenizer, docs[cut:])
    n = sample_tokens
    held_out = [test_stream[i * n : (i + 1) * n] for i in range(min(samples, len(test_stream) // n))]

    result = {
        "command": command_line("python -m benchmarks.realistic_compression"),
        "model": "offline_extract tiny Llama (hidden 64, 8 layers, vocab 384)",
        "text": "pydoc_data.topics (Python reference documentation): 85% of topics train, the rest held out",
        "train_tokens": len(train_stream),
        "measured_tokens": sum(len(s) for s in held_out),
        "layer_ids": list(LAYER_IDS),
        "final_state": "post-norm",
    }
    result["random_weights"] = {"held_out_loss": round(held_out_loss(model, held_out), 3), **ratios(model, held_out)}
    result["training"] = train(model, train_stream, train_seconds, seq, batch, lr, seed)
    result["trained"] = {"held_out_loss": round(held_out_loss(model, held_out), 3), **ratios(model, held_out)}
    return emit(result, json_path)


if __name__ == "__main__":
    main()
