#!/usr/bin/env python
"""Peer: SGLang's own hidden-state path, `sglang.Engine(enable_return_hidden_states=True)` in-process.

What a user tries first: one generate call per batch with `return_hidden_states=True`. What it returns
(SGLang 0.5.17, read from its source; the first two points are tested on CPU by tests/unit/benchmarks/test_peers.py, the
radix-cache and max_new_tokens=0 points were tried by hand on CPU on 2026-11-30, the aux-layer point is
from the source alone):
- per prompt token, one state: `meta_info["hidden_states"][0]` is a [T][H] nested Python list (the
  scheduler calls `.tolist()` on it and pickles it to the tokenizer process, which is where the time goes);
- the state the logits processor receives, i.e. the final state AFTER the model's final norm on Llama
  (models that hand SGLang a pre-norm state, e.g. DeepSeek-V4 and Step-3.5, return that one instead);
- no EAGLE-3 aux layers: SGLang only captures them when it runs EAGLE-3 speculative decoding with a draft
  model, and then the returned state is the concatenated aux layers instead of the final one;
- `max_new_tokens=0` returns no states at all, so each request generates one token (one extra sampling
  step, no decode forward);
- the radix cache is disabled: a prompt prefix found in the cache is not recomputed and its rows are
  missing from the returned states (every synthetic chat starts with the same header tokens).

It takes the benchmark's batches (`corpus.save_batches`), prefills them through the engine, converts each
sample's states to a bf16 tensor as a user would before saving them, and writes a JSON result; the first
`--dump-samples` timed samples' states go to a safetensors file for the cross-check against ours.

\b
    python -m benchmarks.peers.sglang_engine --model DIR --batches batches.npz --result r.json --dump s.safetensors
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click
import torch

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import command_line, program
from benchmarks.bench_options import SGLANG_ENGINE
from benchmarks.peers.accounting import TreePeakRss
from benchmarks.peers.corpus import load_batches

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    # A CPU run (the tests'): SGLang's scheduler process re-imports this module and needs the same setup.
    from offline_extract.engine.sglang_adapter import prepare_process

    prepare_process("cpu")

NAME = SGLANG_ENGINE


def returned_states(output: dict, num_tokens: int, sample: str) -> torch.Tensor:
    """The [T, H] prompt states of one generate() output, as bf16."""
    parts = output["meta_info"].get("hidden_states")
    if not parts:
        raise RuntimeError(f"{sample}: SGLang returned no hidden states (is enable_return_hidden_states set?)")
    # The prefill appends one [T][H] block (chunked prefill is off); a decode step would append rows.
    rows = parts[0]
    if len(parts) != 1 or len(rows) != num_tokens:
        raise RuntimeError(
            f"{sample}: expected one block of {num_tokens} prompt rows, got {len(parts)} parts with "
            f"{[len(p) for p in parts]} rows"
        )
    return torch.tensor(rows, dtype=torch.bfloat16)


def _engine(model: str, dtype: str, device: str, longest: int, max_length: int, **kwargs):
    """SGLang's engine as a user would start it for hidden states, with room for `longest` tokens a prefill."""
    import sglang

    return sglang.Engine(
        model_path=model,
        dtype=dtype,
        device=device,
        enable_return_hidden_states=True,
        skip_tokenizer_init=True,
        disable_radix_cache=True,
        chunked_prefill_size=-1,
        max_prefill_tokens=max(longest, max_length),
        # KV room for one of our batches: the scheduler packs prefills as ours are packed. SGLang 0.5.17
        # admits an input only under its context less 6 (the generated token and 5 more,
        # TpModelWorker.get_worker_info), so the longest sample needs that much room above it.
        max_total_tokens=max(longest, max_length) + 64,
        context_length=max_length + 6 + 1,
        # Graphs serve decode steps only, which a max_new_tokens=1 request never takes; its one sampled
        # token costs the same on any sampler, and PyTorch's runs on every device.
        disable_cuda_graph=True,
        sampling_backend="pytorch",
        log_level="error",
        **kwargs,
    )


def _prefilled(engine, batches: list, warmup: int, dump_samples: int) -> tuple[int, float, dict[str, torch.Tensor]]:
    """The timed batches' tokens and seconds, after the warm-up ones, and the first `dump_samples` timed samples'
    ids and returned states."""

    def prefill(batch, keep: dict | None) -> int:
        outs = engine.generate(
            input_ids=[s.tolist() for s in batch],
            sampling_params={"max_new_tokens": 1},
            return_hidden_states=True,
        )
        for ids, out in zip(batch, outs):
            states = returned_states(out, len(ids), f"sample of {len(ids)} tokens")
            if keep is not None and len(keep) < 2 * dump_samples:
                n = len(keep) // 2
                keep[f"{n}.input_ids"] = torch.from_numpy(ids.astype("int32"))
                keep[f"{n}.final"] = states
        return sum(len(s) for s in batch)

    for batch in batches[:warmup]:
        prefill(batch, None)
    keep: dict = {}
    start = time.perf_counter()
    tokens = sum(prefill(batch, keep) for batch in batches[warmup:])
    return tokens, time.perf_counter() - start, keep


def run(
    model: str,
    batches_path: Path,
    result: Path,
    dump: Path | None,
    dump_samples: int,
    dtype: str,
    device: str,
    attention_backend: str | None,
    mem_fraction_static: float | None,
    max_length: int,
    command: str,
) -> dict:
    if device == "cpu":
        from offline_extract.engine.sglang_adapter import prepare_process

        prepare_process("cpu")
    import sglang
    from safetensors.torch import save_file

    batches, warmup = load_batches(batches_path)
    largest = max(sum(len(s) for s in b) for b in batches)
    kwargs = {
        k: v for k, v in (("attention_backend", attention_backend), ("mem_fraction_static", mem_fraction_static)) if v
    }
    with TreePeakRss(os.getpid()) as rss:
        engine = _engine(model, dtype, device, largest, max_length, **kwargs)
        try:
            tokens, seconds, keep = _prefilled(engine, batches, warmup, dump_samples)
        finally:
            engine.shutdown()
    hidden = int(next(v for k, v in keep.items() if k.endswith(".final")).shape[1]) if keep else None
    if dump is not None:
        save_file(keep, str(dump))
    row = {
        "name": NAME,
        "version": sglang.__version__,
        "command": command,
        "tok_s": tokens / seconds,
        "num_tokens": tokens,
        "num_samples": sum(len(b) for b in batches[warmup:]),
        "wall_s": seconds,
        "host_peak_rss_bytes": rss.peak,
        # Nothing is written: the figure is what its returned state takes stored as ours are (bf16 state
        # plus an int32 id a token).
        "bytes_per_token": 2 * hidden + 4 if hidden else None,
        "stores": {"layers": ["final"], "norm": "post-norm (Llama)", "per_token": True},
        "dump": str(dump) if dump is not None else None,
    }
    result.write_text(json.dumps(row, indent=2) + "\n")
    return row


@program(__doc__)
@click.option("--model", required=True, help="HF model directory with weights.")
@click.option(
    "--batches",
    "batches_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Token batches written by benchmarks.peers.corpus.save_batches.",
)
@click.option("--result", required=True, type=click.Path(dir_okay=False, path_type=Path), help="JSON result to write.")
@click.option(
    "--dump",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="safetensors file for the first --dump-samples timed samples' ids and states.",
)
@click.option("--dump-samples", default=32, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--device", default="cuda", show_default=True, help="'cpu' with --attention-backend torch_native: tests.")
@click.option("--attention-backend", default=None, help="Default: SGLang's own choice (fa3 on Hopper).")
@click.option("--mem-fraction-static", default=None, type=float, help="Default: SGLang's own.")
@click.option("--max-length", default=8192, show_default=True, help="Longest sample in tokens.")
def main(
    model, batches_path, result, dump, dump_samples, dtype, device, attention_backend, mem_fraction_static, max_length
):
    command = command_line("python -m benchmarks.peers.sglang_engine")
    row = run(
        model,
        batches_path,
        result,
        dump,
        dump_samples,
        dtype,
        device,
        attention_backend,
        mem_fraction_static,
        max_length,
        command,
    )
    print(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
