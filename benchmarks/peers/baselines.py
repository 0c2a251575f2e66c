"""`bin/bench.py --baseline NAME`: the peers' rows next to our extraction, on the same GPU, model and batches.

The peers that run in their own processes (sglang-engine, sglang-aux, specforge) go first, each with the whole GPU,
before our engine starts; they leave their states for the first `cross_check_samples` samples on disk.
After our run, our engine prefills exactly those token ids and every layer a peer stored is compared
with ours (`accounting.LayerTally`). The HF loop runs inside the bench process (`extraction_vs_prefill._hf_pass`);
its cross-check loads the same weights, so it needs a model directory with weights (`--model`).
"""

from __future__ import annotations

import importlib.metadata
import json
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from benchmarks.bench_options import BASELINES, OWN_PROCESS, REPO, SGLANG_AUX, PeerOptions

from . import sglang_engine, specforge
from .accounting import LayerTally, PeerRow, split_layers
from .corpus import save_batches


@dataclass
class Pending:
    """A peer that has run; its row is finished once our engine can cross-check its states."""

    row: PeerRow
    states: list[tuple[str, np.ndarray, dict[str, torch.Tensor]]]  # (sample, ids, layer key -> [T, H])


def check_names(names) -> tuple[str, ...]:
    unknown = sorted(set(names) - set(BASELINES))
    if unknown:
        raise ValueError(f"unknown baseline(s) {unknown}; choose from {list(BASELINES)}")
    return tuple(dict.fromkeys(names))


def run_subprocess_peers(
    names,
    popts: PeerOptions,
    *,
    model_dir: Path,
    tokenizer,
    batches: list[list[np.ndarray]],
    warmup: int,
    max_length: int,
    dtype: str,
    num_layers: int,
    load_format: str,
) -> Iterator[Pending]:
    """Run sglang-engine, sglang-aux and specforge (those of `names`) on our batches, before our engine takes the
    GPU; each peer is yielded as soon as it finishes, so that its row can be saved before the next part starts."""
    work = Path(popts.workdir)
    # The aux layers our engine captures by default on Llama (SGLang's EAGLE-3 ones), which SpecForge's are too.
    layers = tuple(specforge.capture_layers(num_layers))
    runs = {
        sglang_engine.NAME: lambda: _sglang_engine(popts, work, model_dir, batches, warmup, max_length, dtype),
        SGLANG_AUX: lambda: _sglang_engine(popts, work, model_dir, batches, warmup, max_length, dtype, layers),
        specforge.NAME: lambda: _specforge(
            popts, work, model_dir, tokenizer, batches, warmup, max_length, list(layers)
        ),
    }
    for name in (n for n in names if n in OWN_PROCESS):
        _needs_weights(name, load_format)
        work.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            pending = runs[name]()
        except Exception:  # one peer that breaks must not cost the others' rows (nor ours) on a GPU lease
            pending = Pending(PeerRow(name, "", "", None, None, None, None, error=traceback.format_exc()), [])
        # A GPU lease is short: say where its time goes while the run is still going.
        print(summary(pending.row, time.perf_counter() - start), file=sys.stderr, flush=True)
        yield pending


def summary(row: PeerRow, seconds: float) -> str:
    """The log line of a finished peer, readable alone: what its seconds include and what its tok/s counts."""
    took = f"{seconds:.0f} s from its launch to its exit (start-up, model load and warm-up included)"
    if row.error:
        return f"peer {row.name}: failed after {took}; error: {row.error.strip().splitlines()[-1]}"
    rate = "none" if row.tok_s is None else f"{row.tok_s:,.0f}"
    line = f"peer {row.name}: finished in {took}; tok/s {rate} = {row.notes['tok_s']}"
    if "end_to_end_tok_s" in row.notes:
        line += f"; {row.notes['end_to_end_tok_s']:,.0f} tok/s end to end, its start-up counted"
    return line + "; its states are cross-checked against ours at the end"


def _needs_weights(name: str, load_format: str) -> None:
    if load_format == "dummy":
        raise ValueError(
            f"--baseline {name} loads the model from its files: pass --model DIR with weights "
            f"and --load-format auto (the dummy loader draws other random weights in each process)"
        )


def _sglang_engine(popts, work, model_dir, batches, warmup, max_length, dtype, aux_layers=()) -> Pending:
    """sglang-engine, or with `aux_layers` sglang-aux, in its own process."""
    name = SGLANG_AUX if aux_layers else sglang_engine.NAME
    stem = name.replace("-", "_")
    batches_file, result, dump = work / "batches.npz", work / f"{stem}.json", work / f"{stem}_states.safetensors"
    save_batches(batches_file, batches, warmup)
    argv = [
        sys.executable,
        "-m",
        "benchmarks.peers.sglang_engine",
        "--model",
        str(model_dir),
        "--batches",
        str(batches_file),
        "--result",
        str(result),
        "--dump",
        str(dump),
        "--dump-samples",
        str(popts.cross_check_samples),
        "--dtype",
        dtype,
        "--max-length",
        str(max_length),
        "--device",
        popts.device,
    ]
    for flag, value in (
        ("--attention-backend", popts.sglang_attention_backend),
        ("--mem-fraction-static", popts.sglang_mem_fraction_static),
        ("--aux-layers", ",".join(map(str, aux_layers)) or None),
    ):
        if value is not None:
            argv += [flag, str(value)]
    launched = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    launch_to_exit_s = time.perf_counter() - launched
    cmd = shlex.join(["python", *argv[1:]])
    if proc.returncode != 0:
        return Pending(PeerRow(name, _version("sglang"), cmd, None, None, None, None, error=proc.stderr[-4000:]), [])
    tokens = sum(len(ids) for batch in batches for ids in batch)
    return Pending(
        _sglang_engine_row(json.loads(result.read_text()), cmd, tokens / launch_to_exit_s), dumped_states(dump, name)
    )


def _sglang_engine_row(r: dict, cmd: str, end_to_end_tok_s: float) -> PeerRow:
    """sglang-engine's or sglang-aux's row from the result its process wrote."""
    return PeerRow(
        name=r["name"],
        version=r["version"],
        command=cmd,
        tok_s=r["tok_s"],
        bytes_per_token=r["bytes_per_token"],
        host_peak_rss_bytes=r["host_peak_rss_bytes"],
        cosine_vs_ours=None,
        notes={
            "stores": r["stores"],
            "num_tokens": r["num_tokens"],
            "wall_s": r["wall_s"],
            "tok_s": f"prompt tokens a second over its {r['num_tokens']:,} timed tokens ({r['wall_s']:.0f} s), "
            "after its warm-up batches; start-up excluded",
            # As SpecForge's: every token it was given (warm-up batches too) over its launch-to-exit seconds.
            "end_to_end_tok_s": end_to_end_tok_s,
            "bytes_per_token": "nothing is written: its returned states stored as bf16, plus an int32 id",
        },
    )


def dumped_states(dump: Path, name: str = sglang_engine.NAME) -> list[tuple[str, np.ndarray, dict[str, torch.Tensor]]]:
    """The states sglang-engine or sglang-aux (`name`) dumped for the cross-check, with their ids: keys
    `{sample}.input_ids` and `{sample}.{layer}`."""
    from safetensors.torch import load_file

    samples: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(dump)).items():
        sample, layer = key.split(".", 1)
        samples.setdefault(int(sample), {})[layer] = tensor
    return [(f"{name} #{i}", s.pop("input_ids").numpy(), s) for i, s in sorted(samples.items())]


def _specforge(popts, work, model_dir, tokenizer, batches, warmup, max_length, layer_ids) -> Pending:
    sf = Path(popts.specforge_dir)
    script, draft = sf / "scripts" / "prepare_hidden_states.py", sf / specforge.DRAFT_CONFIG
    for path in (script, draft, Path(popts.peer_site)):
        if not path.exists():
            raise FileNotFoundError(
                f"{path} is missing: build and stage the peer bundle (benchmarks/peers/make_peer_bundle.sh)"
            )
    timed = [s for b in batches[warmup:] for s in b]  # its own first batch is its warm-up
    prepared = specforge.prepare(work / "specforge_in", timed, tokenizer, max_length)
    out = work / "specforge_out"
    # Its resume skips samples whose files exist, and its dataset caches are keyed by file path, not content
    # (one of them beside the script): a previous run's would stand in for this corpus.
    for stale in (out, work / "specforge_cache", sf / "cache"):
        shutil.rmtree(stale, ignore_errors=True)
    argv = specforge.command(
        script,
        model_dir,
        prepared.data,
        out,
        work / "specforge_cache",
        max_length=max_length,
        batch_size=popts.specforge_batch_size,
        attention_backend=popts.specforge_attention_backend,
        draft_config=draft,
    )
    ran = specforge.run(argv, Path(popts.peer_site), work / "specforge.log")
    source = (sf / "SOURCE").read_text().strip() if (sf / "SOURCE").exists() else "unknown"
    row = PeerRow(
        specforge.NAME,
        specforge.VERSION,
        shlex.join(argv),
        None,
        None,
        ran.host_peak_rss_bytes,
        None,
        notes={"source": source, "log": str(ran.log), "wall_s": ran.wall_s},
    )
    if ran.returncode != 0:
        row.error = f"exit {ran.returncode}: {ran.log.read_text()[-4000:]}"
        return Pending(row, [])
    return _specforge_measured(row, popts, specforge.read_output(out, prepared, popts.specforge_batch_size), layer_ids)


def _specforge_measured(row: PeerRow, popts, output, layer_ids) -> Pending:
    """SpecForge's row, filled from what its run wrote (`specforge.read_output`), with the states of its first
    --cross-check-samples samples for the cross-check."""
    row.notes.update(
        files=output.files,
        real_tokens=output.real_tokens,
        stored_tokens=output.stored_tokens,
        padding_share=1 - output.real_tokens / output.stored_tokens,
        unmatched_files=len(output.unmatched),
        end_to_end_tok_s=output.real_tokens / row.notes["wall_s"],
        tok_s="real (unpadded) tokens a second from the end of its first batch to its last file",
        stores={"layers": [*map(str, layer_ids), "final"], "norm": "post-norm (Llama)", "padded_rows": True},
    )
    row.tok_s = output.steady_tok_s
    row.bytes_per_token = output.bytes / output.real_tokens
    states = []
    for path, own in output.matched[: popts.cross_check_samples]:
        layers, ids = specforge.load_states(path, len(own), layer_ids)
        states.append((str(path), ids, layers))
    return Pending(row, states)


def cross_check(pending: Pending, ours) -> PeerRow:
    """Fill the row's cosine_vs_ours: `ours(ids)` returns our states for those token ids, keyed by layer."""
    tally = LayerTally()
    try:
        for sample, ids, theirs in pending.states:
            tally.add(sample, ours(ids), theirs)
    except Exception:
        pending.row.error = (pending.row.error or "") + "cross-check: " + traceback.format_exc()
    pending.row.cosine_vs_ours = tally.summary() or None
    return pending.row


def our_states(engine):
    """Our layers for one sequence, prefilled alone by our engine, on the host."""

    def states(ids: np.ndarray) -> dict[str, torch.Tensor]:
        captured = engine.capture([ids.astype(np.int64)])
        return split_layers(captured.aux.cpu(), captured.last.cpu(), engine.layer_ids)

    return states


def states_of(model, layer_ids, seqs: list[np.ndarray]) -> list[tuple[str, np.ndarray, dict[str, torch.Tensor]]]:
    """HF transformers' states for each sequence alone: hidden_states[k+1] for layer id k, and the last
    entry (after the final norm) as "final"."""
    out = []
    for i, ids in enumerate(seqs):
        with torch.no_grad():
            hs = model(
                input_ids=torch.from_numpy(ids.astype(np.int64))[None].to(model.device),
                output_hidden_states=True,
                use_cache=False,
            ).hidden_states
        out.append((f"hf #{i}", ids, {**{str(k): hs[k + 1][0].cpu() for k in layer_ids}, "final": hs[-1][0].cpu()}))
    return out


def hf_row(tok_s: float, command: str, states: list[tuple[str, np.ndarray, dict]] | None) -> Pending:
    return Pending(
        PeerRow(
            name="hf",
            version=_version("transformers"),
            command=command,
            tok_s=tok_s,
            bytes_per_token=None,
            host_peak_rss_bytes=None,
            cosine_vs_ours=None,
            notes={
                "tok_s": "tokens a second over the bench's timed batches, after its warm-up batches; "
                "model load excluded",
                "bytes_per_token": "writes nothing: copies the layers to host memory and drops them",
                "host_peak_rss_bytes": "runs inside the bench process, so its memory is not told apart from ours",
                "stores": {"layers": "output_hidden_states[k+1] and [-1]", "norm": "post-norm"},
            },
        ),
        states or [],
    )


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
