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
- no EAGLE-3 aux layers: SGLang 0.5.17 only captures them when it runs EAGLE-3 speculative decoding with a
  draft model, and then the returned state is the concatenated aux layers instead of the final one (0.5.23
  also in its capture-only mode, below);
- `max_new_tokens=0` returns no states at all, so each request generates one token (one extra sampling
  step, no decode forward);
- the radix cache is disabled: a prompt prefix found in the cache is not recomputed and its rows are
  missing from the returned states (every synthetic chat starts with the same header tokens).

With `--aux-layers` it is the sglang-aux peer: SGLang 0.5.23's capture-only mode
(`enable_return_aux_hidden_states`, no draft model), whose `meta_info["hidden_states"][0]` is instead a
[T][k*H] list, the k aux layers side by side in ascending order, and no final state (read from 0.5.23's
logits_processor.py `_get_hidden_states_to_store`, tested on CPU by test_peers.py). Its layer ids go through
the model file's set_eagle3_layers_to_capture, which on Llama adds one to each: our ids are handed over as
engine/families.py's capture rule of the architecture turns them, so layer id k is HF hidden_states[k+1]
here too. An SGLang without the mode (0.5.17) is refused before it starts.

It takes the benchmark's batches (`corpus.save_batches`), prefills them through the engine, converts each
sample's states to a tensor of the run's dtype as a user would before saving them, and writes a JSON result;
the first `--dump-samples` timed samples' states go to a safetensors file for the cross-check against ours.

\b
    python -m benchmarks.peers.sglang_engine --model DIR --batches batches.npz --result r.json --dump s.safetensors
    python -m benchmarks.peers.sglang_engine --aux-layers 1,15,28 --model DIR --batches b.npz --result r.json
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
from benchmarks.bench_options import SGLANG_AUX, SGLANG_ENGINE
from benchmarks.peers.accounting import TreePeakRss, split_layers
from benchmarks.peers.corpus import load_batches
from offline_extract.engine.sglang_releases import RELEASES, installed

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    # A CPU run (the tests'): SGLang's scheduler process re-imports this module and needs the same setup.
    from offline_extract.engine.sglang_adapter import prepare_process

    prepare_process("cpu")

NAME = SGLANG_ENGINE


def returned_states(output: dict, num_tokens: int, sample: str, dtype: torch.dtype) -> torch.Tensor:
    """The [T, W] prompt states of one generate() output (W: the final state's width, or the aux layers')."""
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
    return torch.tensor(rows, dtype=dtype)


def aux_mode(model: str, layer_ids: tuple[int, ...]) -> dict:
    """The server arguments of SGLang's capture-only aux mode for our `layer_ids`, where the installed SGLang
    has it."""
    release = installed()
    if not release.serves_aux_layers:
        having = " and ".join(r.version for r in RELEASES.values() if r.serves_aux_layers)
        raise RuntimeError(
            f"{SGLANG_AUX} runs SGLang's capture-only aux mode (--enable-return-aux-hidden-states), which SGLang "
            f"{release.version} lacks; run the bench where SGLang {having} is installed"
        )
    from offline_extract.engine.sglang_adapter import capture_rule

    architecture = json.loads((Path(model) / "config.json").read_text())["architectures"][0]
    return dict(
        enable_return_aux_hidden_states=True,
        # Only names the capture convention: SGLang resets it, so no draft is loaded and nothing is speculated.
        speculative_algorithm="EAGLE3",
        return_aux_hidden_state_layer_ids=capture_rule(architecture, model).ids_for_points([k + 1 for k in layer_ids]),
    )


def _engine(model: str, dtype: str, device: str, longest: int, max_length: int, **kwargs):
    """SGLang's engine as a user would start it for hidden states, with room for `longest` tokens a prefill;
    `kwargs` are its further server arguments (the hidden-state mode, the attention backend, the memory)."""
    import sglang

    return sglang.Engine(
        model_path=model,
        dtype=dtype,
        device=device,
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


def _prefilled(
    engine, batches: list, warmup: int, dump_samples: int, dtype: torch.dtype, keys: list[str]
) -> tuple[int, float, dict[str, torch.Tensor]]:
    """The timed batches' tokens and seconds, after the warm-up ones, and the first `dump_samples` timed samples'
    ids and returned states, keyed `{sample}.input_ids` and `{sample}.{key}`, the returned width split into
    `keys` in order."""

    def prefill(batch, keep: dict | None) -> int:
        outs = engine.generate(
            input_ids=[s.tolist() for s in batch],
            sampling_params={"max_new_tokens": 1},
            return_hidden_states=True,
        )
        for ids, out in zip(batch, outs):
            states = returned_states(out, len(ids), f"sample of {len(ids)} tokens", dtype)
            n = None if keep is None else sum(key.endswith(".input_ids") for key in keep)
            if n is not None and n < dump_samples:
                keep[f"{n}.input_ids"] = torch.from_numpy(ids.astype("int32"))
                # Copies: safetensors refuses tensors that share their storage.
                keep.update({f"{n}.{key}": state.clone() for key, state in split_layers(states, None, keys).items()})
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
    aux_layers: tuple[int, ...] = (),
) -> dict:
    """Prefill the batches through sglang.Engine, its final state returned, or with `aux_layers` (our layer ids)
    those aux layers instead (the sglang-aux peer); write the result row and the dumped states."""
    # Refused before anything starts: an SGLang without the mode would only fail on an unknown argument.
    mode = aux_mode(model, aux_layers) if aux_layers else {"enable_return_hidden_states": True}
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
    keys = [str(k) for k in aux_layers] or ["final"]
    with TreePeakRss(os.getpid()) as rss:
        engine = _engine(model, dtype, device, largest, max_length, **mode, **kwargs)
        try:
            tokens, seconds, keep = _prefilled(engine, batches, warmup, dump_samples, getattr(torch, dtype), keys)
        finally:
            engine.shutdown()
    width = sum(int(keep[f"0.{key}"].shape[1]) for key in keys) if keep else None
    if dump is not None:
        save_file(keep, str(dump))
    row = {
        "name": SGLANG_AUX if aux_layers else NAME,
        "version": sglang.__version__,
        "command": command,
        "tok_s": tokens / seconds,
        "num_tokens": tokens,
        "num_samples": sum(len(b) for b in batches[warmup:]),
        "wall_s": seconds,
        "host_peak_rss_bytes": rss.peak,
        # Nothing is written: the figure is what its returned states take stored as ours are (bf16 states
        # plus an int32 id a token).
        "bytes_per_token": 2 * width + 4 if width else None,
        "stores": {"layers": keys, "norm": None if aux_layers else "post-norm (Llama)", "per_token": True},
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
@click.option(
    "--aux-layers",
    default=None,
    help="Comma-separated layer ids (ours: id k = HF hidden_states[k+1]): run the sglang-aux peer, SGLang's "
    "capture-only aux mode (0.5.23), returning these layers instead of the final state.",
)
def main(aux_layers, **options):
    command = command_line("python -m benchmarks.peers.sglang_engine")
    row = run(**options, command=command, aux_layers=tuple(int(k) for k in aux_layers.split(",")) if aux_layers else ())
    print(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
