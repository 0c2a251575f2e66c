"""Taking an output directory over in-process: the lock, a crashed run's leftovers, the manifest's journal,
corpus fingerprints, which runs may resume into it, and when it already holds this run's finished output."""

import fcntl
import json
import os
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from extract_runs import hidden_files
from image_chats import save_image
from small_shards import RUN, journal_entry, write_shards

from offline_extract.data import images
from offline_extract.data.corpus import read_corpus
from offline_extract.engine.distributed import Coordinator, Layout
from offline_extract.options import ExtractOptions
from offline_extract.output import OutputDirectory
from offline_extract.store import checksum, manifest, resume
from offline_extract.store.journal import Journal, read_journal
from offline_extract.store.schema import FORMAT_VERSION, SampleInfo
from offline_extract.store.shard import read_header
from offline_extract.store.writer import ShardWriter


def test_writer_threads_checksum_each_shard_as_they_write_it(tmp_path):
    written = []
    paths = write_shards(tmp_path, [[(0, 3)], [(1, 2)], [(2, 5)]], on_written=written.append)
    assert sorted(w.name for w in written) == [p.name for p in paths]
    for w in written:
        path = tmp_path / w.name
        assert (w.block_xxh3_128, w.bytes) == (checksum.file_checksum(path), path.stat().st_size)
        assert (w.num_samples, w.num_tokens) == (1, read_header(path).num_tokens)


def test_take_over_clears_our_leftovers_only_and_numbers_new_shards_above_existing(tmp_path):
    write_shards(tmp_path, [[(0, 2), (2, 2)], [(5, 3)]], numbers=[3, 10])
    # Every temporary our writers leave in --out when killed mid-write (store.atomic), and a replica's rejects.
    leftovers = [
        ".shard_011.safetensors.tmp",
        ".rejects.dp1.jsonl",
        ".index.json.tmp",
        ".manifest.json.tmp",
        ".rejects.jsonl.tmp",
    ]
    # The user's own: take-over deleted every hidden .tmp file in --out, and any named like our temporaries.
    theirs = [
        ".notes.tmp",
        ".shard_011.safetensors.tmp.bak",
        ".shard_notes.tmp",
        ".shard_mine.safetensors.tmp",
        ".rejects.dpnotes.jsonl",
    ]
    # Named like shards, but no run's: they stopped the take-over with "invalid literal for int()".
    copies = ["shard_003 - Copy.safetensors", "shard_abc.safetensors"]
    for name in leftovers + theirs + copies:
        (tmp_path / name).write_text("partial")
    lock, existing = resume.take_over(tmp_path)
    lock.release()
    assert existing.shards == ["shard_003.safetensors", "shard_010.safetensors"]
    assert existing.first_number == 11
    assert existing.notes == [
        f"removed 5 files left by an interrupted run: {', '.join(sorted(leftovers))}",
        f"ignored 2 files in {tmp_path} named like a shard but not shard_<digits>.safetensors, so no run's shard: "
        f"{', '.join(copies)}",
    ]
    assert hidden_files(tmp_path) == sorted(theirs)
    assert all((tmp_path / name).is_file() for name in copies)

    mask = resume.done_mask(tmp_path, existing.shards)
    assert np.flatnonzero(mask).tolist() == [0, 2, 5]
    replica = Layout(rank=2, world_size=4)  # dp 2 of 4
    numbers = resume.shard_numbers(existing.first_number, replica.dp_rank, replica.dp_size)
    assert [n for n, _ in zip(numbers, range(3))] == [13, 17, 21]


def test_a_damaged_shard_stops_a_resume_with_what_to_do(tmp_path):
    (path,) = write_shards(tmp_path, [[(0, 2)]])
    os.truncate(path, 100)
    with pytest.raises(resume.TakeoverError, match="Move or delete it and re-run"):
        resume.done_mask(tmp_path, [path.name])


def test_the_lock_admits_one_holder_at_a_time(tmp_path):
    lock = resume.OutputLock(tmp_path)
    with pytest.raises(resume.TakeoverError, match=rf'in use by another extraction \({{"pid": {os.getpid()}'):
        resume.OutputLock(tmp_path)
    lock.release()
    assert not (tmp_path / resume.LOCK_NAME).exists(), "a finished run leaves no lock file behind"
    resume.OutputLock(tmp_path).release()


def test_a_lock_file_removed_between_open_and_flock_is_not_trusted(tmp_path, monkeypatch):
    """The holder releases (and removes) the file after we opened it: our flock on that orphan would
    exclude no one, so the lock is taken again on the file now at the path."""
    real_flock, locked = fcntl.flock, []

    def flock(f, operation):
        if not locked:
            (tmp_path / resume.LOCK_NAME).unlink()
        locked.append(f)
        return real_flock(f, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    lock = resume.OutputLock(tmp_path)
    assert len(locked) == 2
    assert os.fstat(locked[-1].fileno()).st_ino == (tmp_path / resume.LOCK_NAME).stat().st_ino
    lock.release()


def test_consolidate_trusts_the_shards_on_disk(tmp_path):
    paths = write_shards(tmp_path, [[(0, 2)], [(1, 2)], [(2, 2)], [(3, 2)]])
    manifest.save(tmp_path, {"identity": {}, "shards": {"shard_009.safetensors": {"sha256": "x"}}})
    with Journal(manifest.journal_path(tmp_path, 0)) as journal:
        journal.append(journal_entry(paths[0]))
    with open(manifest.journal_path(tmp_path, 1), "w") as torn:  # killed in the middle of a line
        torn.write(json.dumps(journal_entry(paths[1])) + '\n{"name": "shard_00')
    paths[3].unlink()

    recorded, notes = manifest.consolidate(tmp_path)
    assert list(recorded["shards"]) == [p.name for p in paths[:3]]
    assert recorded["shards"] == {p.name: {k: v for k, v in journal_entry(p).items() if k != "name"} for p in paths[:3]}
    assert "shard_009.safetensors" in notes[0] and paths[2].name in notes[1]
    assert manifest.load(tmp_path) == {"format_version": FORMAT_VERSION, **recorded}
    assert hidden_files(tmp_path) == []


@pytest.mark.parametrize("line", [b'{"a": \n', b'{"a": "\xe9"}\n'])  # cut short; Latin-1, not UTF-8
def test_a_corrupt_journal_line_that_is_not_the_last_is_an_error(line, tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"a": 1}\n' + line + b'{"a": 3}\n')
    with pytest.raises(ValueError, match=f"^{path}: corrupt line 2: "):
        read_journal(path)


def test_corpus_fingerprints_sample_big_files_and_ignore_where_they_live(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "BLOCK_BYTES", 16)  # 16 blocks of 16 bytes: a 1000-byte file is sampled
    data = bytes(random.Random(0).randrange(256) for _ in range(1000))
    a = tmp_path / "a" / "corpus.jsonl"
    b = tmp_path / "b" / "corpus.jsonl"
    for path in (a, b):
        path.parent.mkdir()
        path.write_bytes(data)
    identity = manifest.run_identity(RUN, [a])
    assert manifest.corpus_differences(identity, manifest.run_identity(RUN, [b])) == []

    b.write_bytes(b"X" + data[1:])
    assert "sampled_sha256" in manifest.corpus_differences(identity, manifest.run_identity(RUN, [b]))[0]
    b.write_bytes(data + b"{}\n")
    assert "bytes 1000 -> 1003" in manifest.corpus_differences(identity, manifest.run_identity(RUN, [b]))[0]
    (tmp_path / "c.jsonl").write_bytes(data)
    other = manifest.run_identity(replace(RUN, layer_ids=(2,)), [tmp_path / "c.jsonl"])
    assert manifest.run_differences(identity, other) == ["layer_ids: [1, 3] -> [2]"]
    (diff,) = manifest.corpus_differences(identity, other)
    assert "name 'corpus.jsonl' -> 'c.jsonl'" in diff


def test_a_pipe_is_fingerprinted_without_reading_it_and_never_matches_a_recorded_corpus(tmp_path):
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b'{"text": "a"}\n')
        fingerprint = manifest.file_fingerprint(f"/dev/fd/{read_end}")
        assert os.read(read_end, 100) == b'{"text": "a"}\n', "the records are still there for the reader"
    finally:
        os.close(read_end)
        os.close(write_end)
    assert fingerprint["sampled_sha256"] is None
    identity = {"corpus": [fingerprint]}
    (diff,) = manifest.corpus_differences(identity, identity)
    assert "a pipe, whose records cannot be compared" in diff


def test_force_never_mixes_shards_of_another_model_tokenizer_layers_or_length_policy(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n')
    out = tmp_path / "out"
    write_shards(out, [[(0, 2)]])
    with pytest.raises(resume.TakeoverError, match="no manifest.json records the corpus"):
        resume.check_identity(out, manifest.run_identity(RUN, [corpus]), force=False)
    resume.check_identity(out, manifest.run_identity(RUN, [corpus]), force=True)
    resume.claim(out, manifest.run_identity(RUN, [corpus]))
    before = manifest.load(out)
    for change in ({"layer_ids": (1, 2)}, {"max_length": 7}):
        with pytest.raises(resume.TakeoverError, match="--force cannot mix") as refused:
            resume.check_identity(out, manifest.run_identity(replace(RUN, **change), [corpus]), force=True)
        assert f"{next(iter(change))}: " in str(refused.value)
        assert manifest.load(out) == before, "a refused run writes nothing"

    # Shards without a manifest are judged by their own run metadata.
    (out / manifest.MANIFEST_NAME).unlink()
    with pytest.raises(resume.TakeoverError, match="layer_ids: \\[1, 3\\] -> \\[1, 2\\]"):
        resume.check_identity(out, manifest.run_identity(replace(RUN, layer_ids=(1, 2)), [corpus]), force=True)

    # A grown corpus is what --force is for: the shards stay one data set.
    corpus.write_text('{"text": "a"}\n{"text": "b"}\n')
    with pytest.raises(resume.TakeoverError, match="pass --force"):
        resume.check_identity(out, manifest.run_identity(RUN, [corpus]), force=False)
    notes = resume.check_identity(out, manifest.run_identity(RUN, [corpus]), force=True)
    assert len(notes) == 1 and notes[0].startswith("--force: resuming despite")
    assert manifest.load(out) is None, "the check alone writes nothing"
    resume.claim(out, manifest.run_identity(RUN, [corpus]))
    assert manifest.load(out)["identity"] == manifest.run_identity(RUN, [corpus])


def test_shards_of_another_model_are_refused_naming_both_models(tmp_path):
    # The refusal listed only config_sha256 and weights hashes, which do not say which model wrote the shards.
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n')
    out = tmp_path / "out"
    write_shards(out, [[(0, 2)]])
    resume.claim(out, manifest.run_identity(RUN, [corpus]))
    other = replace(RUN, model="/models/other", config_sha256="c2", weights="w2")
    with pytest.raises(resume.TakeoverError) as refused:
        resume.check_identity(out, manifest.run_identity(other, [corpus]), force=True)
    assert str(refused.value).splitlines()[1:4] == [
        "  model: 'synthetic' -> '/models/other'",
        "  config_sha256: 'c' -> 'c2'",
        "  weights: 'w' -> 'w2'",
    ]
    # The same model copied elsewhere is the same run.
    assert resume.check_identity(out, manifest.run_identity(replace(RUN, model="/copy"), [corpus]), force=False) == []


def test_a_directory_holding_no_complete_shard_is_taken_over(tmp_path):
    """A --strict run that stopped at a bad line wrote no shard; the fixed corpus simply starts again."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("{broken\n")
    out = tmp_path / "out"
    lock, _ = resume.take_over(out)
    resume.check_identity(out, manifest.run_identity(RUN, [corpus]), force=False)
    resume.claim(out, manifest.run_identity(RUN, [corpus]))
    lock.release()

    os.utime(corpus, ns=(0, 0))  # touched, not changed: the same run, taken over without a note
    lock, _ = resume.take_over(out)
    assert resume.check_identity(out, manifest.run_identity(RUN, [corpus]), force=False) == []
    lock.release()

    corpus.write_text('{"text": "fixed"}\n')
    fixed = manifest.run_identity(replace(RUN, layer_ids=(2,)), [corpus])
    lock, _ = resume.take_over(out)
    (note,) = resume.check_identity(out, fixed, force=False)
    resume.claim(out, fixed)
    lock.release()
    assert "holds no complete shard" in note
    assert manifest.load(out)["identity"] == fixed


def _claim_as_a_rerun(out, corpus, force=False) -> None:
    """What a rerun does to `out` before extracting: take it over, then claim it for RUN on `corpus`."""
    lock, existing = resume.take_over(out)
    try:
        layout = Layout(rank=0, world_size=1)
        opts = ExtractOptions(data=(str(corpus),), out=str(out), force=force)
        # The job's claim phase itself, as a job whose model has loaded calls it.
        OutputDirectory(out, layout, Coordinator(layout, "test")).claim(existing, RUN, [corpus], opts)
    finally:
        lock.release()


def test_a_refused_rerun_writes_nothing(tmp_path):
    corpus, other = tmp_path / "c.jsonl", tmp_path / "other.jsonl"
    corpus.write_text('{"text": "a"}\n{"text": "b"}\n')
    other.write_text('{"text": "z"}\n')
    out = tmp_path / "out"
    paths = write_shards(out, [[(0, 2)], [(1, 3)]])
    _claim_as_a_rerun(out, corpus, force=True)  # shards written through the library: no manifest yet
    manifest.consolidate(out, status="complete")

    def files() -> dict:
        return {p.name: p.read_bytes() for p in out.iterdir()}

    # A truncated shard: refused, and the manifest still says complete.
    os.truncate(paths[1], 100)
    before = files()
    with pytest.raises(resume.TakeoverError, match="Move or delete it"):
        _claim_as_a_rerun(out, corpus)
    assert files() == before

    # No manifest, and another corpus: refused, and no manifest written (a reader would take a statusless
    # one for an unfinished run).
    paths[1].unlink()
    (out / manifest.MANIFEST_NAME).unlink()
    before = files()
    with pytest.raises(resume.TakeoverError, match="corpus is not recorded"):
        _claim_as_a_rerun(out, other)
    assert files() == before


def test_a_rerun_of_a_finished_run_rebuilds_a_lost_index_and_refuses_a_damaged_shard(tmp_path):
    paths = write_shards(tmp_path, [[(0, 2)], [(1, 3)]])
    recorded, _ = manifest.consolidate(tmp_path, status="complete")
    assert resume.settle_finished(tmp_path, recorded) == [
        "rebuilt index.json, which was missing or did not describe the shards"
    ]
    index = (tmp_path / "index.json").read_text()
    assert json.loads(index)["num_samples"] == 2
    assert resume.settle_finished(tmp_path, recorded) == [], "a good index is left alone"
    assert (tmp_path / "index.json").read_text() == index
    swapped = json.loads(index)
    swapped["samples"]["id"].reverse()  # same files, sizes and counts: only the headers tell
    (tmp_path / "index.json").write_text(json.dumps(swapped))
    assert resume.settle_finished(tmp_path, recorded) == [
        "rebuilt index.json, which was missing or did not describe the shards"
    ]
    assert (tmp_path / "index.json").read_text() == index

    data = bytearray(paths[1].read_bytes())
    data[-1] ^= 0x01  # a flipped bit in the states: same size, same header
    paths[1].write_bytes(bytes(data))
    with pytest.raises(
        resume.TakeoverError, match=rf"{paths[1].name}: block_xxh3_128 \w+ differs from manifest.json's"
    ) as e:
        resume.settle_finished(tmp_path, recorded)
    assert paths[0].name not in str(e.value) and "Delete the damaged shards and re-run" in str(e.value)


def test_a_resumed_run_of_an_earlier_version_keeps_each_shards_checksum_kind(tmp_path):
    """An earlier version's run recorded `sha256` in manifest.json and `block_sha256` in its journal; the
    resumed run journals its new shard with checksum.KEY. Consolidated, each entry keeps its own kind, and
    each shard is verified (and its damage caught) by that kind."""
    paths = write_shards(tmp_path, [[(0, 2)], [(1, 3)], [(2, 2)]])
    old_entries = [
        {"sha256": checksum.file_checksum(paths[0], "sha256")},
        {"block_sha256": checksum.file_checksum(paths[1], "block_sha256")},
    ]
    for path, entry in zip(paths, old_entries):
        entry.update({k: v for k, v in journal_entry(path).items() if k not in ("name", checksum.KEY)})
    manifest.save(tmp_path, {"identity": {}, "status": "running", "shards": {paths[0].name: old_entries[0]}})
    with Journal(manifest.journal_path(tmp_path, 0)) as journal:
        journal.append({"name": paths[1].name, **old_entries[1]})  # the killed run's last shard
        journal.append(journal_entry(paths[2]))  # the resumed run's first
    recorded, _ = manifest.consolidate(tmp_path, status="complete")
    assert [checksum.recorded(recorded["shards"][p.name])[0] for p in paths] == ["sha256", "block_sha256", checksum.KEY]
    assert resume.settle_finished(tmp_path, recorded) == [
        "rebuilt index.json, which was missing or did not describe the shards"
    ]

    for path in paths:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    with pytest.raises(resume.TakeoverError) as e:
        resume.settle_finished(tmp_path, recorded)
    for path, key in zip(paths, ["sha256", "block_sha256", checksum.KEY]):
        assert f"{path.name}: {key} " in str(e.value)


def test_finished_is_only_a_complete_run_of_the_same_identity_with_its_shards(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n')
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard_000.safetensors").write_bytes(b"x" * 10)
    recorded = replace(RUN, layer_ids=(1, 3, 4), compute_dtype="bfloat16")
    manifest.save(
        out,
        {
            "identity": manifest.run_identity(recorded, [corpus]),
            "status": "complete",
            "shards": {"shard_000.safetensors": {"bytes": 10}},
        },
    )
    known = replace(RUN, layer_ids=None, compute_dtype=None)
    assert resume.finished(out, known, [corpus])["status"] == "complete"  # SGLang's defaults taken as recorded
    assert resume.finished(out, replace(known, layer_ids=(1, 3, 4)), [corpus]) is not None
    assert resume.finished(out, replace(known, layer_ids=(2,)), [corpus]) is None
    assert resume.finished(out, replace(known, max_length=7), [corpus]) is None
    assert resume.finished(out, replace(known, final_state=None), [corpus]) is None, "None is a value here"
    corpus.write_text('{"text": "b"}\n')
    assert resume.finished(out, known, [corpus]) is None
    corpus.write_text('{"text": "a"}\n')
    (out / "shard_000.safetensors").write_bytes(b"x" * 9)
    assert resume.finished(out, known, [corpus]) is None
    (out / "shard_000.safetensors").write_bytes(b"x" * 10)
    manifest.save(out, {**manifest.load(out), "status": "running"})
    assert resume.finished(out, known, [corpus]) is None


def test_finished_takes_the_recorded_tokenizer_only_from_the_same_tokenizer_files(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n')
    out = tmp_path / "out"
    out.mkdir()
    recorded = replace(RUN, tokenizer_sha256="t", chat_template_sha256="c", tokenizer_files="f1")
    manifest.save(out, {"identity": manifest.run_identity(recorded, [corpus]), "status": "complete", "shards": {}})
    known = replace(recorded, tokenizer_sha256=None, chat_template_sha256=None)
    assert resume.finished(out, known, [corpus]) is not None
    assert resume.finished(out, replace(known, tokenizer_files="f2"), [corpus]) is None
    # Then, and only then, the run loads the tokenizer before its model, to let it decide.
    assert resume.tokenizer_decides(out, replace(known, tokenizer_files="f2"))
    assert not resume.tokenizer_decides(out, known)
    assert not resume.tokenizer_decides(out, replace(recorded, tokenizer_files="f2"))
    assert not resume.tokenizer_decides(tmp_path / "elsewhere", replace(known, tokenizer_files="f2"))
    # Loaded after all, the tokenizer decides: the same hashes from other files are the same run.
    assert resume.finished(out, replace(recorded, tokenizer_files="f2"), [corpus]) is not None
    assert resume.finished(out, replace(recorded, tokenizer_files="f2", tokenizer_sha256="u"), [corpus]) is None
    # A tokenizer without a chat template: its hash is None once loaded, and compared as such.
    assert resume.finished(out, replace(recorded, chat_template_sha256=None), [corpus]) is None


def test_a_resume_refuses_kept_samples_whose_images_changed_and_force_lets_them_through(tmp_path):
    corpus_dir, out = tmp_path / "corpus", tmp_path / "out"
    corpus_dir.mkdir()
    for name in ("a.png", "b.png"):
        save_image(corpus_dir / name, 8, 8, seed=len(name))
    chat = [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "a picture"}]
    corpus = corpus_dir / "c.jsonl"
    corpus.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"conversations": chat, "images": ["a.png"]},
                {"text": "no image"},
                {"conversations": chat, "images": ["b.png"]},
            ]
        )
    )
    records = list(read_corpus([corpus]))
    infos = [
        SampleInfo(r.index, r.id, r.source, r.line, 2, False, images.fingerprint(r.images) if r.images else None)
        for r in records
    ]
    vision = replace(RUN, image_processor_sha256="p")
    writer = ShardWriter(out, vision)
    h, k = vision.hidden_size, vision.num_aux_layers
    writer.add_batch(infos, np.arange(6), np.zeros(6), torch.randn(6, k * h), torch.randn(6, h), lengths=[2, 2, 2])
    shards = [p.name for p in writer.close()]
    assert resume.check_images(out, shards, vision.identity(), [corpus], force=False) == []

    save_image(corpus_dir / "b.png", 8, 8, seed=99)  # one image changed, another gone
    (corpus_dir / "a.png").unlink()
    with pytest.raises(resume.TakeoverError) as refused:
        resume.check_images(out, shards, vision.identity(), [corpus], force=False)
    assert str(refused.value).splitlines() == [
        f"{out} holds samples extracted from other images than their records name now, so this run cannot resume "
        f"there (2 kept samples):",
        f"  {corpus}:1 (id 'c.jsonl:1'): images[0] ({corpus_dir / 'a.png'}) not found",
        f"  {corpus}:3 (id 'c.jsonl:3'): its images' bytes differ from those it was extracted from",
        "Put the images back as they were, choose another --out, or pass --force to resume anyway (the kept samples "
        "keep the states of the images they were extracted from)",
    ]
    assert resume.check_images(out, shards, vision.identity(), [corpus], force=True) == [
        "--force: resuming despite 2 kept samples whose images changed"
    ]
    # A rerun of a finished run resumes nothing: --force keeps it as it is, states of the old images and all.
    assert resume.check_images(out, shards, vision.identity(), [corpus], force=True, finished=True) == [
        "--force: the finished run is kept as it is despite 2 samples whose images changed"
    ]
    # Kept text samples alone read no image, and no corpus either.
    assert resume.check_images(out, [], vision.identity(), [tmp_path / "no-such-corpus.jsonl"], force=False) == []


def test_a_rerun_of_a_finished_text_only_run_reads_no_shard_header_for_images(tmp_path, monkeypatch):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n{"text": "b"}\n')
    write_shards(tmp_path, [[(0, 2)], [(1, 3)]])
    counts = {"records": 2, "extracted": 2, "skipped": 0, "rejected": 0, "dropped": 0}
    finished, _ = manifest.consolidate(
        tmp_path, identity=manifest.run_identity(RUN, [corpus]), status="complete", result=counts
    )
    assert finished["identity"]["image_processor_sha256"] is None
    read = []
    monkeypatch.setattr(resume, "read_header", lambda path: read.append(path))
    layout = Layout(rank=0, world_size=1)
    summary = OutputDirectory(tmp_path, layout, Coordinator(layout, "test")).already_complete(
        finished, [corpus], force=False
    )
    assert summary.resumed == 2 and read == []
