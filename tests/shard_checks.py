"""Checks that an output directory holds exactly the samples a ShardWriter was handed, every byte as
handed, read back through the package's own readers (the shard, the index, the training reader and
inspect --verify's check), with the checksums the writer journaled."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from offline_extract.store import checksum, integrity, manifest
from offline_extract.store.index import iter_samples, write_index
from offline_extract.store.schema import SampleInfo
from offline_extract.store.shard import open_shard, read_header
from offline_extract.store.writer import ShardWriter
from offline_extract.training.datasets import HiddenStateDataset


@dataclass
class Fed:
    """A sample as the writer was given it: its entry and the tensors a shard must hold for it."""

    info: SampleInfo
    input_ids: torch.Tensor  # int32, as stored
    loss_mask: torch.Tensor  # uint8, as stored
    staged: dict[str, torch.Tensor]  # the encoding's staged tensors, as stored (before any compression)
    image_mask: torch.Tensor | None = None  # uint8, as stored; None: handed none, stored as zeros

    @property
    def image_mask_stored(self) -> torch.Tensor:
        return torch.zeros_like(self.loss_mask) if self.image_mask is None else self.image_mask


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bit for bit, dtype and shape included (NaN bit patterns and -0.0 too)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    return torch.equal(got.contiguous().reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8))


def expected(want: Fed, decode) -> dict[str, torch.Tensor]:
    """The sample's tensors as a reader returns them: states decoded by `decode`, or as stored (None)."""
    states = decode(want.staged) if decode is not None else want.staged
    return {"input_ids": want.input_ids, "loss_mask": want.loss_mask, "image_mask": want.image_mask_stored, **states}


def assert_sample(got: dict, want: Fed, decode, where: str) -> None:
    wanted = expected(want, decode)
    if got["input_ids"].dtype == torch.int64:  # the training reader widens them
        wanted["input_ids"] = want.input_ids.long()
    assert sorted(k for k in got if k != "id") == sorted(wanted), where
    for name, t in wanted.items():
        assert same(got[name], t), f"{where}: {name} of sample {want.info.index} differs"


def check_shard(path, run, want: list[Fed], shard_bytes: int) -> None:
    """The shard holds the samples `want`, in that order, whole and bit for bit, read one by one and all
    at once; closed as soon as it was full, it holds less than shard_bytes of states without its last."""
    decode = run.encoding.decode
    shard = open_shard(path)
    assert shard.run == run
    assert shard.samples == [f.info for f in want], path.name
    lengths = [len(f.input_ids) for f in want]
    assert shard.offsets == np.cumsum([0, *lengths]).tolist(), path.name
    assert shard.tensor("sample_index").tolist() == [f.info.index for f in want]
    assert (shard.num_tokens - lengths[-1]) * run.encoding.state_bytes_per_token(
        run.num_aux_layers, run.hidden_size
    ) < shard_bytes
    packed = shard.read(0, len(want))
    for name in packed:
        assert same(packed[name], torch.cat([expected(f, decode)[name] for f in want])), (
            f"{path.name}: {name} read whole differs"
        )
    for pos, f in enumerate(want):
        assert_sample(shard.sample(pos), f, decode, f"{path.name} position {pos}")


def check_journal(out, paths) -> None:
    """The writer journaled exactly the shards on disk, each with its file's checksum, size and counts."""
    journaled = manifest.journal_entries(out)
    assert sorted(journaled) == sorted(p.name for p in paths)
    for name, entry in journaled.items():
        path, header = out / name, read_header(out / name)
        assert entry[checksum.KEY] == checksum.file_checksum(path), name
        assert (entry["bytes"], entry["num_samples"], entry["num_tokens"]) == (
            path.stat().st_size,
            len(header.samples),
            header.num_tokens,
        )


def check_finished(out, run, kept: list[Fed], headers=()) -> None:
    """The run's end as the extraction makes it (journals folded into manifest.json, then index.json), and
    the directory read back through inspect --verify's check, the index's and the training reader."""
    decode = run.encoding.decode
    _, notes = manifest.consolidate(out, identity=manifest.identity_of(run.identity(), []), status="complete")
    assert notes == [], "every shard was journaled, none is gone"
    write_index(out, headers)
    report = integrity.verify(out, threads=2)
    assert (report.problems, report.unfinished, report.samples) == ([], [], len(kept))

    if not kept:  # every sample was left out: no shard, which the readers refuse as holding nothing
        return
    by_index = {f.info.index: f for f in kept}
    assert [info.index for info, _ in iter_samples(out)] == sorted(by_index)
    for info, tensors in iter_samples(out):
        assert info == by_index[info.index].info
        assert_sample(tensors, by_index[info.index], decode, f"iter_samples {info.id}")
    data = HiddenStateDataset(out, verify_checksums=True)
    assert data.ids == [by_index[i].info.id for i in sorted(by_index)]
    for i, index in enumerate(sorted(by_index)):
        assert data[i]["id"] == by_index[index].info.id
        assert_sample(data[i], by_index[index], decode, f"dataset item {i}")
        assert_sample(data.stored(i), by_index[index], None, f"dataset stored item {i}")


def check_in_order(run, handed: list[Fed], paths, shard_bytes: int) -> None:
    """The shards `paths`, in shard-number order, hold the samples handed, in the order handed."""
    at = 0
    for path in paths:
        n = len(read_header(path).samples)
        check_shard(path, run, handed[at : at + n], shard_bytes)
        at += n
    assert at == len(handed), f"{len(handed) - at} samples handed over are in no shard"


def check_written(out, run, writer: "KeepingWriter", paths, shard_bytes: int) -> None:
    """Everything `writer` was handed is in its shards `paths` (journaled, in order, bit for bit), and the
    finished directory reads back whole."""
    check_in_order(run, writer.handed, paths, shard_bytes)
    check_journal(out, paths)
    check_finished(out, run, writer.handed, writer.headers)


class KeepingWriter(ShardWriter):
    """A writer that keeps a copy of every sample it is handed, as handed (the feed reuses its staging
    memory at once), to hold the shards against."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handed: list[Fed] = []
        self._begun = None

    def add_staged(self, samples, input_ids, loss_mask, staged, *, lengths, ending=False, image_mask=None):
        start = 0
        for s, n in zip(samples, lengths):
            rows = slice(start, start + n)
            images = None if image_mask is None else torch.as_tensor(image_mask[rows]).to(torch.uint8)
            self.handed.append(
                Fed(
                    s,
                    torch.as_tensor(input_ids[rows]).to(torch.int32),
                    torch.as_tensor(loss_mask[rows]).to(torch.uint8),
                    {name: t[rows].clone() for name, t in staged.items()},
                    images,
                )
            )
            start += n
        super().add_staged(samples, input_ids, loss_mask, staged, lengths=lengths, ending=ending, image_mask=image_mask)

    def begin_sample(self, sample, input_ids, loss_mask, widths, **kwargs):
        rows = super().begin_sample(sample, input_ids, loss_mask, widths, **kwargs)
        self._begun = (sample, input_ids, loss_mask, rows)
        return rows

    def end_sample(self, keep=True, ending=False):
        sample, ids, mask, rows = self._begun
        if keep:  # every row is filled by now
            self.handed.append(
                Fed(
                    sample,
                    torch.as_tensor(ids).to(torch.int32),
                    torch.as_tensor(mask).to(torch.uint8),
                    {name: t.clone() for name, t in rows.items()},
                )
            )
        super().end_sample(keep, ending)
