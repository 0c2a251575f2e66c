"""A corpus file that changes while a run reads it (cut short in place, appended to) is found at the run's end,
fingerprinted again as its identity recorded it at the start: the run is not marked complete for a corpus it
did not read whole, and says what to do. A corpus that no longer holds the records of samples kept in --out (cut
short, or shards of another run copied in), or a corpus file that cannot be read to its end, refuses the run, and
the directory says so. In-process, on the session's engine (SGLang starts one a process)."""

import gzip
import json
import random
import re
import shutil

import pytest
from click.testing import CliRunner
from extract_runs import ROOT, small_run

from offline_extract import extraction
from offline_extract.commands import inspect
from offline_extract.data.corpus import rows
from offline_extract.data.sources import CorpusReadError
from offline_extract.output import StoppedError
from offline_extract.store.index import shard_paths
from offline_extract.store.resume import TakeoverError
from offline_extract.store.schema import ShardError
from offline_extract.store.shard import read_header
from offline_extract.training.datasets import HiddenStateDataset

CORPUS = ROOT / "examples" / "corpus.jsonl"


def _status(out) -> str:
    return json.loads((out / "manifest.json").read_text())["status"]


def _changing(monkeypatch, corpus, change):
    """The run's reader of the corpus's rows, with `change` made to the corpus file once, when the fifth has been
    read after the directory was claimed: the checks before the model loads read the corpus's head too, and a
    change made then is the corpus the run records."""
    read, attempt = extraction.rows, extraction.Job._attempt
    pending: list = []

    def reading(*args, **kwargs):
        for n, item in enumerate(read(*args, **kwargs)):
            if n == 5 and pending:
                pending.pop()(corpus)
            yield item

    def attempting(job, existing):
        pending.append(change)
        return attempt(job, existing)

    monkeypatch.setattr(extraction, "rows", reading)
    monkeypatch.setattr(extraction.Job, "_attempt", attempting)


def _cut(corpus):
    lines = corpus.read_text().splitlines(keepends=True)
    corpus.write_text("".join(lines[:10]))


def _append(corpus):
    with open(corpus, "a") as f:
        f.write(json.dumps({"text": "appended while the run read the corpus"}) + "\n")


@pytest.mark.parametrize("change", [_cut, _append], ids=["cut short", "appended"])
def test_a_corpus_changed_during_the_run_is_not_marked_complete_and_the_rerun_says_what_to_do(
    change, tiny_engine, tmp_path, monkeypatch
):
    # Cut short in place mid-run it gave 41 of 312 records with exit 0, status complete; appended to, 336
    # samples, and the rerun was then refused as "another corpus" with no word of why.
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(CORPUS, corpus)
    out = tmp_path / "out"
    monkeypatch.setattr(extraction, "Engine", lambda cfg: tiny_engine)
    _changing(monkeypatch, corpus, change)
    with pytest.raises(StoppedError) as stopped:
        extraction.run(small_run(corpus, out))
    message = str(stopped.value)
    assert message.startswith(f"the corpus changed while this run read it:\n  corpus file 1 ({corpus}): bytes ")
    assert re.search(
        rf"\n{re.escape(str(out))} holds the samples of the \d+ records read, which are not the corpus "
        rf"recorded when the run began, so the run is not marked complete. Put the corpus back as it was "
        rf"and re-run the same command to finish it; or, to take the corpus as it is now, re-run with "
        rf"--force",
        message,
    ), message
    assert _status(out) == "running"

    # As it says: with --force, the corpus as it is now is taken and the run completes; where it was cut short,
    # the samples of the records it no longer holds are not taken for its own (test_force_keeps_no_sample_...).
    monkeypatch.setattr(extraction, "rows", rows)
    records = len(corpus.read_text().splitlines())
    if change is _cut:
        with pytest.raises(TakeoverError, match=f"of records past the {records} records its corpus holds now"):
            extraction.run(small_run(corpus, out, force=True))
        assert _status(out) == "refused"
        return
    summary = extraction.run(small_run(corpus, out, force=True))
    assert summary.records == records and _status(out) == "complete"


def test_an_unchanged_corpus_is_marked_complete(tiny_engine, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(CORPUS, corpus)
    monkeypatch.setattr(extraction, "Engine", lambda cfg: tiny_engine)
    _changing(monkeypatch, corpus, lambda path: path.touch())  # a new mtime is no change of content
    assert extraction.run(small_run(corpus, tmp_path / "out")).extracted == 24
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["status"] == "complete"


def _kept_past(out, records: int) -> list:
    return [p for p in shard_paths(out) if any(info.index >= records for info in read_header(p).samples)]


@pytest.mark.parametrize("manifest", [True, False], ids=["resumed", "shards copied into an --out without manifest"])
def test_force_keeps_no_sample_of_a_record_the_corpus_does_not_hold(manifest, tiny_engine, tmp_path, monkeypatch):
    """The corpus cut to its first 5 records, or shards of another run copied in: with --force the run said "records
    5, extracted 5, complete", and the datasets served all 24 samples, 19 of records that were not there."""
    monkeypatch.setattr(extraction, "Engine", lambda cfg: tiny_engine)
    out, first_five = tmp_path / "out", tmp_path / "first_five.jsonl"
    first_five.write_text("".join(CORPUS.read_text().splitlines(keepends=True)[:5]))
    extraction.run(small_run(CORPUS, tmp_path / "whole"))
    if manifest:
        shutil.copytree(tmp_path / "whole", out)
    else:
        out.mkdir()
        for path in shard_paths(tmp_path / "whole"):
            shutil.copy(path, out)
    past = _kept_past(out, 5)
    assert past, "some shard holds records past the fifth"

    with pytest.raises(TakeoverError) as refused:
        extraction.run(small_run(first_five, out, force=True))
    verdict, advice = str(refused.value).split("\n")
    assert verdict.startswith(f"{out} holds 19 samples of records past the 5 records its corpus holds now, in ")
    assert advice.startswith(f"Choose another --out, or move out of {out} every shard holding a sample_index of 5 or ")
    recorded = json.loads((out / "manifest.json").read_text())
    assert (recorded["status"], recorded["result"]["verdict"], recorded["result"]["advice"]) == (
        "refused",
        verdict,
        advice,
    )
    # Not served as the corpus's samples, nor said to be finished by a re-run.
    with pytest.raises(ShardError, match="was refused by its kept samples, which the corpus does not hold"):
        HiddenStateDataset(out)
    checked = CliRunner().invoke(inspect.main, [str(out), "--verify"])
    assert checked.exit_code == 1 and checked.output.endswith(f"{verdict}\n{advice}\n"), checked.output

    # As it says: those shards moved out, the same command extracts the 5 records' samples that they held.
    for path in past:
        path.rename(tmp_path / path.name)
    summary = extraction.run(small_run(first_five, out, force=True))
    assert (summary.records, summary.extracted + summary.resumed, _status(out)) == (5, 5, "complete")
    assert len(HiddenStateDataset(out)) == 5
    assert sorted(info.index for p in shard_paths(out) for info in read_header(p).samples) == [0, 1, 2, 3, 4]


def test_a_corpus_file_that_breaks_off_is_said_to_be_damaged_not_finished_by_a_rerun(
    tiny_engine, tmp_path, monkeypatch
):
    """A .jsonl.gz cut short: the run stopped at its end with the manifest at "running", and inspect then advised a
    re-run, which stopped at the same place."""
    monkeypatch.setattr(extraction, "Engine", lambda cfg: tiny_engine)
    letters = random.Random(0)
    text = "".join(
        json.dumps({"text": " ".join("".join(letters.choices("abcdefghij", k=5)) for _ in range(20))}) + "\n"
        for _ in range(300)
    )
    whole = gzip.compress(text.encode())
    corpus, out = tmp_path / "corpus.jsonl.gz", tmp_path / "out"
    corpus.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CorpusReadError) as stopped:
        extraction.run(small_run(corpus, out))
    verdict = str(stopped.value)
    assert verdict.startswith(f"{corpus} cannot be read past line ") and "a truncated or damaged file?" in verdict
    assert _status(out) == "refused"
    for args in ([str(out)], [str(out), "--verify"]):
        said = CliRunner().invoke(inspect.main, args).output
        assert "was refused by its corpus, which cannot be read to its end" in said and verdict in said, said
        assert "Put a whole copy of the corpus file in its place and re-run the same command with --force" in said
        assert "finish" not in said and "interrupted" not in said, said
