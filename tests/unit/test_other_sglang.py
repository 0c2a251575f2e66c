"""A run records the SGLang and torch versions it ran under in its manifest, and a resume under another SGLang
version is refused, naming both, unless --allow-other-sglang lets it through: the two versions' states differ in
their last bits. In-process, on the session's engine (SGLang starts one a process)."""

import json

import pytest
import torch
from extract_runs import ROOT, small_run

from offline_extract import extraction
from offline_extract.engine.sglang_releases import installed
from offline_extract.store.index import shard_paths
from offline_extract.store.resume import TakeoverError

CORPUS = ROOT / "examples" / "corpus.jsonl"


def _left_running_under(out, version: str) -> None:
    """`out` as a run under SGLang `version` that stopped after writing its shards leaves it."""
    path = out / "manifest.json"
    recorded = json.loads(path.read_text())
    recorded["status"] = "running"
    recorded["identity"]["sglang_version"] = version
    path.write_text(json.dumps(recorded))


def test_a_resume_under_another_sglang_is_refused_naming_both_unless_allowed(tiny_engine, tmp_path, monkeypatch):
    monkeypatch.setattr(extraction, "Engine", lambda cfg: tiny_engine)
    out, now = tmp_path / "out", installed().version
    extraction.run(small_run(CORPUS, out))
    identity = json.loads((out / "manifest.json").read_text())["identity"]
    assert (identity["sglang_version"], identity["torch_version"]) == (now, torch.__version__)

    _left_running_under(out, "0.5.9")
    shards = {path.name: path.read_bytes() for path in shard_paths(out)}
    for attempt in (extraction.run, extraction.dry_run):
        with pytest.raises(TakeoverError) as refused:
            attempt(small_run(CORPUS, out))
        assert str(refused.value) == (
            f"{out} holds shards extracted under SGLang 0.5.9, and this run has SGLang {now}: their states differ "
            f"in the last bits, so the directory would mix two engines' states. Resume under SGLang 0.5.9, choose "
            f"another --out, or pass --allow-other-sglang to resume anyway"
        )
    assert {path.name: path.read_bytes() for path in shard_paths(out)} == shards

    summary = extraction.run(small_run(CORPUS, out, allow_other_sglang=True))
    assert summary.records == 24 and summary.resumed == 24
    recorded = json.loads((out / "manifest.json").read_text())
    assert (recorded["status"], recorded["identity"]["sglang_version"]) == ("complete", now)
