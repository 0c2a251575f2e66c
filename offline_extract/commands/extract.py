"""Extract EAGLE-3 training hidden states from a model with SGLang, into safetensors shards.

\b
One GPU, or the embedded tiny model on CPU:
    python bin/extract.py --data corpus.jsonl
A node (data parallel, tensor parallel, or both; any number of nodes with --nnodes):
    torchrun --nproc-per-node 8 bin/extract.py --model /models/Llama-3.1-8B-Instruct --data corpus.jsonl --out /data/hs
    torchrun --nproc-per-node 8 bin/extract.py --model /models/big --tp 4 --data corpus.jsonl --out /data/hs

\b
Input: JSONL (plain or gzip), a .json file of one JSON array, parquet, a datasets.save_to_disk folder
or a hub data set; records (lines, array elements or rows) of any mix of
    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}   (ShareGPT)
    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]} (OpenAI)
    {"text": ...}                                     (plain text, every token in the loss)
    {"input_ids": [...], "loss_mask": [...]}          (pre-tokenized; loss_mask optional)
with an optional "id". OpenAI content may be a list of {"type": "text", "text": ...} parts (joined
with newlines). Chats are rendered with the model's own chat template; the loss mask covers assistant
tokens only. Bad records go to OUT/rejects.jsonl with source, line (element, row) and reason; the run goes
on (--strict: it stops at the first).

\b
Output: OUT/shard_NNN.safetensors holding input_ids, loss_mask, aux_hidden_states [T, k*H],
hidden_states [T, H] (the final state, after the final norm unless --final-state pre-norm), offsets
and sample_index; OUT/index.json lists them, OUT/manifest.json records the run's identity and every
shard's checksum.
Layer id k is the output of decoder layer k, i.e. HF output_hidden_states[k+1].

\b
Re-running the same command into the same --out resumes: samples in complete shards are kept, the rest
are extracted (on any number of GPUs). A run that stopped (crash, full disk) loses at most the shards
it was writing.
"""
import os
import signal
import sys
from pathlib import Path

import click

from offline_extract.cli import TERMINATED, Interrupted, command
from offline_extract.options import DEFAULT_PORT_BASE, DEFAULT_TOKENS_PER_BATCH, choices, default


def _chosen(option: str) -> dict:
    """click.option's type, default and show_default for an ExtractOptions field of fixed choices."""
    return {"type": click.Choice(choices(option)), "default": default(option), "show_default": True}


@command(help=__doc__)
@click.option("--data", "data", multiple=True, required=True,
              help="Corpus: a .jsonl or .jsonl.gz file (JSONL also through a pipe, read once: not with --strict "
                   "or torchrun), a .json file of one JSON array (read whole into memory: convert a large one to "
                   "JSONL), a .parquet file, a datasets.save_to_disk folder, or a hub "
                   "data set id (org/name, or org/name:split; the local hub cache first, HF_HUB_OFFLINE honoured). "
                   "Repeat for several (records are numbered across them in order).")
@click.option("--out", default=default("out"), show_default=True, type=click.Path(file_okay=False),
              help="Output directory for shards, index.json, manifest.json and rejects.jsonl.")
@click.option("--model", default=None,
              help="HF model directory, or a hub id (org/name) taken from the local hub cache, else downloaded "
                   "unless HF_HUB_OFFLINE is set; the commit it resolved to is recorded. Default: the embedded tiny "
                   "random Llama, built once into $XDG_CACHE_HOME/offline_extract (~/.cache/offline_extract), run "
                   "on CPU.")
@click.option("--device", type=click.Choice(choices("device")), default=None,
              help="Default: cpu for the embedded tiny model (no --model), also on a GPU machine; otherwise cuda when a "
                   "GPU is visible, else cpu. A cpu run hides the GPUs from its own process (SGLang chooses its kernels "
                   "from whether torch sees a GPU).")
@click.option("--dtype", **_chosen("dtype"),
              help="Compute dtype (auto = the checkpoint's; float32 on CPU only, SGLang's CUDA kernels take half "
                   "precision). How the states are stored is --store's.")
@click.option("--tp", default=default("tp"), show_default=True, help="Tensor-parallel size; world size / tp replicas run data-parallel.")
@click.option("--layers", default=None,
              help="Comma-separated layer ids stored as aux_hidden_states (id k = output of decoder layer k). "
                   "Default: the --recipe's: SGLang's EAGLE-3 default for the model under eagle3, e.g. "
                   "[1, N/2-1, N-4] for Llama; 5 layers spread over 1..N-3 under dflash and dspark.")
@click.option("--max-length", default=default("max_length"), show_default=True,
              help="Longest sample in tokens, at most the model's context length; a longer one is cut or skipped (--overlong).")
@click.option("--overlong", **_chosen("overlong"),
              help="What to do with a sample longer than --max-length (recorded per sample either way). A "
                   "truncated sample whose loss tokens all lay past the cut is skipped, listed in rejects.jsonl "
                   "and counted as skipped: it has nothing left to train on.")
@click.option("--tokens-per-batch", default=None, type=int,
              help=f"Token budget of one forward. Default: {DEFAULT_TOKENS_PER_BATCH['cuda']} on GPU, "
                   f"{DEFAULT_TOKENS_PER_BATCH['cpu']} on CPU. A longer sample is prefilled alone, in chunks of "
                   "--chunk-tokens.")
@click.option("--chunk-tokens", default=None, type=int,
              help="Tokens a forward when a sample longer than --tokens-per-batch is prefilled in chunks. "
                   "Default: --tokens-per-batch.")
@click.option("--seqs-per-batch", default=default("seqs_per_batch"), show_default=True, help="Most sequences in one forward.")
@click.option("--shard-size-mb", default=default("shard_bytes") / (1 << 20), show_default=True, type=click.FloatRange(0, min_open=True),
              help="Target hidden-state MiB per shard (a shard closes once it reaches this).")
@click.option("--writers", default=default("writers"), show_default=True, type=click.IntRange(1),
              help="Threads writing shards, one file each, side by side; host memory holds writers + 1 shard "
                   "buffers. Raise it when one writing rank produces states faster than that many files at once "
                   "can take (TP on many GPUs, a fast array) or zstd's compression, which these threads also run, "
                   "falls behind.")
@click.option("--attention-backend", default=None,
              help="SGLang attention backend. Default: fa3 on Hopper when installed, else triton; torch_native on CPU.")
@click.option("--load-format", default=default("load_format"), show_default=True,
              help="SGLang load format; 'dummy' gives random weights (benchmarks only; refused with --verify, whose HF "
                   "reference reads the real ones).")
@click.option("--mem-fraction-static", default=default("mem_fraction_static"), show_default=True,
              help="GPU memory fraction for weights plus the (prefill-sized) KV pool.")
@click.option("--port-base", default=None, type=int,
              help="Each data-parallel replica's SGLang rendezvous uses port-base + dp_rank. "
                   f"Default: a free port alone, {DEFAULT_PORT_BASE} under torchrun.")
@click.option("--verify", "parity_samples", default=default("parity_samples"), show_default=True,
              help="Before extracting, compare each replica's first N samples against HF transformers and stop "
                   "on mismatch. HF loads the whole model on the GPU of each replica's tp_rank 0, so for a model "
                   "that needs TP, verify a smaller sibling of the same architecture. 0: no gate.")
@click.option("--trim-after-last-loss-token", is_flag=True,
              help="Drop each sample's tokens after its last loss token (they carry no training signal).")
@click.option("--dry-run", is_flag=True,
              help="Tokenize the corpus, print samples, tokens, the first rejected records (line and reason), bytes "
                   "per output tensor and free space at --out, and stop; exits non-zero if the output would not fit "
                   "(unless --force), --out cannot be written, or another extraction is running into --out (it names "
                   "it, as the run would). It writes nothing into --out.")
@click.option("--strict", is_flag=True,
              help="Stop at the first bad record in corpus order (named by source and line) instead of listing it in "
                   "rejects.jsonl. Every record is read and tokenized first (each replica its share), so the run stops "
                   "before the model loads and writes nothing.")
@click.option("--nonfinite", **_chosen("nonfinite"),
              help="A sample whose hidden states hold NaN or Inf: stop the run, drop it (listed in rejects.jsonl "
                   "as dropped), or keep it with a warning.")
@click.option("--final-state", **_chosen("final_state"),
              help="Which final state to store as hidden_states: after the model's final norm (SGLang's EAGLE-3 and "
                   "SpecForge train on it) or before it (vLLM and speculators store this one and apply the "
                   "verifier's norm while training). A drafter trained on the other one is silently wrong.")
@click.option("--recipe", **_chosen("recipe"),
              help="Which drafter the states are for (SpecForge's data preparation). eagle3: SGLang's EAGLE-3 "
                   "layers plus the final state. dflash (also Domino): 5 layers spread evenly over 1..N-3, no final "
                   "state, and only samples with consecutive loss tokens. dspark: the dflash layers and rule plus "
                   "the final state. --layers overrides the layers; the recipe is recorded in the manifest.")
@click.option("--min-loss-run", default=None, type=click.IntRange(0),
              help="Skip samples without this many consecutive loss tokens (listed in rejects.jsonl as skipped). "
                   "Default: the recipe's (dflash, dspark: 2; eagle3: no rule).")
@click.option("--store", **_chosen("store"),
              help="How states are stored. fp8: float8 e4m3 with one float32 scale per token per layer "
                   "(absmax/448), quantized on the GPU before the copy to host: about half the bytes. Readers, "
                   "export and inspect decode to bf16.")
@click.option("--compress", **_chosen("compress"),
              help="zstd: lossless, one frame per sample per state tensor with its bytes grouped by significance; "
                   "compressed by the writer threads. Saves most on bf16 states; costs CPU while writing.")
@click.option("--force", is_flag=True,
              help="Go ahead even if a check says no: --dry-run's free space, or resuming into an --out whose "
                   "manifest records another corpus (right when records were only appended). An --out holding "
                   "shards of another model, tokenizer, layers, compute dtype or length policy is refused even so, "
                   "before anything is written: mixed, its shards would not be one data set.")
@click.option("--trust-remote-code", is_flag=True, help="Allow model code from the model directory.")
@click.option("--jit-cache", default=None, type=click.Path(file_okay=False),
              help="Where the kernels SGLang compiles on first use (Triton, nvcc-built modules, Inductor, "
                   "FlashInfer, DeepGEMM) are kept between runs; a cold cache costs the first run tens of seconds. "
                   "Keep it on storage that outlives the machine or container. Variables such as TRITON_CACHE_DIR "
                   "that are already set win. Default: $XDG_CACHE_HOME/offline_extract (~/.cache/offline_extract).")
@click.option("--no-warm-up", is_flag=True,
              help="Skip the throwaway batch that compiles those kernels right after the model loads (then the "
                   "first real batch compiles them; start-up and tail are printed and kept in manifest.json either way).")
@click.option("--no-progress", is_flag=True,
              help="No progress bar (e.g. for logs): a line every --progress-every seconds instead. The bar or lines "
                   "also follow --dry-run's and --strict's pass through the corpus.")
@click.option("--progress-every", default=default("progress_every"), show_default=True, type=click.FloatRange(min=0),
              help="With --no-progress, seconds between progress lines (samples, tokens, tok/s, bytes written, ETA); "
                   "0: none.")
@click.option("--verbose", is_flag=True,
              help="Also show what SGLang, torch and HF print while loading (warnings, log lines, loading bars); "
                   "without it they are shown only if loading fails.")
def main(data, out, model, device, dtype, tp, layers, max_length, overlong, tokens_per_batch, chunk_tokens, seqs_per_batch,
         shard_size_mb, writers, attention_backend, load_format, mem_fraction_static, port_base, parity_samples,
         trim_after_last_loss_token, dry_run, strict, nonfinite, final_state, recipe, min_loss_run, store, compress,
         force, trust_remote_code, jit_cache, no_warm_up, no_progress, progress_every, verbose):
    # Here, not at the top: torch and transformers take seconds to import, which --help, --version and a
    # mistyped option need not wait for.
    from offline_extract.timeline import mark_process

    # torch first, and timed: SGLang cannot run without it, so its import is SGLang's share of the start-up
    # (Job.timings), not ours.
    mark_process("importing torch")
    import torch  # noqa: F401
    mark_process("torch imported")
    from offline_extract import extraction, planning
    from offline_extract.engine.distributed import LeaderFailed, PeerLost, ReportedByLeader
    from offline_extract.engine.parity import ParityError
    from offline_extract.extraction import StoppedError, Terminated, raise_terminated
    from offline_extract.options import ExtractOptions
    from offline_extract.store.schema import REJECTS_FILE
    from offline_extract.summary import no_sample_verdict

    try:
        layer_ids = None if layers is None else tuple(int(x) for x in layers.split(",")) if layers.strip() else ()
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {layers!r}", param_hint="--layers") from None
    opts = ExtractOptions(
        data=tuple(data), out=out, model=model, device=device, dtype=dtype, tp=tp, layers=layer_ids,
        max_length=max_length, overlong=overlong, tokens_per_batch=tokens_per_batch, chunk_tokens=chunk_tokens,
        seqs_per_batch=seqs_per_batch, shard_bytes=int(shard_size_mb * (1 << 20)), writers=writers, attention_backend=attention_backend,
        load_format=load_format, mem_fraction_static=mem_fraction_static, port_base=port_base, parity_samples=parity_samples,
        trim_after_last_loss=trim_after_last_loss_token, trust_remote_code=trust_remote_code,
        progress=not no_progress, progress_every=progress_every, verbose=verbose, strict=strict, nonfinite=nonfinite,
        final_state=final_state, recipe=recipe, min_loss_run=min_loss_run, store=store, compress=compress, force=force,
        jit_cache=jit_cache, warm_up=not no_warm_up,
    )
    # Torchrun stops every rank with SIGTERM once one fails, and schedulers preempt with it: stop as on an
    # error (the unfinished shard dropped, the lock released) instead of dying mid-write.
    signal.signal(signal.SIGTERM, raise_terminated)
    # What a stop leaves: a dry run writes nothing into --out, so it has nothing to resume.
    resumes = f"re-running the same command resumes into {out}"
    untouched = f"a dry run writes nothing, so {out} is as it was"
    try:
        if dry_run:
            plan = extraction.dry_run(opts)
        else:
            summary = extraction.run(opts)
    except (OSError, ValueError, NotImplementedError, ParityError, StoppedError, LeaderFailed, PeerLost) as e:
        # Bad input, a failed check or a full disk: the message names it; a traceback would only bury it.
        raise click.ClickException(str(e)) from e
    except ReportedByLeader:
        sys.exit(1)  # rank 0 printed why, once for the whole run
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted; {untouched if dry_run else resumes}") from None
    except Terminated:
        rank = f"rank {os.environ['RANK']}" if "RANK" in os.environ else "dry run" if dry_run else "extraction"
        click.echo(f"{rank}: stopped by SIGTERM (under torchrun: another rank failed, and torchrun's report names "
                   f"it); {untouched if dry_run else 'complete shards are kept and ' + resumes}", err=True)
        sys.exit(TERMINATED)
    if dry_run:
        click.echo(planning.render(plan, out))
        verdict = no_sample_verdict(data, plan.records, {"rejected": plan.rejected, "skipped": plan.skipped})
        if verdict:
            raise click.ClickException(verdict)
        if not plan.writable:
            raise click.ClickException(f"{out} cannot be written: its filesystem is read-only, or you lack permission")
        if plan.in_use:
            raise click.ClickException(plan.in_use)
        refusal = plan.refusal(out)
        if refusal and not force:
            raise click.ClickException(refusal)
    elif summary is not None:
        click.echo(summary.report(out), err=True)
        verdict = summary.no_sample_verdict(data)
        if verdict:
            # The manifest says complete (with these counts): re-running would only repeat this verdict.
            raise click.ClickException(f"{verdict}, see {Path(out) / REJECTS_FILE}" if summary.records else verdict)

