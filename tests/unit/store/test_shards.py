import hashlib
import itertools
import json
import os
import stat
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from offline_extract.store import checksum, codecs
from offline_extract.store.index import iter_samples, read_index, shard_paths, write_index
from offline_extract.store.schema import FORMAT_VERSION, Encoding, SampleInfo, ShardError, shard_name, shard_number
from offline_extract.store.shard import open_shard, read_header
from offline_extract.store import shard_file
from offline_extract.store import writer as writer_module
from offline_extract.store.writer import ShardWriter
from offline_extract.testing.shards import synthetic_run

K, H = 3, 8
ROW_BYTES = (K + 1) * H * 2
WIDTHS = Encoding().widths(K, H)  # of the states a bf16 shard stores
RUN = synthetic_run((1, 2, 3), layer_convention="after_layer")
FP8_ZSTD = replace(RUN, store="fp8", compress="zstd")


def make_batch(indices, lengths, seed=0):
    """Synthetic samples whose tensors are exact in bf16 and carry their sample index, for traceability."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    samples = [
        SampleInfo(i, f"s{i}", source="data.jsonl", line=i + 1, source_len=n + 2, truncated=i % 2 == 0)
        for i, n in zip(indices, lengths)
    ]
    input_ids = np.concatenate([np.full(n, 1000 + i) for i, n in zip(indices, lengths)]).astype(np.int64)
    loss_mask = torch.rand(total, generator=gen) > 0.5
    aux = torch.randn(total, K * H, generator=gen).to(torch.bfloat16).float()
    last = torch.randn(total, H, generator=gen).to(torch.bfloat16)
    return samples, input_ids, loss_mask, aux, last


def write(out_dir, batches, shard_bytes=1 << 30, run=RUN, **kwargs):
    writer = ShardWriter(out_dir, run, shard_bytes=shard_bytes, **kwargs)
    for indices, lengths, seed in batches:
        writer.add_batch(*make_batch(indices, lengths, seed), lengths=lengths)
    return writer, writer.close()


def expected_samples(batches):
    """Per sample index: (SampleInfo, tensors as the reader should return them)."""
    out = {}
    for indices, lengths, seed in batches:
        samples, ids, mask, aux, last = make_batch(indices, lengths, seed)
        start = 0
        for info, n in zip(samples, lengths):
            out[info.index] = (
                info,
                {
                    "input_ids": torch.from_numpy(ids[start : start + n]).to(torch.int32),
                    "loss_mask": mask[start : start + n].to(torch.uint8),
                    "image_mask": torch.zeros(n, dtype=torch.uint8),
                    "aux_hidden_states": aux[start : start + n].to(torch.bfloat16),
                    "hidden_states": last[start : start + n],
                },
            )
            start += n
    return out


def assert_tensors_equal(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


BATCHES = [([0, 1, 2], [5, 3, 7], 0), ([3, 4], [4, 6], 1), ([5, 6, 7, 8], [2, 9, 1, 5], 2)]


def test_round_trip_several_batches_into_several_shards(tmp_path):
    writer, paths = write(tmp_path, BATCHES, shard_bytes=12 * ROW_BYTES)
    want = expected_samples(BATCHES)
    assert len(paths) > 2
    assert writer.samples_written == 9
    assert writer.tokens_written == sum(sum(lengths) for _, lengths, _ in BATCHES)
    assert writer.bytes_written == sum(p.stat().st_size for p in paths)

    seen = []
    for path in paths:
        shard = open_shard(path)
        assert shard.run == RUN
        lengths = [len(want[s.index][1]["input_ids"]) for s in shard.samples]
        assert shard.offsets == np.cumsum([0, *lengths]).tolist()
        assert torch.equal(shard.tensor("offsets"), torch.tensor(shard.offsets, dtype=torch.int64))
        assert shard.tensor("sample_index").tolist() == [s.index for s in shard.samples]
        assert shard.tensor("aux_hidden_states").dtype == torch.bfloat16
        for pos, info in enumerate(shard.samples):
            assert info == want[info.index][0]
            assert_tensors_equal(shard.sample(pos), want[info.index][1])
            assert_tensors_equal(shard.sample(info.id), want[info.index][1])
            seen.append(info.index)
    assert seen == list(range(9))

    got = list(iter_samples(tmp_path))
    assert [info.id for info, _ in got] == [f"s{i}" for i in range(9)]
    for info, tensors in got:
        assert_tensors_equal(tensors, want[info.index][1])


def test_shards_split_at_sample_boundaries_once_full(tmp_path):
    # 10 rows per shard: a shard closes on the sample that reaches 10 rows; a sample larger than the limit
    # gets a shard of its own.
    batches = [([0, 1, 2, 3], [4, 4, 4, 25], 0), ([4, 5], [9, 1], 1)]
    _, paths = write(tmp_path, batches, shard_bytes=10 * ROW_BYTES)
    layout = [[s.index for s in open_shard(p).samples] for p in paths]
    assert layout == [[0, 1, 2], [3], [4, 5]]
    assert [open_shard(p).num_tokens for p in paths] == [12, 25, 10]


def test_shard_name_width_grows_with_number():
    assert shard_name(0) == "shard_000.safetensors"
    assert shard_name(42) == "shard_042.safetensors"
    assert shard_name(999) == "shard_999.safetensors"
    assert shard_name(1234) == "shard_1234.safetensors"


def test_a_shard_number_is_read_only_from_a_shard_name():
    assert shard_number(Path("out") / shard_name(1234)) == 1234
    with pytest.raises(ValueError, match="out/shard_1.tmp is not named as a shard is"):
        shard_number(Path("out/shard_1.tmp"))


def test_widened_names_sort_numerically(tmp_path):
    batches = [([0], [3], 0), ([1], [3], 1), ([2], [3], 2)]
    _, paths = write(tmp_path, batches, shard_bytes=1, shard_numbers=iter([998, 999, 1000]))
    assert [p.name for p in paths] == [shard_name(998), shard_name(999), "shard_1000.safetensors"]
    assert shard_paths(tmp_path) == paths
    index = json.loads(write_index(tmp_path).read_text())
    assert [s["file"] for s in index["shards"]] == [p.name for p in paths]


def test_data_parallel_shard_numbers_interleave(tmp_path):
    even = [([0, 2], [3, 3], 0), ([4, 6], [3, 3], 1)]
    odd = [([1, 3], [3, 3], 2), ([5, 7], [3, 3], 3)]
    _, paths0 = write(tmp_path, even, shard_bytes=6 * ROW_BYTES, shard_numbers=itertools.count(0, 2))
    _, paths1 = write(tmp_path, odd, shard_bytes=6 * ROW_BYTES, shard_numbers=itertools.count(1, 2))
    assert [p.name for p in paths0] == ["shard_000.safetensors", "shard_002.safetensors"]
    assert [p.name for p in paths1] == ["shard_001.safetensors", "shard_003.safetensors"]
    want = expected_samples(even + odd)
    got = list(iter_samples(tmp_path))
    assert [info.index for info, _ in got] == list(range(8))
    for info, tensors in got:
        assert_tensors_equal(tensors, want[info.index][1])


@pytest.mark.parametrize(
    "data, why",
    [
        (
            b'{"format_version": 2, "run": "caf\xe9"}',
            "'utf-8' codec can't decode byte 0xe9 in position 33: invalid continuation byte",
        ),  # Latin-1
        (
            '{"format_version": 2}'.encode("utf-16"),
            "'utf-8' codec can't decode byte 0xff in position 0: invalid start byte",
        ),
        (b'{"format_version": 2, "run', "Unterminated string starting at: line 1 column 23 (char 22)"),
    ],
)
def test_an_index_that_is_not_utf8_json_is_named_with_where_it_breaks(data, why, tmp_path):
    # Text in another encoding (an editor's save) stopped inspect and export on the decoder's bare "'utf-8' codec
    # can't decode byte ...", naming no file; and any damaged index stopped them with a traceback.
    (tmp_path / "index.json").write_bytes(data)
    with pytest.raises(ShardError) as refused:  # which the commands say in one line
        read_index(tmp_path)
    assert str(refused.value) == f"{tmp_path / 'index.json'} is not valid JSON ({why}): delete or restore it"


def test_write_index_contents(tmp_path):
    batches = [([2, 0], [3, 4], 0), ([3, 1], [5, 2], 1)]
    _, paths = write(tmp_path, batches, shard_bytes=7 * ROW_BYTES)
    path = write_index(tmp_path)
    assert path == tmp_path / "index.json"
    index = json.loads(path.read_text())
    assert index["format_version"] == FORMAT_VERSION
    assert index["run"] == RUN.to_json()
    assert index["num_samples"] == 4
    assert index["num_tokens"] == 14
    assert [p.name for p in paths] == [shard_name(0), shard_name(1)]
    assert index["shards"] == [
        {"file": p.name, "num_samples": 2, "num_tokens": 7, "bytes": p.stat().st_size} for p in paths
    ]
    assert index["samples"] == {
        "id": ["s0", "s1", "s2", "s3"],
        "shard": [0, 1, 0, 1],
        "row": [1, 1, 0, 0],
        "index": [0, 1, 2, 3],
    }


@pytest.mark.parametrize("run", [RUN, FP8_ZSTD], ids=["bf16", "fp8-zstd"])
def test_the_writer_knows_its_headers_so_the_index_reads_none_back(tmp_path, monkeypatch, run):
    writer, paths = write(tmp_path, BATCHES, shard_bytes=12 * ROW_BYTES, run=run)
    assert len(paths) > 2
    assert sorted(writer.headers, key=lambda h: h.path.name) == [read_header(p) for p in paths]
    from_disk = write_index(tmp_path).read_text()

    def no_reading(path):
        raise AssertionError(f"{path} was read back")

    monkeypatch.setattr("offline_extract.store.index.read_header", no_reading)
    assert write_index(tmp_path, writer.headers).read_text() == from_disk


def test_the_index_reads_the_shards_it_was_not_told_of(tmp_path):
    """Another replica's shards, or an earlier attempt's: the directory, not the writer, says what is there."""
    write(tmp_path, [([0, 2], [3, 3], 0)], shard_numbers=iter([0]))
    writer, _ = write(tmp_path, [([1, 3], [3, 3], 1)], shard_numbers=iter([1]))
    index = json.loads(write_index(tmp_path, writer.headers).read_text())
    assert [s["file"] for s in index["shards"]] == [shard_name(0), shard_name(1)]
    assert index["samples"]["index"] == [0, 1, 2, 3]
    assert index["samples"]["shard"] == [0, 1, 0, 1]


def test_write_index_rejects_a_sample_in_two_shards(tmp_path):
    write(tmp_path, [([0, 1], [2, 2], 0)], shard_numbers=iter([0]))
    write(tmp_path, [([1, 2], [2, 2], 1)], shard_numbers=iter([1]))
    with pytest.raises(ShardError, match=r"sample index 1 .*shard_000.*shard_001"):
        write_index(tmp_path)
    assert not (tmp_path / "index.json").exists()


def test_write_index_rejects_shards_of_different_runs(tmp_path):
    write(tmp_path, [([0], [2], 0)], shard_numbers=iter([0]))
    write(tmp_path, [([1], [2], 1)], shard_numbers=iter([1]), run=replace(RUN, layer_ids=(2, 5, 9)))
    with pytest.raises(ShardError, match="layer_ids"):
        write_index(tmp_path)


def test_the_index_of_a_directory_without_shards_lists_no_samples(tmp_path):
    index = json.loads(write_index(tmp_path).read_text())
    assert (index["run"], index["num_samples"], index["shards"], index["samples"]["id"]) == (None, 0, [], [])


def test_writes_leave_only_final_files(tmp_path):
    write(tmp_path, BATCHES, shard_bytes=12 * ROW_BYTES)
    write_index(tmp_path)
    names = sorted(os.listdir(tmp_path))
    assert names == ["index.json", *(shard_name(i) for i in range(len(names) - 1))]
    assert len(names) > 2


def test_crash_while_serializing_leaves_no_partial_shard(tmp_path, monkeypatch):
    def crash_midway(path, tensors, metadata, pool, filling=None):
        with open(path, "wb") as f:
            f.write(b"\x00" * 100)
        raise OSError("disk full")

    monkeypatch.setattr(shard_file, "write", crash_midway)
    writer = ShardWriter(tmp_path, RUN, shard_bytes=ROW_BYTES)
    writer.add_batch(*make_batch([0], [4]), lengths=[4])  # the write runs on a writer thread
    with pytest.raises(OSError, match="disk full"):
        writer.close()
    assert os.listdir(tmp_path) == []


def test_close_after_a_failed_write_was_caught_still_says_so(tmp_path, monkeypatch):
    """A library caller that catches the failed write add_batch raises and then closes, rather than aborts,
    must not get the shards written as if they were all."""
    serialize, calls = shard_file.write, itertools.count()

    def first_shard_fails(*args, **kwargs):
        if next(calls) == 0:
            raise OSError("disk full")
        return serialize(*args, **kwargs)

    monkeypatch.setattr(shard_file, "write", first_shard_fails)
    writer = ShardWriter(tmp_path, RUN, shard_bytes=ROW_BYTES, writers=1)
    writer.add_batch(*make_batch([0], [4]), lengths=[4])
    with pytest.raises(OSError, match="disk full"):
        for i in range(1, 50):  # the failure comes out of a later call, once the writer thread has met it
            time.sleep(0.01)
            writer.add_batch(*make_batch([i], [4], i), lengths=[4])
    with pytest.raises(ShardError, match=f"a shard write failed earlier .*disk full.*not in {tmp_path}"):
        writer.close()
    assert shard_name(0) not in os.listdir(tmp_path)


def test_shard_files_get_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        _, paths = write(tmp_path, [([0], [2], 0)])
    finally:
        os.umask(old)
    assert stat.S_IMODE(paths[0].stat().st_mode) == 0o640


def test_buffered_batches_are_copies(tmp_path):
    samples, ids, mask, aux, last = make_batch([0], [4])
    want = last.clone()
    writer = ShardWriter(tmp_path, RUN)
    writer.add_batch(samples, ids, mask, aux, last, lengths=[4])
    last.zero_()  # a caller reusing its staging buffer for the next batch
    (path,) = writer.close()
    assert torch.equal(open_shard(path).sample(0)["hidden_states"], want)


def test_refuses_to_overwrite_an_existing_shard(tmp_path):
    write(tmp_path, [([0], [2], 0)])
    with pytest.raises(FileExistsError, match="shard_000"):
        write(tmp_path, [([1], [2], 1)])


def test_add_batch_checks_shapes(tmp_path):
    samples, ids, mask, aux, last = make_batch([0, 1], [3, 4])
    writer = ShardWriter(tmp_path, RUN)
    with pytest.raises(ShardError, match="sum\\(lengths\\)=6"):
        writer.add_batch(samples, ids, mask, aux, last, lengths=[3, 3])
    with pytest.raises(ShardError, match="2 samples but 1 lengths"):
        writer.add_batch(samples, ids, mask, aux, last, lengths=[7])
    with pytest.raises(ShardError, match="not a multiple"):
        writer.add_batch(samples, ids, mask, aux[:, :-1], last, lengths=[3, 4])
    writer.close()
    with pytest.raises(ShardError, match="closed"):
        writer.add_batch(samples, ids, mask, aux, last, lengths=[3, 4])


def test_a_sample_of_no_tokens_is_refused_naming_it(tmp_path):
    """It has no states to train on, and under zstd its empty frame does not say its width: written, it
    read back as [0, 0] states and broke a read of several samples (Shard.read, torch.cat)."""
    writer = ShardWriter(tmp_path, replace(RUN, compress="zstd"))
    samples, ids, mask, aux, last = make_batch([0, 1, 2], [3, 0, 2])
    with pytest.raises(ShardError, match=r"samples \['s1'\] have no tokens \(lengths \[3, 0, 2\]\)"):
        writer.add_batch(samples, ids, mask, aux, last, lengths=[3, 0, 2])
    with pytest.raises(ShardError, match=r"samples \['s1'\] have no tokens"):
        writer.begin_sample(samples[1], ids[3:3], mask[3:3], WIDTHS)
    assert writer.close() == [] and os.listdir(tmp_path) == []


def test_unknown_sample_in_a_shard(tmp_path):
    _, (path,) = write(tmp_path, [([0], [2], 0)])
    with pytest.raises(KeyError, match="nope"):
        open_shard(path).sample("nope")


def test_preallocated_buffers_write_the_same_shards(tmp_path):
    _, plain = write(tmp_path / "plain", BATCHES, shard_bytes=12 * ROW_BYTES, writers=2)
    writer, pre = write(tmp_path / "pre", BATCHES, shard_bytes=12 * ROW_BYTES, writers=2, widths=WIDTHS)
    assert writer._buffers.left == 0, "every buffer is allocated up front"
    assert [p.name for p in plain] == [p.name for p in pre]
    for a, b in zip(plain, pre):
        assert a.read_bytes() == b.read_bytes()


def test_damaged_metadata_is_a_shard_error_naming_the_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "shard_000.safetensors"
    tensors = {
        name: torch.zeros(1)
        for name in ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states", "offsets", "sample_index")
    }
    save_file(tensors, str(path), metadata={"offline_extract": "{not json"})
    with pytest.raises(ShardError, match=r"shard_000\.safetensors has damaged"):
        read_header(path)


def _feed_in_pieces(writer, batches, piece_rows, drop=(), stream=False, before_close=lambda writer: None):
    """Every sample alone: short ones through add_batch, those over `piece_rows` rows through
    begin_sample / end_sample, filled `piece_rows` rows at a time (as a long sample's chunks arrive)."""
    for indices, lengths, seed in batches:
        samples, ids, mask, aux, last = make_batch(indices, lengths, seed)
        start = 0
        for info, n in zip(samples, lengths):
            rows = slice(start, start + n)
            if n > piece_rows:
                got = writer.begin_sample(info, ids[rows], mask[rows], WIDTHS, stream=stream)
                for a in range(0, n, piece_rows):
                    b = min(a + piece_rows, n)
                    got["aux_hidden_states"][a:b].copy_(aux[start + a : start + b])
                    got["hidden_states"][a:b].copy_(last[start + a : start + b])
                    writer.filled(b)
                writer.end_sample(keep=info.index not in drop)
            else:
                writer.add_batch([info], ids[rows], mask[rows], aux[rows], last[rows], lengths=[n])
            start += n
    before_close(writer)
    return writer.close()


@pytest.mark.parametrize("stream", [False, True], ids=["written-after", "streamed"])
@pytest.mark.parametrize("widths", [None, WIDTHS], ids=["lazy", "preallocated"])
def test_a_sample_filled_in_pieces_writes_the_same_shards(tmp_path, widths, stream):
    # Sample 3 (25 rows) is longer than a shard (10 rows) and arrives in pieces of 7 rows, after three
    # samples already buffered: it grows that buffer and closes the shard with them, as add_batch would.
    # Streamed, that shard is written while the pieces arrive.
    batches = [([0, 1, 2, 3], [3, 2, 4, 25], 0), ([4, 5, 6], [9, 1, 30], 1), ([7], [2], 2)]
    _, whole = write(tmp_path / "whole", batches, shard_bytes=10 * ROW_BYTES, writers=2)
    writer = ShardWriter(tmp_path / "pieces", RUN, shard_bytes=10 * ROW_BYTES, writers=2, widths=widths)
    capacities = set()

    def buffers_written_during_the_run(writer):
        for f in writer._writes.pending:
            f.result()
        capacities.update(writer._buffers.free.get().capacity for _ in range(writer._buffers.free.qsize()))

    pieces = _feed_in_pieces(writer, batches, piece_rows=7, stream=stream, before_close=buffers_written_during_the_run)
    assert [p.name for p in whole] == [p.name for p in pieces]
    assert [[s.index for s in open_shard(p).samples] for p in pieces] == [[0, 1, 2, 3], [4, 5], [6], [7]]
    for a, b in zip(whole, pieces):
        assert a.read_bytes() == b.read_bytes()
    if widths is not None:
        # Buffers grown for the long samples went back to the shard size once written (during the run:
        # after close none is needed, and the writer drops them as they are).
        assert capacities == {-(-10 * ROW_BYTES // ((K * H + H) * 2))}


def test_a_sample_ended_without_keep_is_left_out(tmp_path):
    batches = [([0, 1, 2], [3, 12, 4], 0)]
    writer = ShardWriter(tmp_path, RUN, shard_bytes=100 * ROW_BYTES)
    paths = _feed_in_pieces(writer, batches, piece_rows=5, drop={1})
    want = expected_samples(batches)
    (path,) = paths
    shard = open_shard(path)
    assert [s.index for s in shard.samples] == [0, 2]
    assert shard.offsets == [0, 3, 7]
    for pos, info in enumerate(shard.samples):
        assert_tensors_equal(shard.sample(pos), want[info.index][1])


def test_a_streamed_shard_waits_for_every_row_and_is_abandoned_cleanly(tmp_path):
    samples, ids, mask, aux, last = make_batch([0], [12])
    writer = ShardWriter(tmp_path, RUN, shard_bytes=4 * ROW_BYTES)
    rows = writer.begin_sample(samples[0], ids, mask, WIDTHS, stream=True)
    rows["aux_hidden_states"].copy_(aux)
    rows["hidden_states"].copy_(last)
    writer.filled(12)
    time.sleep(0.5)
    # Every row is written, but the shard appears only once the sample is ended (checked whole by then).
    assert "shard_000.safetensors" not in os.listdir(tmp_path)
    with pytest.raises(ShardError, match="streamed into its shard; it cannot be left out"):
        writer.end_sample(keep=False)
    writer.abort()
    assert os.listdir(tmp_path) == []  # neither the shard nor its temporary file

    writer = ShardWriter(tmp_path, RUN, shard_bytes=4 * ROW_BYTES)
    writer.begin_sample(samples[0], ids, mask, WIDTHS, stream=True)
    writer.filled(11)
    with pytest.raises(ShardError, match="1 of its rows unfilled"):
        writer.end_sample()
    writer.abort()
    assert os.listdir(tmp_path) == []


def test_nothing_else_goes_in_while_a_sample_is_begun(tmp_path):
    writer = ShardWriter(tmp_path, RUN, shard_bytes=1 << 20)
    samples, ids, mask, aux, last = make_batch([0, 1], [4, 3])
    writer.begin_sample(samples[0], ids[:4], mask[:4], WIDTHS)
    with pytest.raises(ShardError, match="'s0' is begun"):
        writer.add_batch(samples[1:], ids[4:], mask[4:], aux[4:], last[4:], lengths=[3])
    with pytest.raises(ShardError, match="'s0' is begun"):
        writer.close()
    writer.end_sample()
    with pytest.raises(ShardError, match="no sample begun"):
        writer.end_sample()
    assert len(writer.close()) == 1


@pytest.mark.parametrize("run", [RUN, FP8_ZSTD], ids=["bf16", "fp8-zstd"])
def test_the_shard_left_at_close_is_written_by_every_thread_in_whole_samples(tmp_path, monkeypatch, run):
    monkeypatch.setattr(writer_module, "LAST_SHARD_PART_BYTES", 10 * ROW_BYTES)
    _, (whole,) = write(tmp_path / "whole", BATCHES, run=run, writers=1)
    writer, paths = write(tmp_path / "parts", BATCHES, run=run, writers=3)
    # 42 tokens buffered (1 GiB target), 3 threads: three parts of about 14 tokens, each cut at the sample
    # boundary nearest to 14 and 28 (lengths 5 3 7 | 4 6 2 | 9 1 5).
    assert [read_header(p).num_tokens for p in paths] == [15, 12, 15]
    assert (writer.samples_written, writer.tokens_written) == (9, 42)
    got, want = list(iter_samples(tmp_path / "parts")), list(iter_samples(tmp_path / "whole"))
    assert [info for info, _ in got] == [info for info, _ in want] == [s for b in BATCHES for s in make_batch(*b)[0]]
    for (_, tensors), (_, expected) in zip(got, want):
        assert_tensors_equal(tensors, expected)


def test_a_small_last_shard_stays_one_file(tmp_path):
    """Under LAST_SHARD_PART_BYTES a part would cost more in files than it saves in time."""
    _, paths = write(tmp_path, BATCHES, writers=4)
    assert len(paths) == 1


def test_zstd_frames_are_compressed_as_their_samples_arrive(tmp_path, monkeypatch):
    """Each sample's frames are compressed once its batch is in, not when its shard completes: at close
    only the last batch's frames are left (the last shard's, in one thread, took most of a second)."""
    started = []
    compress = codecs.compress_frame

    def spy(rows, cctx):
        started.append(rows.shape[0])
        return compress(rows, cctx)

    monkeypatch.setattr(codecs, "compress_frame", spy)
    writer = ShardWriter(tmp_path, replace(RUN, compress="zstd"), writers=2)
    writer.add_batch(*make_batch([0, 1], [5, 3]), lengths=[5, 3])
    deadline = time.monotonic() + 10
    while len(started) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(started) == [3, 3, 5, 5]  # aux and final state of both samples, with the shard still open
    assert not shard_paths(tmp_path)
    (path,) = writer.close()
    assert [info.index for info, _ in iter_samples(tmp_path)] == [0, 1]
    assert len(started) == 4


def test_a_failed_compression_fails_the_write_and_leaves_no_shard(tmp_path, monkeypatch):
    def broken(rows, cctx):
        raise MemoryError("no room for a frame")

    monkeypatch.setattr(codecs, "compress_frame", broken)
    writer = ShardWriter(tmp_path, replace(RUN, compress="zstd"), writers=2)
    writer.add_batch(*make_batch([0, 1], [5, 3]), lengths=[5, 3])
    with pytest.raises(MemoryError, match="no room for a frame"):
        writer.close()
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("length, most_buffers", [(3, 3), (7, 6)])
def test_the_sample_that_closes_a_shard_does_not_grow_a_buffer_for_every_shard(
    tmp_path, monkeypatch, length, most_buffers
):
    """The sample taking a shard past its target goes in with it. A buffer has room for it up front (a 64-row
    shard's buffer holds 68: 3-row samples close their shards at 66 rows), and one grown by a longer crossing
    sample (7 rows: 70) keeps that room for the shards after it: growing copies every row the buffer holds
    into memory not yet touched, on the thread the GPU's batches wait for. So 40 shards take the writer's 2
    buffers, or each grown once; and the shards are the same."""
    made = []
    init = writer_module._ShardBuffer.__init__

    def counted(self, *args, **kwargs):
        made.append(args[-1])
        init(self, *args, **kwargs)

    monkeypatch.setattr(writer_module._ShardBuffer, "__init__", counted)
    per_shard = -(-64 // length)
    batches = [(list(range(i, i + per_shard)), [length] * per_shard, i) for i in range(0, 40 * per_shard, per_shard)]
    _, paths = write(tmp_path, batches, shard_bytes=64 * ROW_BYTES, writers=1)
    assert len(paths) == 40 and len(made) <= most_buffers, made
    got = [[s.index for s in open_shard(p).samples] for p in paths]
    assert got == [indices for indices, _, _ in batches]


def test_a_grown_buffer_goes_back_when_no_standard_one_can_be_allocated(tmp_path, monkeypatch):
    """Each sample longer than a shard grows its buffer, which a writer thread swaps for a standard one
    once written. When that allocation fails (out of memory), the grown one goes back and the error comes
    out of the writer: the buffer had been lost, and with every buffer lost so, the next batch waited for
    one for ever."""
    allocate = writer_module._Buffers._make

    def no_memory_in_writer_threads(self):
        if threading.current_thread().name.startswith("shard-writer"):
            raise MemoryError("no room for a shard buffer")
        return allocate(self)

    monkeypatch.setattr(writer_module._Buffers, "_make", no_memory_in_writer_threads)
    writer = ShardWriter(tmp_path, RUN, shard_bytes=4 * ROW_BYTES, writers=1)  # two buffers
    raised = []

    def run():
        try:
            for i in range(4):
                writer.add_batch(*make_batch([i], [10], i), lengths=[10])
            writer.close()
        except MemoryError as e:
            raised.append(e)

    feeding = threading.Thread(target=run, daemon=True)
    feeding.start()
    feeding.join(timeout=30)
    assert not feeding.is_alive(), "add_batch waited for ever for a shard buffer"
    assert [str(e) for e in raised] == ["no room for a shard buffer"]
    writer.abort()
    for path in shard_paths(tmp_path):  # the shards written are whole
        (info,) = open_shard(path).samples
        assert_tensors_equal(
            open_shard(path).sample(0), expected_samples([([info.index], [10], info.index)])[info.index][1]
        )


def test_the_checksum_is_the_xxh3_128_of_the_blocks_xxh3_128s(tmp_path, monkeypatch):
    monkeypatch.setattr(checksum, "BLOCK_BYTES", 1000)
    data = np.random.default_rng(0).integers(0, 256, 3500, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    blocks = [xxhash.xxh3_128(data[a : a + 1000]).digest() for a in (0, 1000, 2000, 3000)]
    assert checksum.KEY == "block_xxh3_128"
    assert checksum.file_checksum(tmp_path / "f") == xxhash.xxh3_128(b"".join(blocks)).hexdigest()


@pytest.mark.parametrize("key", ["block_xxh3_128", "block_sha256", "sha256"])
def test_an_entry_of_each_kind_verifies_and_catches_a_flipped_byte(tmp_path, monkeypatch, key):
    """Earlier versions' manifests record block_sha256 or the plain sha256; `checksum` computes the kind
    the entry records, so their shards verify, and a flipped byte is caught whichever kind it is."""
    monkeypatch.setattr(checksum, "BLOCK_BYTES", 1000)
    data = np.random.default_rng(0).integers(0, 256, 3500, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    expected = {
        "block_xxh3_128": xxhash.xxh3_128(
            b"".join(xxhash.xxh3_128(data[a : a + 1000]).digest() for a in range(0, 3500, 1000))
        ),
        "block_sha256": hashlib.sha256(
            b"".join(hashlib.sha256(data[a : a + 1000]).digest() for a in range(0, 3500, 1000))
        ),
        "sha256": hashlib.sha256(data),
    }[key].hexdigest()
    entry = {key: expected, "bytes": len(data)}
    assert checksum.recorded(entry) == (key, expected)
    assert checksum.checksum(tmp_path / "f", entry) == expected
    (tmp_path / "f").write_bytes(data[:1700] + bytes([data[1700] ^ 1]) + data[1701:])
    assert checksum.checksum(tmp_path / "f", entry) != expected


@pytest.mark.parametrize("run", [RUN, FP8_ZSTD], ids=["bf16", "fp8-zstd"])
def test_shards_written_in_blocks_are_the_same_bytes_and_carry_their_checksum(tmp_path, monkeypatch, run):
    """Blocks of any size (here 100 bytes, which no tensor boundary lines up with) write the same file; the
    checksum the writer reports is the file's."""
    _, whole = write(tmp_path / "whole", BATCHES, shard_bytes=12 * ROW_BYTES, run=run)
    monkeypatch.setattr(checksum, "BLOCK_BYTES", 100)
    written = []
    _, blocks = write(tmp_path / "blocks", BATCHES, shard_bytes=12 * ROW_BYTES, run=run, on_written=written.append)
    assert len(blocks) > 1 and [p.read_bytes() for p in blocks] == [p.read_bytes() for p in whole]
    assert {w.name: w.block_xxh3_128 for w in written} == {p.name: checksum.file_checksum(p) for p in blocks}


def test_a_streamed_shard_writes_each_block_once_its_rows_are_final(tmp_path, monkeypatch):
    """Rows of both states reach the file at their final offsets while the sample still fills: the second
    state no longer waits for the first to be complete (in file order), so the end leaves only the blocks
    of the last rows."""
    monkeypatch.setattr(checksum, "BLOCK_BYTES", 8)  # the rows' bytes are 8-aligned: a block holds no half row
    samples, ids, mask, aux, last = make_batch([0], [12])
    written = []
    writer = ShardWriter(tmp_path, RUN, shard_bytes=4 * ROW_BYTES, on_written=written.append)
    rows = writer.begin_sample(samples[0], ids, mask, WIDTHS, stream=True)
    rows["aux_hidden_states"][:6].copy_(aux[:6])
    rows["hidden_states"][:6].copy_(last[:6])
    writer.filled(6)
    tmp = tmp_path / ".shard_000.safetensors.tmp"
    want = last[:6].contiguous().view(torch.uint8).numpy().tobytes()
    deadline, on_disk = time.monotonic() + 10, b""
    while on_disk != want and time.monotonic() < deadline:
        time.sleep(0.01)
        head = tmp.read_bytes()
        if len(head) >= 8:
            n = int.from_bytes(head[:8], "little")
            if len(head) >= 8 + n:
                a, _ = json.loads(head[8 : 8 + n])["hidden_states"]["data_offsets"]
                on_disk = head[8 + n + a : 8 + n + a + len(want)]
    assert on_disk == want
    rows["aux_hidden_states"][6:].copy_(aux[6:])
    rows["hidden_states"][6:].copy_(last[6:])
    writer.filled(12)
    writer.end_sample()
    (path,) = writer.close()
    assert_tensors_equal(
        open_shard(path).sample(0),
        {
            "input_ids": torch.tensor(ids, dtype=torch.int32),
            "loss_mask": mask.to(torch.uint8),
            "image_mask": torch.zeros(len(ids), dtype=torch.uint8),
            "aux_hidden_states": aux.to(torch.bfloat16),
            "hidden_states": last,
        },
    )
    assert written[0].block_xxh3_128 == checksum.file_checksum(path)


def test_shards_are_written_side_by_side_one_thread_a_file(tmp_path, monkeypatch):
    """A write into a file holds the file's inode lock, so each file has one writing thread, and while one
    shard's writes are held up the next shard is written (a shard's blocks spread over the block threads
    had all waited on that one file, and every later shard behind them: shards went one file at a time)."""
    monkeypatch.setattr(checksum, "BLOCK_BYTES", 64)
    threads_of: dict[str, set[int]] = {}
    second_started = threading.Event()
    first_waited = []
    pwrite = shard_file._pwrite

    def spy(fd, data, offset):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        threads_of.setdefault(name, set()).add(threading.get_ident())
        if name.startswith(".shard_000"):
            first_waited.append(second_started.wait(timeout=5))
        else:
            second_started.set()
        pwrite(fd, data, offset)

    monkeypatch.setattr(shard_file, "_pwrite", spy)
    _, paths = write(tmp_path, BATCHES, shard_bytes=12 * ROW_BYTES, writers=2)
    assert len(paths) > 2
    assert first_waited and all(first_waited), "the second shard was written while the first one's writes waited"
    assert len(threads_of) == len(paths) and all(len(t) == 1 for t in threads_of.values()), threads_of
    assert [info.index for info, _ in iter_samples(tmp_path)] == list(range(9))


def test_the_writer_counts_its_wait_for_buffers_and_times_each_shard(tmp_path, monkeypatch):
    serialize = shard_file.write

    def slow(*args, **kwargs):
        time.sleep(0.2)
        return serialize(*args, **kwargs)

    monkeypatch.setattr(shard_file, "write", slow)
    before = time.perf_counter()
    # One writer thread, two buffers: the third shard's batch waits for the first shard's write.
    writer, paths = write(tmp_path, BATCHES, shard_bytes=10 * ROW_BYTES, writers=1)
    assert len(paths) >= 3
    assert writer.buffer_wait_s >= 0.1
    assert sorted(n for _, _, n in writer.writes) == sorted(p.stat().st_size for p in paths)
    assert all(start >= before and seconds >= 0.2 for start, seconds, _ in writer.writes)


def test_a_shard_that_the_last_batch_completes_is_cut_for_every_thread(tmp_path, monkeypatch):
    """The caller waits for it as for what is left at close: written whole, it was one file written at
    one stream's rate after the last forward."""
    monkeypatch.setattr(writer_module, "LAST_SHARD_PART_BYTES", 4 * ROW_BYTES)
    batch = ([0, 1, 2, 3, 4], [8, 8, 8, 8, 4], 0)  # completes a 32-token shard, 4 tokens left over
    sizes = {}
    for ending in (False, True):
        writer = ShardWriter(tmp_path / str(ending), RUN, shard_bytes=32 * ROW_BYTES, writers=2)
        writer.add_batch(*make_batch(*batch), lengths=batch[1], ending=ending)
        sizes[ending] = [read_header(p).num_tokens for p in writer.close()]
        want = expected_samples([batch])
        assert [info for info, _ in iter_samples(tmp_path / str(ending))] == [want[i][0] for i in range(5)]
    assert sizes == {False: [32, 4], True: [16, 16, 4]}


def test_a_sample_entry_is_its_fields_and_reads_back_as_the_same_sample(tmp_path):
    """The shard's entry of a sample is a copy of its fields, which is dataclasses.asdict's result only while
    every field is a scalar; a field of another kind would need asdict's deep copy."""
    from dataclasses import asdict, fields

    with_images = SampleInfo(7, "chat-7", "c.jsonl", 8, 40, True, images_sha256="ab" * 32)
    for sample in (SampleInfo(3, "doc-3", "c.jsonl", 4, 10, False), with_images):
        assert sample.to_json() == asdict(sample)
        assert SampleInfo(**json.loads(json.dumps(sample.to_json()))) == sample
    assert {f.type for f in fields(SampleInfo)} <= {"int", "str", "bool", "str | None"}
    lengths = [3, 5]
    samples, input_ids, loss_mask, aux, last = make_batch([0, 1], lengths)
    writer = ShardWriter(tmp_path, RUN)
    writer.add_batch([samples[0], with_images], input_ids, loss_mask, aux, last, lengths=lengths)
    writer.close()
    assert read_header(shard_paths(tmp_path)[0]).samples == [samples[0], with_images]
