import itertools
import json
import os
import pickle
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from offline_extract.store import checksum, manifest, verdicts
from offline_extract.store.index import iter_samples, shard_paths, write_index
from offline_extract.store.schema import SAMPLE_TENSORS, ShardError
from offline_extract.store.shard import open_shard
from offline_extract.training import datasets
from offline_extract.testing.shards import synthetic_run, write_synthetic
from offline_extract.training.datasets import HiddenStateDataset, HiddenStateIterableDataset, pad_collate

K, H = 3, 8
ROW_BYTES = (K + 1) * H * 2
RUN = synthetic_run((1, 2, 3), H)
LENGTHS = [5, 3, 7, 1, 9, 4, 6, 2, 8, 3, 5, 7, 4]
N = len(LENGTHS)


def write_rank(out_dir, indices, shard_numbers, seed, lengths=LENGTHS):
    """Samples `indices` as one data-parallel rank writes them, in shards of about 12 rows."""
    write_synthetic(
        out_dir,
        [lengths[i] for i in indices],
        hidden_size=H,
        layer_ids=RUN.layer_ids,
        shard_bytes=12 * ROW_BYTES,
        seed=seed,
        indices=indices,
        index=False,
        shard_numbers=shard_numbers,
    )


@pytest.fixture
def out_dir(tmp_path):
    """Two ranks' shards, so sample-index order differs from shard order; with index.json."""
    write_rank(tmp_path, list(range(0, N, 2)), itertools.count(0, 2), seed=0)
    write_rank(tmp_path, list(range(1, N, 2)), itertools.count(1, 2), seed=1)
    write_index(tmp_path)
    assert len(shard_paths(tmp_path)) >= 4
    return tmp_path


def truth(out_dir):
    """Sample id -> tensors as the shard API reads them, in sample-index order."""
    return {info.id: tensors for info, tensors in iter_samples(out_dir)}


def assert_item_matches(item, want):
    assert set(item) == {*SAMPLE_TENSORS, "id"}
    assert item["input_ids"].dtype == torch.int64
    assert torch.equal(item["input_ids"], want["input_ids"].long())
    for name in ("loss_mask", "aux_hidden_states", "hidden_states"):
        assert item[name].dtype == want[name].dtype, name
        assert torch.equal(item[name], want[name]), name
    assert item["aux_hidden_states"].shape == (len(item["input_ids"]), K * H)
    assert item["hidden_states"].shape == (len(item["input_ids"]), H)


@pytest.mark.parametrize("with_index", [True, False])
def test_map_items_equal_the_shards_in_sample_index_order(out_dir, with_index):
    if not with_index:
        (out_dir / "index.json").unlink()
    want = truth(out_dir)
    ds = HiddenStateDataset(out_dir)
    assert len(ds) == N
    assert ds.ids == [f"s{i}" for i in range(N)] == list(want)
    assert ds.run == RUN
    for i, (sample_id, tensors) in enumerate(want.items()):
        item = ds[i]
        assert item["id"] == sample_id
        assert_item_matches(item, tensors)
    assert torch.equal(ds[-1]["hidden_states"], ds[N - 1]["hidden_states"])
    with pytest.raises(IndexError):
        ds[N]


def test_lookup_by_id(out_dir):
    want = truth(out_dir)
    ds = HiddenStateDataset(out_dir)
    assert ds.index_of("s7") == 7
    item = ds.get_by_id("s7")
    assert item["id"] == "s7"
    assert_item_matches(item, want["s7"])
    with pytest.raises(KeyError, match="nope"):
        ds.get_by_id("nope")


class CountingHandle:
    """Records what a reader asks of a safe_open handle."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def metadata(self):
        return self.inner.metadata()

    def get_tensor(self, name):
        self.log.append(("tensor", name))
        return self.inner.get_tensor(name)

    def get_slice(self, name):
        handle = self

        class Slice:
            def __getitem__(self, key):
                handle.log.append(("slice", name, key.start, key.stop))
                return handle.inner.get_slice(name)[key]

        return Slice()


def test_reads_only_the_sample_rows_and_opens_each_shard_once(out_dir, monkeypatch):
    log, opened = [], []
    real = datasets.safe_open

    def counting_open(path, framework):
        opened.append(path)
        return CountingHandle(real(path, framework=framework), log)

    monkeypatch.setattr(datasets, "safe_open", counting_open)
    ds = HiddenStateDataset(out_dir)
    assert opened == []  # the headers build the catalog through read_header, not through the dataset's handles

    where = {}
    for path in shard_paths(out_dir):
        shard = open_shard(path)
        for pos, info in enumerate(shard.samples):
            where[info.id] = (path, shard.offsets[pos], shard.offsets[pos + 1])

    for i in (4, 6, 4):
        log.clear()
        ds[i]
        path, start, stop = where[f"s{i}"]
        reads = [entry for entry in log if entry != ("tensor", "offsets")]
        assert sorted(reads) == sorted(("slice", name, start, stop) for name in SAMPLE_TENSORS)
    assert sorted(opened) == sorted({where["s4"][0], where["s6"][0]})


def test_items_own_storages_of_their_own_size(out_dir):
    # A view of the memory-mapped shard tensor would make torch.save, or a DataLoader worker's result
    # queue, carry the whole shard tensor along with the sample.
    item = HiddenStateDataset(out_dir)[2]
    for name in SAMPLE_TENSORS:
        t = item[name]
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name


def test_pickled_dataset_reopens_its_shards(out_dir):
    ds = HiddenStateDataset(out_dir)
    first = ds[3]
    copy = pickle.loads(pickle.dumps(ds))
    assert torch.equal(copy[3]["aux_hidden_states"], first["aux_hidden_states"])


def test_stale_index_falls_back_to_scanning(out_dir):
    # A shard written after index.json, as by a resumed run.
    write_rank(out_dir, [N], iter([100]), seed=2, lengths=[*LENGTHS, 4])
    with pytest.warns(UserWarning, match="does not match"):
        ds = HiddenStateDataset(out_dir)
    assert ds.ids[-1] == f"s{N}"
    assert len(ds) == N + 1


def _edit_index(out_dir, edit) -> None:
    index = json.loads((out_dir / "index.json").read_text())
    edit(index)
    (out_dir / "index.json").write_text(json.dumps(index))


def _swap_first_two_ids(index) -> None:
    ids = index["samples"]["id"]
    ids[0], ids[1] = ids[1], ids[0]


@pytest.mark.parametrize("dataset", [HiddenStateDataset, HiddenStateIterableDataset])
def test_an_edited_index_serves_each_sample_under_its_own_id_and_is_named(out_dir, dataset):
    want = truth(out_dir)
    _edit_index(out_dir, _swap_first_two_ids)
    with pytest.warns(
        UserWarning,
        match=r"index.json does not match the shards in .*sample position 0 is id 's1' at "
        r"row \d+ of shard \d+ there, where the shards' headers have id 's0'",
    ):
        ds = dataset(out_dir, shuffle=False) if dataset is HiddenStateIterableDataset else dataset(out_dir)
    items = list(ds) if dataset is HiddenStateIterableDataset else [ds["s1"], ds[0]]
    for item in items:
        assert_item_matches(item, want[item["id"]])
    assert items[0]["id"] == ("s0" if dataset is HiddenStateIterableDataset else "s1")


def test_an_index_with_other_rows_or_another_run_is_not_believed(out_dir):
    want = truth(out_dir)
    _edit_index(out_dir, lambda index: index["samples"]["row"].__setitem__(3, 0))
    with pytest.warns(UserWarning, match="sample position 3 is id 's3' at row 0"):
        assert_item_matches(HiddenStateDataset(out_dir)["s3"], want["s3"])
    write_index(out_dir)
    _edit_index(out_dir, lambda index: index["run"].__setitem__("layer_ids", [0, 1, 2]))
    with pytest.warns(UserWarning, match="its run differs from the shards' run"):
        assert HiddenStateDataset(out_dir).run.layer_ids == RUN.layer_ids == (1, 2, 3)


def test_bad_directories(tmp_path):
    with pytest.raises(
        ShardError, match=r"missing does not exist: give an extraction's output directory \(its --out\)$"
    ):
        HiddenStateDataset(tmp_path / "missing")
    (tmp_path / "shard_000.safetensors").write_bytes(b"")
    with pytest.raises(ShardError, match=r"shard_000.safetensors is a file: give an extraction's output directory"):
        HiddenStateDataset(tmp_path / "shard_000.safetensors")
    (tmp_path / "shard_000.safetensors").unlink()
    with pytest.raises(ShardError, match="no shard_"):
        HiddenStateDataset(tmp_path)


@pytest.mark.parametrize("dataset", [HiddenStateDataset, HiddenStateIterableDataset])
def test_an_unfinished_extraction_is_refused_unless_a_partial_read_is_asked_for(out_dir, dataset):
    manifest.consolidate(out_dir, identity={}, status="running")
    with pytest.raises(
        ShardError,
        match=rf"unfinished extraction \(manifest.json status 'running'\): it holds {N} "
        r"samples so far; how many are missing is unknown.*allow_partial=True",
    ):
        dataset(out_dir)
    with pytest.warns(UserWarning, match="unfinished extraction"):
        assert len(dataset(out_dir, allow_partial=True)) == N

    manifest.consolidate(out_dir, status="complete")
    assert len(dataset(out_dir)) == N
    gone = shard_paths(out_dir)[1]
    lost = len(open_shard(gone).samples)
    gone.unlink()
    with pytest.raises(ShardError, match=rf"is missing {gone.name}, listed in manifest.json: {lost} samples? of "):
        dataset(out_dir)


def ids_of(ds, worker=None, monkeypatch=None):
    if worker is not None:
        monkeypatch.setattr(datasets, "get_worker_info", lambda: SimpleNamespace(id=worker[0], num_workers=worker[1]))
    return [item["id"] for item in ds]


def test_iterable_across_two_dataloader_workers_yields_each_sample_once(out_dir):
    want = truth(out_dir)
    ds = HiddenStateIterableDataset(out_dir, seed=3)
    next(iter(ds))  # handles opened in the parent must not be used by forked workers
    items = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert sorted(item["id"] for item in items) == sorted(want)
    for item in items:
        assert_item_matches(item, want[item["id"]])


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("num_workers", [1, 2])
def test_ranks_and_workers_split_without_duplicates(out_dir, monkeypatch, world_size, num_workers):
    seen = []
    for rank in range(world_size):
        ds = HiddenStateIterableDataset(out_dir, seed=1, rank=rank, world_size=world_size)
        rank_ids = []
        for worker in range(num_workers):
            rank_ids += ids_of(ds, (worker, num_workers), monkeypatch)
        assert len(rank_ids) == len(ds)
        seen += rank_ids
    assert sorted(seen) == sorted(f"s{i}" for i in range(N))


def test_drop_last_gives_every_rank_the_same_count(out_dir):
    world_size = 4
    per_rank = [
        list(ids_of(HiddenStateIterableDataset(out_dir, rank=r, world_size=4, drop_last=True)))
        for r in range(world_size)
    ]
    assert [len(ids) for ids in per_rank] == [N // world_size] * world_size
    flat = [i for ids in per_rank for i in ids]
    assert len(set(flat)) == len(flat)


def test_shuffle_is_seeded(out_dir):
    def order(**kwargs):
        return ids_of(HiddenStateIterableDataset(out_dir, **kwargs))

    assert order(seed=0) == order(seed=0)
    assert order(seed=0) != order(seed=1)
    assert sorted(order(seed=0)) == sorted(order(seed=1))
    assert order(shuffle=False) == [f"s{i}" for i in range(N)]
    ds = HiddenStateIterableDataset(out_dir, seed=0)
    ds.set_epoch(1)
    assert ids_of(ds) != order(seed=0)
    assert ids_of(ds) == ids_of(ds)


def test_rank_arguments_are_checked(out_dir):
    with pytest.raises(ValueError, match="rank"):
        HiddenStateIterableDataset(out_dir, rank=2, world_size=2)


def _flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # inside the last sample's states: the header and the size stay as they were
    path.write_bytes(bytes(data))


def _hashed(monkeypatch) -> list[str]:
    """The names of the shards hashed against their recorded checksums from now on."""
    names, real = [], checksum.checksum
    monkeypatch.setattr(checksum, "checksum", lambda path, entry: names.append(Path(path).name) or real(path, entry))
    return names


@pytest.mark.parametrize("dataset", [HiddenStateDataset, HiddenStateIterableDataset])
def test_a_flipped_byte_is_refused_by_default_and_a_good_shard_is_hashed_once(out_dir, dataset, monkeypatch):
    manifest.consolidate(out_dir, identity={}, status="complete")
    paths = shard_paths(out_dir)
    hashed = _hashed(monkeypatch)
    assert len(dataset(out_dir)) == N
    assert sorted(hashed) == sorted(p.name for p in paths)
    hashed.clear()
    assert len(dataset(out_dir)) == N and hashed == [], "a second dataset takes the kept verdicts"

    damaged = paths[2]
    before = damaged.stat()
    _flip_last_byte(damaged)
    os.utime(damaged, ns=(before.st_atime_ns, before.st_mtime_ns))  # the mtime put back: the ctime still moved
    with pytest.raises(
        ShardError, match=rf"{damaged.name}: block_xxh3_128 \w+ differs from manifest.json's.*\nDelete them"
    ):
        dataset(out_dir)
    assert hashed == [damaged.name]
    with pytest.raises(ShardError, match=damaged.name):
        dataset(out_dir)  # a damaged shard is never kept as good
    hashed.clear()
    assert len(dataset(out_dir, verify_checksums=False)) == N and hashed == [], "the opt-out reads unchecked"


def test_kept_verdicts_that_are_damaged_or_stale_are_checked_again(out_dir, monkeypatch):
    manifest.consolidate(out_dir, identity={}, status="complete")
    HiddenStateDataset(out_dir)
    hashed = _hashed(monkeypatch)
    (out_dir / verdicts.VERDICTS_NAME).write_text('{"shard_000.safetensors": {"bytes"')
    HiddenStateDataset(out_dir)
    assert sorted(hashed) == sorted(p.name for p in shard_paths(out_dir))
    hashed.clear()
    recorded = manifest.load(out_dir)
    first = shard_paths(out_dir)[0].name
    recorded["shards"][first][checksum.KEY] = "0" * 64  # the verdict was on another checksum than the one now recorded
    manifest.save(out_dir, recorded)
    with pytest.raises(ShardError, match=rf"{first}: block_xxh3_128 \w+ differs"):
        HiddenStateDataset(out_dir)
    assert hashed == [first]


def test_where_no_verdict_can_be_kept_every_dataset_checks_in_full(out_dir, monkeypatch):
    manifest.consolidate(out_dir, identity={}, status="complete")

    def read_only(path, mode="r", *args, **kwargs):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(verdicts, "open", read_only, raising=False)
    hashed = _hashed(monkeypatch)
    for _ in range(2):
        assert len(HiddenStateDataset(out_dir)) == N
    assert sorted(hashed) == sorted(2 * [p.name for p in shard_paths(out_dir)])
    assert not (out_dir / verdicts.VERDICTS_NAME).exists()


def test_a_directory_without_manifest_is_read_with_a_warning_naming_it(out_dir):
    with pytest.warns(
        UserWarning,
        match=rf"{out_dir} has no manifest.json, which records its shards' checksums: damage "
        r"in them cannot be told",
    ):
        assert len(HiddenStateDataset(out_dir)) == N
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(HiddenStateIterableDataset(out_dir, verify_checksums=False)) == N


def test_items_are_found_by_position_or_id_and_a_wrong_key_says_what_keys_are(out_dir):
    ds = HiddenStateDataset(out_dir)
    assert ds["s3"]["id"] == "s3" and torch.equal(ds["s3"]["input_ids"], ds[3]["input_ids"])
    with pytest.raises(KeyError, match=r"no sample with id 'id'.*ds\[position\] or ds\[sample id\]"):
        ds["id"]


def test_pad_collate_batches_samples_of_different_lengths(out_dir):
    want = truth(out_dir)
    loader = DataLoader(HiddenStateDataset(out_dir), batch_size=4, collate_fn=pad_collate)
    batches = list(loader)
    assert sum(len(b["id"]) for b in batches) == N
    for batch in batches:
        longest = int(batch["lengths"].max())
        assert batch["aux_hidden_states"].shape == (len(batch["id"]), longest, K * H)
        assert batch["aux_hidden_states"].dtype == torch.bfloat16 and batch["input_ids"].dtype == torch.int64
        for j, sample_id in enumerate(batch["id"]):
            n = int(batch["lengths"][j])
            assert n == LENGTHS[int(sample_id[1:])]
            assert batch["attention_mask"][j].tolist() == [1] * n + [0] * (longest - n)
            assert not batch["loss_mask"][j, n:].any() and not batch["hidden_states"][j, n:].any()
            assert torch.equal(batch["hidden_states"][j, :n], want[sample_id]["hidden_states"])
            assert torch.equal(batch["loss_mask"][j, :n], want[sample_id]["loss_mask"])
