"""Which 4-bit encoding holds a real model's states: NVFP4 against MXFP4, beside fp8, per layer, and what each
costs in bytes a token with and without zstd.

\b
    python benchmarks/fp4_encodings.py --model DIR --data corpus.jsonl [--samples 200] [--json FILE]

HF's model runs the corpus's first --samples samples (tokenized as an extraction does, at most 4096 tokens) in
bf16 on CPU; every decoder layer's output and the post-norm final state go through each encoding and back, and
each token's cosine to its bf16 state is taken per layer (the worst token and the median).

\b
    fp8             the store's (--store fp8): e4m3, a float32 scale per token per layer
    nvfp4           the store's (--store nvfp4): e2m1, an e4m3 scale per 16 under a float32 one per token per layer
    nvfp4-absolute  e2m1 and its e4m3 scales per 16 alone, no second scale: e4m3 tops out at 448
    mxfp4           OCP MX: e2m1, an e8m0 scale per 32 of 2^(floor(log2 absmax) - 2), the largest clipped to 6
    mxfp4-ceil      the same with 2^ceil(log2(absmax / 6)): nothing clipped, a coarser grid

Bytes a token are those of the EAGLE-3 layout the run stores (the aux layers side by side, the post-norm
final state), each state tensor as the writer lays it out (`--compress zstd`: the values and any block scales
one byte-plane zstd frame a sample, the scales per token raw), plus the token tensors, over bf16's; each mix of
an aux encoding and a final state one. `logits_vs_bf16` holds what the trainer's target keeps: the model's head
on the decoded final state (every --logits-stride-th token), its top-1 token against bf16's and the KL divergence
of bf16's distribution from it; beside them, bf16 compute's own against the same weights computing in float32.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import command_line, emit, program  # noqa: E402
from benchmarks.gate_margin import corpus_samples  # noqa: E402

from offline_extract.store.codecs import (  # noqa: E402
    E2M1_MAX,
    FP8_DTYPE,
    FP8_MAX,
    compress_frame,
    compressor,
    e2m1_codes,
    e2m1_values,
    fp8_dequantize,
    fp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
    pack_nibbles,
)

MX_BLOCK = 32
NV_BLOCK = 16


def _fp8(state: torch.Tensor, layers: int) -> tuple[torch.Tensor, dict, dict]:
    values, scales = fp8_quantize(state, layers)
    return fp8_dequantize(values, scales), {"values": values}, {"scales": scales}


def _nvfp4(state: torch.Tensor, layers: int) -> tuple[torch.Tensor, dict, dict]:
    packed, blocks, scales = nvfp4_quantize(state, layers)
    return nvfp4_dequantize(packed, blocks, scales), {"values": packed}, {"block_scales": blocks, "scales": scales}


def _nvfp4_absolute(state: torch.Tensor, layers: int) -> tuple[torch.Tensor, dict, dict]:
    x = state.float().unflatten(-1, (-1, NV_BLOCK))
    block = (x.abs().amax(-1) / E2M1_MAX).clamp(max=FP8_MAX).to(FP8_DTYPE)
    step = block.float().masked_fill(block.float() == 0, float("inf")).unsqueeze(-1)
    codes = e2m1_codes(x / step)
    decoded = e2m1_values(pack_nibbles(codes.flatten(-2))).unflatten(-1, (-1, NV_BLOCK)) * block.float().unsqueeze(-1)
    return decoded.flatten(-2).bfloat16(), {"values": pack_nibbles(codes.flatten(-2))}, {"block_scales": block}


def _mxfp4(state: torch.Tensor, layers: int, ceil: bool = False) -> tuple[torch.Tensor, dict, dict]:
    x = state.float().unflatten(-1, (-1, MX_BLOCK))
    absmax = x.abs().amax(-1)
    exponent = torch.ceil(torch.log2(absmax / E2M1_MAX)) if ceil else torch.floor(torch.log2(absmax)) - 2
    exponent = torch.where(absmax == 0, 0.0, exponent).clamp(-127, 127)
    step = torch.exp2(exponent).unsqueeze(-1)
    codes = pack_nibbles(e2m1_codes(x / step).flatten(-2))
    decoded = e2m1_values(codes).unflatten(-1, (-1, MX_BLOCK)) * step
    return decoded.flatten(-2).bfloat16(), {"values": codes}, {"block_scales": (exponent + 127).to(torch.uint8)}


ENCODINGS = {
    "fp8": _fp8,
    "nvfp4": _nvfp4,
    "nvfp4-absolute": _nvfp4_absolute,
    "mxfp4": _mxfp4,
    "mxfp4-ceil": lambda state, layers: _mxfp4(state, layers, ceil=True),
}


def _cosines(decoded: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(decoded.float(), state.float(), dim=-1)


class _Bytes:
    """Bytes of each tensor kind of each encoding of each stored state (aux, final), raw and as zstd frames."""

    def __init__(self):
        self.raw: dict = {}
        self.zstd: dict = {}
        self.cctx = compressor()

    def add(self, where: str, encoding: str, framed: dict, raw: dict) -> None:
        for kind, t in {**framed, **raw}.items():
            key = (where, encoding, kind)
            self.raw[key] = self.raw.get(key, 0) + t.numel() * t.element_size()
            packed = len(compress_frame(t.contiguous(), self.cctx))
            self.zstd[key] = self.zstd.get(key, 0) + packed


def _states(hf, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every decoder layer's output (id k at k; the last one's pre-norm, as --final-state pre-norm stores it), then
    the post-norm final state, in bf16; and the post-norm final state of the same weights computing in float32."""
    from offline_extract.engine import parity

    seen = []
    hook = hf.get_decoder().norm.register_forward_hook(lambda norm, args, out: seen.append(args[0][0]))
    try:
        states = parity.hf_hidden_states(hf, ids, "cpu")
    finally:
        hook.remove()
    with parity.float32_pass(hf):
        final32 = parity.hf_hidden_states(hf, ids, "cpu")[-1]
    return [*states[1:-1], seen[-1], states[-1]], final32


def _key(k: int, count: int) -> str:
    return {count - 2: f"{k} (pre-norm final)", count - 1: "final (post-norm)"}.get(k, str(k))


def _head_check(head: torch.Tensor, want: torch.Tensor, decoded: torch.Tensor) -> dict:
    """Top-1 agreement and KL(want || decoded's) of the head's distributions (`want`: bf16's log-probabilities),
    in float32."""
    got = torch.log_softmax(decoded.float() @ head.T, dim=-1)
    kl = (want.exp() * (want - got)).sum(-1)
    return {"same_top1": (want.argmax(-1) == got.argmax(-1)).float(), "kl": kl}


class _Measures:
    """What the samples give, one at a time: each layer's cosines and the final state's head check by encoding,
    the stored layout's bytes."""

    def __init__(self, hf, aux_ids: list[int], logits_stride: int):
        self.hf, self.aux_ids, self.stride = hf, aux_ids, logits_stride
        self.head = hf.get_output_embeddings().weight.detach().float()
        self.per_layer: dict = {}
        self.logits: dict = {name: {"same_top1": [], "kl": []} for name in ENCODINGS}
        self.floor: dict = {"same_top1": [], "kl": []}
        self.sizes, self.tokens, self.hidden = _Bytes(), 0, 0

    def add(self, ids: list[int]) -> None:
        layer_states, final32 = _states(self.hf, ids)
        self.tokens, self.hidden = self.tokens + len(ids), layer_states[-1].shape[-1]
        rows = torch.arange(0, len(ids), self.stride)
        want = torch.log_softmax(layer_states[-1][rows].float() @ self.head.T, dim=-1)
        for what, v in _head_check(self.head, want, final32[rows]).items():
            self.floor[what].append(v)
        aux_state = torch.cat([layer_states[k] for k in self.aux_ids], dim=-1)
        # bf16's own bytes, with and without zstd.
        self.sizes.add("aux", "bf16", {"values": aux_state}, {})
        self.sizes.add("final", "bf16", {"values": layer_states[-1]}, {})
        for name, encode in ENCODINGS.items():
            for k, state in enumerate(layer_states):
                by_encoding = self.per_layer.setdefault(_key(k, len(layer_states)), {})
                by_encoding.setdefault(name, []).append(_cosines(encode(state, 1)[0], state))
            self.sizes.add("aux", name, *encode(aux_state, len(self.aux_ids))[1:])
            final_decoded, framed, raw = encode(layer_states[-1], 1)
            self.sizes.add("final", name, framed, raw)
            for what, v in _head_check(self.head, want, final_decoded[rows]).items():
                self.logits[name][what].append(v)

    def result(self) -> dict:
        return {
            "tokens": self.tokens,
            "cosine_vs_bf16": {
                key: {name: _worst_and_median(torch.cat(c)) for name, c in by.items()}
                for key, by in self.per_layer.items()
            },
            "logits_vs_bf16": {
                "bf16 vs float32 compute (the floor)": _head_summary(self.floor),
                **{name: _head_summary(v) for name, v in self.logits.items()},
            },
            "layout": {"aux_layers": self.aux_ids, "final_state": "post-norm", "hidden_size": self.hidden},
            "bytes_per_token": _mixes(self.sizes, self.tokens, len(self.aux_ids), self.hidden),
        }


@program(__doc__.split("\n\n")[0])
@click.option("--model", required=True, help="The real model's directory (real_model.py --print-path).")
@click.option("--data", required=True, help="A JSONL corpus (real_model.py --corpus).")
@click.option("--samples", default=200, show_default=True)
@click.option("--layers", "aux", default="1,14,26", show_default=True, help="The aux layers of the stored layout.")
@click.option("--logits-stride", default=4, show_default=True, help="The head's check on every Nth token.")
@click.option("--threads", default=2, show_default=True)
@click.option("--json", "json_path", default=None, help="Write the result here.")
def main(
    model: str, data: str, samples: int, aux: str, logits_stride: int, threads: int, json_path: str | None
) -> dict:
    from offline_extract.engine import reference

    torch.set_num_threads(threads)
    measures = _Measures(
        reference.load_hf_model(model, "bfloat16", "cpu"), [int(i) for i in aux.split(",")], logits_stride
    )
    seqs = corpus_samples(model, data, samples)
    with torch.no_grad():
        for ids in seqs:
            measures.add(ids)
    result = {
        "command": command_line("python benchmarks/fp4_encodings.py"),
        "model": model,
        "data": data,
        "samples": len(seqs),
        "compute": "HF transformers, bf16, CPU",
        "layer_convention": "id k is the output of decoder layer k (HF hidden_states[k + 1])",
        **measures.result(),
    }
    return emit(result, json_path)


def _head_summary(v: dict) -> dict:
    kl = torch.cat(v["kl"])
    return {
        "same_top1": round(torch.cat(v["same_top1"]).mean().item(), 5),
        "kl_mean": round(kl.mean().item(), 6),
        "kl_p99": round(kl.quantile(0.99).item(), 6),
        "kl_max": round(kl.max().item(), 6),
    }


def _worst_and_median(c: torch.Tensor) -> dict:
    return {"worst": round(c.min().item(), 6), "median": round(c.median().item(), 6)}


TOKEN_BYTES = 6  # input_ids (int32), loss_mask and image_mask (uint8) a token
FRAMED = ("values", "block_scales")  # what --compress zstd frames (store/schema.py Encoding.compressed)


def _mixes(sizes: _Bytes, tokens: int, k: int, hidden: int) -> dict:
    """Bytes a token of each aux / final encoding pair, raw and with zstd on what it frames, over bf16's."""

    def of(where: str, name: str, zstd: bool) -> int:
        return sum(
            (sizes.zstd if zstd and kind in FRAMED else sizes.raw)[(w, n, kind)]
            for (w, n, kind) in sizes.raw
            if (w, n) == (where, name)
        )

    bf16 = 2 * (k + 1) * hidden + TOKEN_BYTES
    pairs = (
        [("bf16", "bf16")]
        + [(name, name) for name in ENCODINGS]
        + [
            ("nvfp4", "fp8"),
            ("mxfp4", "fp8"),
            ("nvfp4", "bf16"),
        ]
    )
    out = {}
    for aux, final in pairs:
        row = {}
        for zstd in (False, True):
            total = (of("aux", aux, zstd) + of("final", final, zstd)) / tokens + TOKEN_BYTES
            row["zstd" if zstd else "raw"] = round(total, 1)
            row["zstd_of_bf16" if zstd else "of_bf16"] = round(total / bf16, 4)
        block_raw = sum(v for (w, n, kind), v in sizes.raw.items() if kind == "block_scales" and n == aux)
        block_zstd = sum(v for (w, n, kind), v in sizes.zstd.items() if kind == "block_scales" and n == aux)
        if block_raw:
            row["block_scales_zstd_ratio"] = round(block_raw / block_zstd, 3)
        out[f"aux {aux}, final {final}"] = row
    return out


if __name__ == "__main__":
    main()
