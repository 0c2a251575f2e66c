"""NaN and Inf in the states, in-process: the feed and its guard on a stand-in engine whose states are
known, for whole batches and for long samples that arrive chunk by chunk."""

import re

import numpy as np
import pytest
import torch
from small_shards import RUN

from offline_extract.data.batching import batch_by_tokens
from offline_extract.data.tokenization import Sample
from offline_extract.engine.nonfinite import NonFiniteError, NonFiniteGuard
from offline_extract.engine.sglang_adapter import Captured
from offline_extract.feed import extract_batches
from offline_extract.store.index import iter_samples
from offline_extract.store.writer import ShardWriter


class PoisonedEngine:
    """Stands in for the engine: each token's states are its id; token 99 makes its row of layer 3 NaN,
    token 98 its last state's first value Inf. A single sequence over 8 tokens comes in chunks of 3."""

    device = "cpu"
    layer_ids = (1, 3)
    hidden_size = 4
    max_forward_tokens = 8
    chunk_tokens = 3

    def capture(self, seqs, images=None):
        ids = torch.from_numpy(np.concatenate(seqs)).float()[:, None]
        aux, last = ids.repeat(1, 8), ids.repeat(1, 4)
        aux[ids[:, 0] == 99, 4:] = float("nan")
        last[ids[:, 0] == 98, 0] = float("inf")
        return Captured(aux, last)

    def is_chunked(self, seqs):
        return len(seqs) == 1 and len(seqs[0]) > self.max_forward_tokens

    def chunks(self, ids, chunk):
        for start in range(0, len(ids), chunk):
            yield start, min(start + chunk, len(ids)), self.capture([ids[start : start + chunk]])


def samples(*token_lists):
    return [
        Sample(
            i, f"s{i}", "c.jsonl", i + 1, np.array(ids, dtype=np.int32), np.ones(len(ids), np.uint8), len(ids), False
        )
        for i, ids in enumerate(token_lists)
    ]


POISONED = samples([1, 2], [3, 99, 99, 4], [5], [98, 6], [7, 8, 9])
# Samples over the batch budget, prefilled in chunks: a clean one, one poisoned in its third chunk, and
# one in its first; short ones between them.
LONG = samples(list(range(10, 21)), [1, 2], [30, 31, 32, 33, 34, 35, 99, 37, 38, 39], [5], [98] + list(range(40, 49)))
LONG_NAN = "4 non-finite values (NaN/Inf) in its hidden states: 4 in layer 3"
NAN_REASON = "8 non-finite values (NaN/Inf) in its hidden states: 8 in layer 3"
INF_REASON = "1 non-finite values (NaN/Inf) in its hidden states: 1 in the final state"


def extract(tmp_path, guard, items=POISONED, shard_bytes=512 << 20):
    writer = ShardWriter(tmp_path, RUN, shard_bytes=shard_bytes)
    try:
        extract_batches(PoisonedEngine(), batch_by_tokens(items, 8, 8), writer, nonfinite=guard)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return {info.id: t for info, t in iter_samples(tmp_path)}


def test_nonfinite_drop_leaves_out_only_the_poisoned_samples(tmp_path):
    found = []
    got = extract(tmp_path, NonFiniteGuard("drop", PoisonedEngine.layer_ids, lambda s, why: found.append((s.id, why))))
    assert found == [("s1", NAN_REASON), ("s3", INF_REASON)]
    assert set(got) == {"s0", "s2", "s4"}
    for sid, tokens in (("s0", [1, 2]), ("s2", [5]), ("s4", [7, 8, 9])):
        assert got[sid]["aux_hidden_states"][:, 0].tolist() == tokens  # the kept rows, not their neighbours'


def test_nonfinite_fail_names_the_sample_and_the_layer(tmp_path):
    with pytest.raises(NonFiniteError, match=re.escape(f"sample 's1' (c.jsonl:2) has {NAN_REASON}")):
        extract(tmp_path, NonFiniteGuard("fail", PoisonedEngine.layer_ids))


def test_nonfinite_keep_writes_the_states_as_they_are(tmp_path):
    found = []
    got = extract(tmp_path, NonFiniteGuard("keep", PoisonedEngine.layer_ids, lambda s, why: found.append(s.id)))
    assert found == ["s1", "s3"] and len(got) == 5
    assert torch.isnan(got["s1"]["aux_hidden_states"][1:3, 4:].float()).all()
    assert torch.isinf(got["s3"]["hidden_states"][0, 0].float())


# (8 + 4) bf16 values a token: with shards of 8 tokens, each long sample completes a shard, which is then
# written while its chunks arrive (but not under "drop": a streamed sample could not be left out).
@pytest.mark.parametrize("shard_bytes", [512 << 20, 8 * 24], ids=["big-shards", "streamed"])
@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_long_samples_arrive_chunk_by_chunk_and_are_screened_whole(tmp_path, policy, shard_bytes):
    found = []
    guard = NonFiniteGuard(policy, PoisonedEngine.layer_ids, lambda s, why: found.append((s.id, why)))
    got = extract(tmp_path, guard, LONG, shard_bytes)
    assert found == [("s2", LONG_NAN), ("s4", INF_REASON)]
    assert set(got) == ({"s0", "s1", "s3"} if policy == "drop" else {"s0", "s1", "s2", "s3", "s4"})
    for sample in LONG:
        if sample.id in got:  # every chunk's rows in their place
            assert got[sample.id]["aux_hidden_states"][:, 0].float().tolist() == sample.input_ids.tolist()
            assert got[sample.id]["input_ids"].tolist() == sample.input_ids.tolist()


def test_a_long_sample_poisoned_in_a_later_chunk_fails_the_run(tmp_path):
    with pytest.raises(NonFiniteError, match=re.escape(f"sample 's2' (c.jsonl:3) has {LONG_NAN}")):
        extract(tmp_path, NonFiniteGuard("fail", PoisonedEngine.layer_ids), LONG, shard_bytes=8 * 24)
    # s0's shard is complete; s2's (with s1), already being written as s2 arrived, is gone with its
    # temporary file: a re-run redoes both.
    assert [p.name for p in tmp_path.iterdir()] == ["shard_000.safetensors"]


def test_clean_batches_are_never_examined_sample_by_sample(tmp_path):
    class Watched(NonFiniteGuard):
        def screen(self, *args):
            raise AssertionError("a clean batch was screened")

    clean = [POISONED[i] for i in (0, 2, 4)]
    assert len(extract(tmp_path, Watched("fail", PoisonedEngine.layer_ids), clean)) == 3
