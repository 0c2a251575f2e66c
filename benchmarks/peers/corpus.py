"""The benchmark's synthetic corpus handed to peers that run in their own processes.

`save_batches` keeps our exact batches (token ids only), so a peer that takes token ids prefills the same
forwards we did. `chat_records` turns the same samples back into chat records for a peer that only reads
conversations (SpecForge): rendered with the tokenizer's own template they give the sample's tokens
again, plus at most the few template tokens that close the message the sample was cut in.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np


def save_batches(path: Path, batches: list[list[np.ndarray]], warmup: int) -> None:
    """Token ids of every sample, batch by batch; the first `warmup` batches are not timed."""
    seqs = [ids for batch in batches for ids in batch]
    np.savez(
        path,
        input_ids=np.concatenate(seqs).astype(np.int32),
        offsets=np.cumsum([0, *map(len, seqs)]).astype(np.int64),
        batch_sizes=np.array([len(b) for b in batches], dtype=np.int64),
        warmup=np.array(warmup),
    )


def load_batches(path: Path) -> tuple[list[list[np.ndarray]], int]:
    with np.load(path) as f:
        ids, offsets, sizes, warmup = f["input_ids"], f["offsets"], f["batch_sizes"], int(f["warmup"])
    seqs = [ids[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
    bounds = np.cumsum([0, *sizes])
    return [seqs[bounds[b] : bounds[b + 1]] for b in range(len(sizes))], warmup


def chat_records(
    seqs: list[np.ndarray], tokenizer, roles: tuple[str, ...] = ("system", "user", "assistant")
) -> list[dict]:
    """ShareGPT-style `conversations` records whose rendering starts with each sequence's tokens.

    The tokens are decoded with their special tokens and split at the role headers of the tokenizer's
    template (`<|role|>\\n` ... `<|end|>`, the embedded model's); the last message may be cut short.
    Raises if a decoded sample does not have that shape, rather than handing a peer other text.
    """
    header = "|".join(re.escape(r) for r in roles)
    pattern = re.compile(rf"<\|({header})\|>\n(.*?)(?:<\|end\|>|$)", re.S)
    bos = tokenizer.bos_token or ""
    records = []
    for i, ids in enumerate(seqs):
        text = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        if not text.startswith(bos):
            raise ValueError(f"sample {i} does not start with {bos!r}: {text[:40]!r}")
        # A cut between a role header and its newline leaves a dangling header: drop it (one token).
        body = re.sub(rf"<\|({header})\|>$", "", text[len(bos) :])
        messages = [{"role": m.group(1), "content": m.group(2)} for m in pattern.finditer(body)]
        rebuilt = "".join(m.group(0) for m in pattern.finditer(body))
        if not messages or rebuilt != body:
            raise ValueError(f"sample {i} is not a chat of the embedded template: {body[:80]!r}")
        records.append({"id": f"synthetic-{i}", "conversations": messages})
    return records


def write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
