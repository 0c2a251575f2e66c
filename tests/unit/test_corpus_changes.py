"""A corpus file that changes while a run reads it (cut short in place, appended to) is found at the run's end,
fingerprinted again as its identity recorded it at the start: the run is not marked complete for a corpus it
did not read whole, and says what to do. In-process, on the session's engine (SGLang starts one a process)."""

import json
import re
import shutil

import pytest
from extract_runs import ROOT

from offline_extract import extraction
from offline_extract.data.corpus import rows
from offline_extract.options import ExtractOptions
from offline_extract.output import StoppedError

CORPUS = ROOT / "examples" / "corpus.jsonl"


def _opts(corpus, out, **changes):
    return ExtractOptions(
        data=(str(corpus),),
        out=str(out),
        device="cpu",
        parity_samples=0,
        tokens_per_batch=256,
        shard_bytes=32 << 10,
        progress=False,
        progress_every=0,
        **changes,
    )


def _changing(monkeypatch, corpus, change):
    """The run's reader of the corpus's rows, with `change` made to the corpus file once the fifth has been read."""
    read = extraction.rows

    def reading(*args, **kwargs):
        for n, item in enumerate(read(*args, **kwargs)):
            if n == 5:
                change(corpus)
            yield item

    monkeypatch.setattr(extraction, "rows", reading)


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
        extraction.run(_opts(corpus, out))
    message = str(stopped.value)
    assert message.startswith(f"the corpus changed while this run read it:\n  corpus file 1 ({corpus}): bytes ")
    assert re.search(
        rf"\n{re.escape(str(out))} holds the samples of the \d+ records read, which are not the corpus "
        rf"recorded when the run began, so the run is not marked complete. Put the corpus back as it was "
        rf"and re-run the same command to finish it; or, to take the corpus as it is now, re-run with "
        rf"--force",
        message,
    ), message
    assert json.loads((out / "manifest.json").read_text())["status"] == "running"

    # As it says: with --force, the corpus as it is now is taken and the run completes.
    monkeypatch.setattr(extraction, "rows", rows)
    summary = extraction.run(_opts(corpus, out, force=True))
    records = len(corpus.read_text().splitlines())
    assert summary.records == records and json.loads((out / "manifest.json").read_text())["status"] == "complete"


def test_an_unchanged_corpus_is_marked_complete(tiny_engine, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(CORPUS, corpus)
    monkeypatch.setattr(extraction, "Engine", lambda cfg: tiny_engine)
    _changing(monkeypatch, corpus, lambda path: path.touch())  # a new mtime is no change of content
    assert extraction.run(_opts(corpus, tmp_path / "out")).extracted == 24
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["status"] == "complete"
