#!/usr/bin/env python
"""Measure extraction tokens/s against bare SGLang prefill, on the same GPU, batches and process.

\b
    python bin/bench.py                                   # 8B-shaped dummy model, lognormal lengths, /dev/shm
    python bin/bench.py --out /dev/shm/x --out /tmp/x --baseline hf
    python bin/bench.py --model DIR --load-format auto --baseline sglang-engine --baseline specforge --baseline hf
    python bin/bench.py --lengths fixed --mean-length 2048
    python bin/bench.py --model DIR --load-format auto --data corpus.jsonl      # a real corpus, as extract.py reads it
    python bin/bench.py --shape qwen2_5_vl_7b --data image_chats.jsonl        # image chats (benchmarks/image_chats.py)
    python bin/bench.py --lengths fixed --mean-length 131072 --num-tokens 393216 --warmup-batches 1
    python bin/bench.py --store bf16 --store fp8 --compress none --compress zstd   # storage, one model load
    python bin/bench.py --cold --num-tokens 250000      # start-up as on a fresh machine, beside the warm rate
    torchrun --nproc-per-node 8 bin/bench.py              # DP=8: aggregate tokens/s

--data runs both modes on the batches bin/extract.py would make of that corpus (its reader, the model's
tokenizer or HF processor and chat template, its images decoded and prepared on --image-threads threads,
--max-length as extract.py's), image chats with their pixels in bare prefill too; the result's `data` records
the corpus files (bytes, sha256) and its records, samples, tokens and image tokens. It replaces the synthetic
corpus, so --lengths and --mean-length are refused beside it; --num-tokens then caps the tokens taken from the
corpus's start. The corpus is tokenized before anything is timed; the first --store/--out's extraction is then
timed once more fed as bin/extract.py is, its batches made from the records on a thread ahead of the forwards
(`extract_fed_tok_s`, `extract_fed_input_wait_s`: what reading, tokenizing and preparing images leave on the
GPU's path).

Samples longer than --tokens-per-batch are prefilled alone in chunks of --chunk-tokens, in both modes.
Every --out is measured in the same run (tmpfs and a disk path are both fine); the disk's own parallel
write rate is probed there first. Results (JSON, with this command) go to --results-dir, rewritten as each
part of the run (each peer, ours, each cross-check) finishes; their `parts` says which are done, so a run
cut short leaves what it measured.

--baseline adds what users would run instead, on the same GPU, model and batches (benchmarks/peers/):
`hf` (an HF transformers loop with output_hidden_states), `sglang-engine` (sglang.Engine with
return_hidden_states), `sglang-aux` (sglang.Engine's capture-only aux mode, enable_return_aux_hidden_states:
SGLang 0.5.23) and `specforge` (SpecForge 0.2.0's prepare_hidden_states.py on SGLang 0.5.14, from the peer
bundle). The SGLang-based peers load the model from its files, so they need --model DIR with weights and
--load-format auto. Each peer's row, with its per-layer cosine against our states for the
first --cross-check-samples samples, goes to the result's `peers` list.
"""

import _bin_path  # noqa: F401  (must come first: see its docstring)
import offline_extract.commands  # noqa: F401  (before the heavy imports: Ctrl-C during them exits 130)
import os
import sys

import click

from benchmarks.bench_options import BASELINES, LOGNORMAL_CAP, SYNTHETIC_TOKENS, BenchOptions, PeerOptions
from offline_extract.cli import command
from offline_extract.commands.extract import extract_option
from offline_extract.lifecycle import startup_gc
from offline_extract.options import choices, default


def _command() -> str:
    argv = " ".join(["bin/bench.py", *sys.argv[1:]])
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
        return f"torchrun --nnodes {nodes} --nproc-per-node {os.environ['LOCAL_WORLD_SIZE']} {argv}"
    return f"python {argv}"


def _refuse_synthetic_options_beside_data(data: tuple[str, ...]) -> None:
    ctx = click.get_current_context()
    given = [
        f"--{name.replace('_', '-')}"
        for name in ("lengths", "mean_length")
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    ]
    if data and given:
        shape = "shape" if len(given) > 1 else "shapes"
        raise click.UsageError(
            f"{' and '.join(given)} {shape} the synthetic corpus, which --data replaces: give one "
            f"or the other (--num-tokens caps the tokens taken from --data)"
        )


@command(help=__doc__)
@click.option("--model", default=None, help="HF model directory. Default: a generated config of --shape.")
@click.option(
    "--shape",
    default=BenchOptions.shape,
    show_default=True,
    help="Generated model shape (see offline_extract.testing.models: ARCHITECTURES, VISION_LANGUAGE, VISION_LANGUAGE_SHAPES).",
)
@click.option(
    "--load-format",
    default=BenchOptions.load_format,
    show_default=True,
    help="'dummy': random weights, no files needed.",
)
@click.option(
    "--dtype",
    type=click.Choice(choices("dtype")),
    default=BenchOptions.dtype,
    show_default=True,
    help="Compute dtype (as extract.py --dtype).",
)
@click.option(
    "--tp",
    default=BenchOptions.tp,
    show_default=True,
    help="Tensor-parallel size; under torchrun the rest is data-parallel.",
)
@click.option("--attention-backend", default=None, help="Default: fa3 on Hopper when installed, else triton.")
@click.option(
    "--out",
    "outs",
    multiple=True,
    default=BenchOptions.outs,
    show_default=True,
    help="Where extraction writes shards; repeat to measure several targets in one run.",
)
@click.option(
    "--data",
    "data",
    multiple=True,
    help="A corpus as bin/extract.py --data takes it (JSONL, JSON array, parquet, a datasets folder, a hub "
    "id; repeatable), in place of the synthetic corpus; see above.",
)
@click.option(
    "--lengths",
    type=click.Choice(["lognormal", "fixed"]),
    default=BenchOptions.lengths,
    show_default=True,
    help="Sample lengths of the synthetic corpus: log-normal of mean --mean-length, capped at --max-length, "
    "or all exactly --mean-length. Not with --data.",
)
@click.option(
    "--mean-length",
    default=BenchOptions.mean_length,
    show_default=True,
    help="Mean (lognormal) or exact (fixed) tokens a sample. Not with --data.",
)
@click.option(
    "--max-length",
    type=int,
    default=None,
    help=f"Cap of the lognormal lengths (default {LOGNORMAL_CAP}); with --data, extract.py's --max-length "
    f"(default {default('max_length')}).",
)
@click.option(
    "--num-tokens",
    type=int,
    default=None,
    help=f"Synthetic corpus size in tokens (default {SYNTHETIC_TOKENS:,}); with --data, the most tokens "
    "taken from its start, split among data-parallel replicas (default: all of it).",
)
@click.option(
    "--tokens-per-batch",
    type=int,
    default=BenchOptions.tokens_per_batch,
    help="Token budget of one forward (as extract.py --tokens-per-batch; default: extract.py's for the model).",
)
@click.option(
    "--chunk-tokens",
    default=None,
    type=int,
    help="Tokens a forward for samples longer than --tokens-per-batch (chunked prefill). Default: --tokens-per-batch.",
)
@click.option(
    "--chunk-sweep",
    default="",
    help="Comma-separated chunk sizes: also time bare chunked prefill of the "
    "first timed batch at each (`bare_tok_s_by_chunk`), to choose --chunk-tokens.",
)
@click.option(
    "--warmup-batches",
    default=BenchOptions.warmup_batches,
    show_default=True,
    help="Batches run first, each timed on its own: the cold start (`cold_batch_s`, `cold_tok_s`, beside "
    "the command-to-first-forward `startup_to_first_forward_s`), then untimed before each mode.",
)
@click.option(
    "--cold",
    is_flag=True,
    help="Compile into an empty JIT cache (a temporary folder, removed after), as a fresh machine or "
    "container does, whatever the environment's caches hold.",
)
@click.option(
    "--jit-cache",
    default=None,
    help="Where compiled kernels are kept between runs (as extract.py --jit-cache). "
    "Default: $XDG_CACHE_HOME/offline_extract.",
)
@click.option(
    "--baseline",
    "baselines",
    multiple=True,
    type=click.Choice(BASELINES),
    help="Also run this peer (repeatable); see above.",
)
@click.option("--baseline-hf", is_flag=True, help="The same as --baseline hf (kept for earlier results' commands).")
@click.option(
    "--cross-check-samples",
    default=PeerOptions.cross_check_samples,
    show_default=True,
    help="Samples whose states each peer's are compared with ours.",
)
@click.option(
    "--peer-workdir",
    default=PeerOptions.workdir,
    show_default=True,
    help="Peers' inputs, outputs and logs (SpecForge writes its states here).",
)
@click.option(
    "--peer-site",
    default=PeerOptions.peer_site,
    show_default=True,
    help="SGLang 0.5.14 + SpecForge 0.2.0, installed by the peer bundle (benchmarks/peers/make_peer_bundle.sh).",
)
@click.option(
    "--specforge-attention-backend",
    default=PeerOptions.specforge_attention_backend,
    show_default=True,
    help="SpecForge's --sglang-attention-backend (its own default is flashinfer).",
)
@click.option(
    "--disk-probe-gb",
    default=BenchOptions.disk_probe_bytes / (1 << 30),
    show_default=True,
    help="GiB written to each --out to measure its write rate.",
)
@extract_option("writers")
@extract_option("image_threads")
@click.option(
    "--store",
    "stores",
    multiple=True,
    type=click.Choice(choices("store")),
    default=["bf16"],
    show_default=True,
    help="How states are stored (as extract.py --store); repeat to measure several with one model load. "
    "fp8 also records the per-token cosine of the decoded states against the bf16 ones of the same "
    "forward passes, worst and median per layer.",
)
@click.option(
    "--compress",
    "compressions",
    multiple=True,
    type=click.Choice(choices("compress")),
    default=["none"],
    show_default=True,
    help="As extract.py --compress; repeat for several (every --store is measured with "
    "every --compress). Results record the compression ratio and bytes written per "
    "second.",
)
@click.option(
    "--results-dir",
    default=BenchOptions.results_dir,
    show_default=True,
    help="Where the result JSONs go (a relative path: from the current directory).",
)
@click.option(
    "--profile",
    default=None,
    help="Write torch-profiler tables and traces of bare prefill and of "
    "extraction of the first --profile-batches timed batches to this directory.",
)
@click.option(
    "--profile-batches",
    default=BenchOptions.profile_batches,
    show_default=True,
    help="Timed batches that --profile records.",
)
@click.option(
    "--single-gpu-result",
    "single_gpu_results",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="A one-GPU result JSON from the same session: adds `scaling` (aggregate / one GPU) to the "
    "results of the same out kind (tmpfs, disk); repeat for each kind.",
)
@click.option(
    "--host-threads",
    default="",
    help="Comma-separated counts: also time the first --store/--out's "
    "extraction with torch's intra-op threads (the copies into shard buffers) at each "
    "(`extract_tok_s_by_host_threads`).",
)
def main(
    model,
    shape,
    load_format,
    dtype,
    tp,
    attention_backend,
    outs,
    data,
    lengths,
    mean_length,
    max_length,
    num_tokens,
    tokens_per_batch,
    chunk_tokens,
    chunk_sweep,
    warmup_batches,
    cold,
    jit_cache,
    baselines,
    baseline_hf,
    cross_check_samples,
    peer_workdir,
    peer_site,
    specforge_attention_backend,
    disk_probe_gb,
    writers,
    image_threads,
    stores,
    compressions,
    results_dir,
    profile,
    profile_batches,
    single_gpu_results,
    host_threads,
):
    _refuse_synthetic_options_beside_data(data)
    peer_options = PeerOptions(
        workdir=peer_workdir,
        cross_check_samples=cross_check_samples,
        peer_site=peer_site,
        specforge_attention_backend=specforge_attention_backend,
    )
    options = BenchOptions(
        model=model,
        shape=shape,
        load_format=load_format,
        dtype=dtype,
        tp=tp,
        attention_backend=attention_backend,
        outs=tuple(outs),
        data=tuple(data),
        lengths=lengths,
        mean_length=mean_length,
        max_length=max_length,
        num_tokens=num_tokens,
        tokens_per_batch=tokens_per_batch,
        chunk_tokens=chunk_tokens,
        chunk_sweep=tuple(int(c) for c in chunk_sweep.split(",") if c),
        warmup_batches=warmup_batches,
        cold=cold,
        jit_cache=jit_cache,
        baselines=tuple(dict.fromkeys((*baselines, *(["hf"] if baseline_hf else [])))),
        peer_options=peer_options,
        disk_probe_bytes=int(disk_probe_gb * (1 << 30)),
        writers=writers,
        image_threads=image_threads,
        encodings=tuple((store, compress) for store in stores for compress in compressions),
        results_dir=results_dir,
        profile=profile,
        profile_batches=profile_batches,
        single_gpu_results=tuple(single_gpu_results),
        host_threads=tuple(int(n) for n in host_threads.split(",") if n),
        command=_command(),
    )
    # Started as bin/extract.py starts, so that the modes are timed over a heap frozen as a run's is (run_bench).
    with startup_gc.start_up():
        # Here, not at the top: torch and SGLang take seconds to import, which --help and --version need not wait for.
        from benchmarks.extraction_vs_prefill import run_bench

        try:
            run_bench(options)
        except ValueError as e:  # an option or the machine cannot give a measurement; the message says which
            raise click.ClickException(str(e)) from e


if __name__ == "__main__":
    main()
