#!/usr/bin/env python
"""How `--compress zstd` shrinks the states of the two kinds of random weights the GPU runs use: SGLang's
dummy loader (`--load-format dummy`, what bin/bench.py runs by default) and the generated checkpoint of
benchmarks/make_8b_model.sh (offline_extract.testing.models.build_model, what the main job runs, since
--verify needs weights on disk).

SGLang's dummy loader draws every floating-point parameter uniformly in [-1e-3, 1e-3], each from a
generator seeded alike (its weight_utils.initialize_dummy_weights): the norms' weights too. Each layer's
input is then scaled by about 1e-3 before its projections, so attention and MLP add almost nothing, the
residual stream stays the token's embedding row through every layer, and the stored states are a
function of the token alone: zstd finds the same rows again. build_model draws norms near 1, projections
of variance 1/fan-in and embeddings of variance 1, so each layer moves the states, as a trained model's do.

This runs a Llama of the 8B shape's depth, GQA and head size at a smaller width (the tiny tokenizer, the
bench's lognormal chat corpus) under both initialisations, on CPU, and reports the product's ratios
(benchmarks.realistic_compression.ratios: bf16 and fp8 values, one byte-plane zstd frame per sample per
tensor) and each stored layer's mean cosine to the token's embedding row. (HF holds q/k/v and gate/up as
separate tensors where SGLang merges them; each is drawn alike, which does not matter at this scale.)

    python -m benchmarks.weights_compression --json benchmarks/results/weights_compression_cpu.json
"""

from __future__ import annotations

import click
import numpy as np
import torch

from benchmarks import command_line, emit, program
from benchmarks.extraction_vs_prefill import BenchOptions, synthetic_corpus
from benchmarks.realistic_compression import ratios
from offline_extract.default_model import _random_tensor, ensure_tiny_model
from offline_extract.testing.models import ARCHITECTURES

DUMMY_RANGE, DUMMY_SEED = 1e-3, 1234


@torch.no_grad()
def initialise(model, kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    for name, p in model.state_dict().items():
        if kind == "generated":  # as build_model draws them, in bf16 as make_8b_model.sh writes them
            p.copy_(_random_tensor(name, tuple(p.shape), gen, torch.bfloat16, "cpu"))
        else:
            drawn = torch.empty(p.shape).uniform_(
                -DUMMY_RANGE, DUMMY_RANGE, generator=torch.Generator().manual_seed(DUMMY_SEED)
            )
            p.copy_(drawn.bfloat16())


@torch.no_grad()
def cosine_to_embedding(model, samples: list[torch.Tensor], layer_ids: tuple[int, ...]) -> dict[int, float]:
    found = {k: [] for k in layer_ids}
    for s in samples:
        hidden = model(input_ids=s[None], output_hidden_states=True).hidden_states
        for k in layer_ids:
            found[k].append(torch.nn.functional.cosine_similarity(hidden[k + 1][0], hidden[0][0], dim=-1).mean().item())
    return {k: round(float(np.mean(v)), 4) for k, v in found.items()}


@program(__doc__.split("\n\n")[0])
@click.option("--hidden", default=1024, show_default=True, help="Width (the 8B shape's is 4096; intermediate 3.5x).")
@click.option("--layers", default=32, show_default=True)
@click.option("--num-tokens", default=8000, show_default=True, help="Of the bench's lognormal corpus (mean 1,700).")
@click.option("--threads", default=1, show_default=True)
@click.option("--json", "json_path", default=None, help="Write the result here.")
def main(hidden: int, layers: int, num_tokens: int, threads: int, json_path: str | None) -> dict:
    torch.set_num_threads(threads)
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from offline_extract.data.tokenization import SampleTokenizer

    tiny = ensure_tiny_model()
    tokenizer = SampleTokenizer(AutoTokenizer.from_pretrained(tiny), max_length=8192)
    samples = [
        torch.as_tensor(np.asarray(s.input_ids))
        for s in synthetic_corpus(tokenizer, BenchOptions(num_tokens=num_tokens))
    ]
    shape = {
        **ARCHITECTURES["llama3_8b"](0),
        "hidden_size": hidden,
        "intermediate_size": hidden * 7 // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 128,
        "num_key_value_heads": max(1, hidden // 512),
        "max_position_embeddings": 16384,
        "torch_dtype": "float32",
    }
    config = AutoConfig.for_model(**{k: v for k, v in shape.items() if k != "architectures"})
    model = AutoModel.from_config(config).eval()  # the decoder and its final norm; no LM head
    # SGLang's EAGLE-3 default for this depth, as for the 8B shape: [1, N/2 - 1, N - 4].
    layer_ids = (1, layers // 2 - 1, layers - 4)
    result = {
        "command": command_line("python -m benchmarks.weights_compression"),
        "shape": {
            k: shape[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
            )
        },
        "layer_ids": list(layer_ids),
        "final_state": "post-norm",
        "tokens": int(sum(len(s) for s in samples)),
        "samples": len(samples),
    }
    for kind in ("dummy", "generated"):
        initialise(model, kind)
        result[kind] = {
            **ratios(model, samples, layer_ids),
            "cosine_to_embedding": cosine_to_embedding(model, samples, layer_ids),
        }
    return emit(result, json_path)


if __name__ == "__main__":
    main()
