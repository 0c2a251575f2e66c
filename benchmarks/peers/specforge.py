"""Peer: SpecForge 0.2.0's offline generator, `scripts/prepare_hidden_states.py`, on its own SGLang 0.5.14.

The script is SpecForge's, unmodified, fetched by `make_peer_bundle.sh` into the git-ignored
`.peer-bundle/specforge/` (never committed); its Python dependencies come from the peer bundle's site
(`/tmp/peer-site`, layered over the 0.5.17 site). We only write its input, run it under torchrun as its
documentation does, and read what it wrote.

What it stores (read from its source at the commit recorded in `.peer-bundle/specforge/SOURCE`):
- one `torch.save` dict per sample, `OUT/rows_{k}-{k+2000}/data_{i}.ckpt`, i counting samples in the order
  it processes them (its dataset is shuffled with seed 42, so i is not the corpus line):
  `input_ids` [P], `loss_mask` [P], `aux_hidden_state` [1, P, 3H] and `hidden_state` [1, P, H];
- P is the padded length of the sample's batch: its collator right-pads every sample with zeros to the
  longest one of the batch, and its SGLang backend prefills the padded rows as tokens, so the states of
  the real tokens are right (causal attention) but the padding is computed and stored too;
- aux layers `[1, N/2-1, N-4]` handed to SGLang's `set_eagle3_layers_to_capture`, which captures the
  residual stream entering layer id+1: the output of decoder layer id, our convention;
- `hidden_state`: the input of SGLang's logits processor, i.e. after the final norm on Llama;
- its data loader drops the last incomplete batch (`drop_last=True`), and samples with a NaN are skipped.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_options import SPECFORGE

from .accounting import TreePeakRss
from .corpus import chat_records, write_jsonl

NAME = SPECFORGE
VERSION = "0.2.0"
# SpecForge's registered template whose system prompt is empty: with it the script renders each record with
# the tokenizer's own chat template and nothing added, so it prefills the tokens we do.
CHAT_TEMPLATE = "lfm"
# A Llama-3-8B EAGLE-3 draft config from SpecForge's repository; the script needs one for the draft
# vocabulary size even though the target layers it captures come from the target's depth.
DRAFT_CONFIG = "configs/llama3-8B-eagle3.json"
# Leading tokens that identify a sample in its output: no more than the shortest synthetic sample has, since
# the padding that follows a sample would change a longer key.
PROBE_LEN = 16


def capture_layers(num_layers: int) -> list[int]:
    """SpecForge's EAGLE-3 layers when its draft config names none (the config we pass names none)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


@dataclass(frozen=True)
class Prepared:
    data: Path
    expected: dict[tuple[int, ...], np.ndarray]  # leading ids -> the ids the script will tokenize the sample to


def prepare(workdir: Path, seqs: list[np.ndarray], tokenizer, max_length: int) -> Prepared:
    """Write the corpus as SpecForge reads it, and the token ids it will make of each record.

    The ids mirror its parser: the tokenizer's chat template rendered to text, tokenized without added
    special tokens and cut at --max-length.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    records = chat_records(seqs, tokenizer)
    data = workdir / "specforge_corpus.jsonl"
    write_jsonl(data, records)
    expected = {}
    for r in records:
        text = tokenizer.apply_chat_template(r["conversations"], tokenize=False, add_generation_prompt=False)
        ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"][:max_length])
        expected[tuple(ids[:PROBE_LEN].tolist())] = ids
    return Prepared(data=data, expected=expected)


def command(
    script: Path,
    model_dir: Path,
    data: Path,
    out: Path,
    cache: Path,
    *,
    max_length: int,
    batch_size: int,
    attention_backend: str,
    draft_config: Path,
) -> list[str]:
    """The documented launch (torchrun, one process a GPU), on one GPU."""
    return [
        "torchrun",
        "--standalone",
        "--nproc_per_node",
        "1",
        str(script),
        "--strategy",
        "eagle3",
        "--target-model-path",
        str(model_dir),
        "--draft-model-config",
        str(draft_config),
        "--data-path",
        str(data),
        "--output-path",
        str(out),
        "--cache-dir",
        str(cache),
        "--chat-template",
        CHAT_TEMPLATE,
        "--max-length",
        str(max_length),
        "--tp-size",
        "1",
        "--batch-size",
        str(batch_size),
        "--sglang-attention-backend",
        attention_backend,
    ]


@dataclass(frozen=True)
class Run:
    returncode: int
    wall_s: float
    host_peak_rss_bytes: int
    log: Path


def run(argv: list[str], peer_site: Path, log: Path) -> Run:
    """Run the script with the peer site ahead of the inherited path, sampling its process tree's memory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(peer_site), env.get("PYTHONPATH", "")) if p)
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT)
        with TreePeakRss(proc.pid) as rss:
            code = proc.wait()
    return Run(returncode=code, wall_s=time.perf_counter() - start, host_peak_rss_bytes=rss.peak, log=log)


@dataclass
class Output:
    files: int
    bytes: int
    real_tokens: int  # the samples' own tokens, without the padding
    stored_tokens: int  # rows written, padding included
    steady_tok_s: float | None  # real tokens/s between the first and the last batch's files
    matched: list[tuple[Path, np.ndarray]]  # (file, the sample's own ids) for files that match a record
    unmatched: list[str]  # files whose ids match no record (counted by their unpadded length)


def _unpadded_length(ids: np.ndarray) -> int:
    # The collator pads with id 0; the embedded tokenizer's id 0 is <|bos|>, which only opens a sample.
    nonzero = np.flatnonzero(ids)
    return int(nonzero[-1]) + 1 if len(nonzero) else len(ids)


def read_output(out: Path, prepared: Prepared, batch_size: int) -> Output:
    """Account for what the script wrote: sizes and mtimes from the file system, ids from each file."""
    files = sorted(out.glob("rows_*/data_*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise RuntimeError(f"SpecForge wrote no data_*.ckpt under {out}")
    real, matched, unmatched, stored = [], [], [], 0
    for path in files:
        ids = torch.load(path, map_location="cpu", weights_only=True)["input_ids"].numpy()
        stored += len(ids)
        own = prepared.expected.get(tuple(ids[:PROBE_LEN].tolist()))
        if own is not None and np.array_equal(ids[: len(own)], own):
            real.append(len(own))
            matched.append((path, own))
        else:
            real.append(_unpadded_length(ids))
            unmatched.append(str(path))
    mtimes = [p.stat().st_mtime for p in files]
    # Files are written by a thread pool as batches finish: time from the end of the first batch to the
    # last file, counting the tokens of everything after the first batch (its start-up is not throughput).
    later = real[batch_size:]
    span = mtimes[-1] - mtimes[batch_size - 1] if len(files) > batch_size else 0.0
    return Output(
        files=len(files),
        bytes=sum(p.stat().st_size for p in files),
        real_tokens=sum(real),
        stored_tokens=stored,
        steady_tok_s=sum(later) / span if span > 0 else None,
        matched=matched,
        unmatched=unmatched,
    )


def load_states(path: Path, length: int, layer_ids) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """One sample's stored states cut to its own `length` tokens, keyed like ours, and its ids."""
    from .accounting import split_layers

    rec = torch.load(path, map_location="cpu", weights_only=True)
    aux = rec["aux_hidden_state"].squeeze(0)[:length]
    last = rec["hidden_state"].squeeze(0)[:length]
    return split_layers(aux, last, layer_ids), rec["input_ids"][:length].numpy()
