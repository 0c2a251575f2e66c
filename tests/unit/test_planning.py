import shutil
from collections import namedtuple

from extract_runs import ROOT
from transformers import AutoTokenizer

from offline_extract import planning
from offline_extract.data.tokenization import SampleTokenizer

CORPUS = ROOT / "examples" / "corpus.jsonl"


def test_plan_counts_what_extraction_would_write(tiny_model_dir, tmp_path):
    tok = SampleTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), max_length=4096)
    p = planning.plan([CORPUS], tok, tmp_path / "not-yet", hidden_size=64, num_aux_layers=3)
    # The example corpus under the embedded tokenizer: the same 1,381 tokens bin/extract.py writes for it.
    tokens = 1381
    assert (p.records, p.samples, p.tokens, p.loss_tokens) == (24, 24, tokens, 842)
    assert p.bytes_by_tensor["aux_hidden_states"] == tokens * 3 * 64 * 2
    assert p.bytes_by_tensor["hidden_states"] == tokens * 64 * 2
    assert p.fits and "fits" in planning.render(p, tmp_path)


def test_plan_says_when_output_does_not_fit(tiny_model_dir, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    tok = SampleTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), max_length=4096)
    p = planning.plan([CORPUS], tok, tmp_path, hidden_size=64, num_aux_layers=3)
    assert not p.fits and "DOES NOT FIT" in planning.render(p, tmp_path)


def test_plan_names_the_first_rejects_and_an_output_it_cannot_write(tiny_model_dir, tmp_path):
    corpus = tmp_path / "c.jsonl"
    good = '{"text": "fine"}'
    corpus.write_text("\n".join([good, "{broken", good, *(['{"text": ""}'] * 11)]) + "\n")
    tok = SampleTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), max_length=4096)
    # /proc/sys takes no new files, whoever asks (root included), like a read-only mount.
    p = planning.plan([corpus], tok, "/proc/sys/offline_extract_out", hidden_size=64, num_aux_layers=3)
    assert (p.records, p.rejected, len(p.first_rejects)) == (14, 12, planning.REJECTS_SHOWN)
    lines = planning.render(p, "/proc/sys/offline_extract_out").splitlines()
    assert lines[1].startswith(f"  rejected {corpus}:2: invalid JSON")
    assert lines[2] == f"  rejected {corpus}:4 (id 'c.jsonl:4'): text is empty"
    assert lines[1 + planning.REJECTS_SHOWN] == "  ... and 2 more"
    assert not p.writable and lines[-1] == "/proc/sys/offline_extract_out cannot be written here (read-only, or no permission)"
    assert planning.plan([corpus], tok, tmp_path / "out", hidden_size=64, num_aux_layers=3).writable
