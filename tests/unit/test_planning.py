import json
import re
import shutil
from collections import namedtuple

import pytest

from extract_runs import ROOT, small_run
from image_chats import PATCH, save_image
from transformers import AutoProcessor, AutoTokenizer

from offline_extract import planning
from offline_extract.data.corpus import BadRecordError
from offline_extract.data.tokenization import SampleTokenizer
from offline_extract.store.schema import Encoding

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


def test_a_json_array_corpus_plans_as_its_jsonl_does_and_names_a_bad_element_by_its_place(tiny_model_dir, tmp_path):
    records = [json.loads(line) for line in CORPUS.read_text().splitlines()]
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps(records[:5] + [{"text": ""}] + records[5:], indent=2))
    tok = SampleTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), max_length=4096)
    p = planning.plan([corpus], tok, tmp_path / "out", hidden_size=64, num_aux_layers=3)
    assert (p.records, p.samples, p.rejected, p.tokens, p.loss_tokens) == (25, 24, 1, 1381, 842)
    assert planning.render(p, tmp_path / "out").splitlines()[1] == (
        f"  rejected {corpus}:6 (id 'corpus.json:6'): text is empty"
    )
    with pytest.raises(BadRecordError, match=rf"^{corpus}:6 \(id 'corpus.json:6'\): text is empty \(--strict stops"):
        planning.plan([corpus], tok, tmp_path / "out", hidden_size=64, num_aux_layers=3, strict=True)


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
    assert (
        not p.writable
        and lines[-1] == "/proc/sys/offline_extract_out cannot be written here (read-only, or no permission)"
    )
    assert planning.plan([corpus], tok, tmp_path / "out", hidden_size=64, num_aux_layers=3).writable


def test_a_compressed_output_too_big_before_zstd_says_how_much_zstd_must_save(tiny_model_dir, tmp_path, monkeypatch):
    tok = SampleTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), max_length=4096)
    fp8_zstd = Encoding("fp8", "zstd")
    roomy = planning.plan([CORPUS], tok, tmp_path, hidden_size=64, num_aux_layers=3, encoding=fp8_zstd)
    # fp8 states, one byte a value, are what zstd compresses; their float32 scales stay raw.
    assert roomy.compressible_bytes == 1381 * (3 * 64 + 64)
    assert roomy.fits and roomy.ratio_needed is None and roomy.refusal(tmp_path) is None
    rest = roomy.total_bytes - roomy.compressible_bytes
    usage = namedtuple("usage", "total used free")

    def free(n: int) -> planning.Plan:
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - n, n))
        return planning.plan([CORPUS], tok, tmp_path, hidden_size=64, num_aux_layers=3, encoding=fp8_zstd)

    # Room for the raw rest and half the states: it fits if zstd halves them, which only the run can tell.
    half = free(rest + roomy.compressible_bytes // 2)
    assert not half.fits and half.ratio_needed == 2.0
    assert "-> fits only if zstd shrinks the states 2.00x or more" in planning.render(half, tmp_path)
    assert "fits in" in half.refusal(tmp_path) and "2.00x" in half.refusal(tmp_path)
    # Not even the raw rest fits: no ratio would do.
    none = free(rest - 1)
    assert none.ratio_needed == float("inf") and "DOES NOT FIT" in planning.render(none, tmp_path)
    assert none.refusal(tmp_path) == f"the output would not fit in {tmp_path}; free space first or pass --force"
    # Uncompressed, the same shortfall is a plain no.
    bf16 = planning.plan([CORPUS], tok, tmp_path, hidden_size=64, num_aux_layers=3)
    assert bf16.ratio_needed is None and "DOES NOT FIT" in planning.render(bf16, tmp_path)


def test_an_nvfp4_plan_counts_its_block_scales_as_compressed_and_lines_up_every_tensors_size(tiny_model_dir, tmp_path):
    tok = SampleTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), max_length=4096)
    p = planning.plan(
        [CORPUS], tok, tmp_path, hidden_size=64, num_aux_layers=3, encoding=Encoding("nvfp4", "zstd", final_store="fp8")
    )
    # Codes two a byte and an e4m3 scale per 16 (aux), fp8 values (final): what zstd frames; token scales stay raw.
    assert p.compressible_bytes == 1381 * (3 * (32 + 4) + 64)
    rows = [line for line in planning.render(p, tmp_path).splitlines() if line.startswith("  ") and "," not in line]
    assert "  aux_hidden_states_block_scale (before zstd)" in rows[1]
    assert len({len(line) for line in rows}) == 1, rows  # every size ends in one column


def _extract(engine, model_dir, out, monkeypatch, progress_every, **options):
    """The run in-process on the session's engine (SGLang starts one engine a process), in shards of about
    60 tokens; the leader's progress counts the records, shown (a heartbeat) or not (progress_every=0)."""
    from offline_extract import extraction

    monkeypatch.setattr(extraction, "Engine", lambda cfg: engine)
    opts = small_run(CORPUS, out, model=str(model_dir), tokens_per_batch=128, progress_every=progress_every, **options)
    return extraction.run(opts)


@pytest.mark.parametrize("progress_every", [1e-6, 0], ids=["heartbeat", "no-progress"])
def test_a_run_warns_once_when_its_output_is_on_course_to_outgrow_the_disk(
    tiny_engine, tiny_model_dir, tmp_path, monkeypatch, capsys, progress_every
):
    warning = re.compile(
        r"warning: at the ([\d,]+) bytes a token written so far, the output needs about .* more and "
        + re.escape(str(tmp_path / "tight"))
        + r" has 1.0 KB free: the run will stop when the disk is full"
    )
    _extract(tiny_engine, tiny_model_dir, tmp_path / "roomy", monkeypatch, progress_every)
    assert "warning:" not in capsys.readouterr().err

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    summary = _extract(tiny_engine, tiny_model_dir, tmp_path / "tight", monkeypatch, progress_every)
    found = warning.findall(capsys.readouterr().err)
    assert len(found) == 1, "once, and the run goes on"
    assert summary.extracted == 24
    # The first shards' bytes a token are the whole output's, up to each shard's metadata.
    assert int(found[0].replace(",", "")) == pytest.approx(summary.bytes_written / summary.tokens, rel=0.1)


def test_writers_sets_the_shard_writer_threads_of_a_run(tiny_engine, tiny_model_dir, tmp_path, monkeypatch):
    """--writers reaches the run's ShardWriter (one file a thread, writers + 1 shard buffers), and the run
    writes every sample with it."""
    from offline_extract import extract_phase

    made = []

    class Recorded(extract_phase.ShardWriter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(kwargs["writers"])

    monkeypatch.setattr(extract_phase, "ShardWriter", Recorded)
    summary = _extract(tiny_engine, tiny_model_dir, tmp_path / "out", monkeypatch, 0, writers=2)
    assert made == [2] and summary.extracted == 24 and len(summary.shards) > 1


def test_a_plan_of_one_sample_says_one_sample(tiny_model_dir, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "fine"}\n{broken\n')
    tok = SampleTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), max_length=4096)
    p = planning.plan([corpus], tok, tmp_path / "out", hidden_size=64, num_aux_layers=3)
    assert planning.render(p, tmp_path / "out").splitlines()[0] == "records 2: 1 sample, 0 skipped, 1 rejected"


def test_a_plan_counts_the_image_tokens_of_image_chats(qwen_vl_dir, tmp_path):
    save_image(tmp_path / "a.png", 2 * PATCH, 2 * PATCH)  # 4 image tokens
    save_image(tmp_path / "b.png", PATCH, 3 * PATCH)  # 3
    chat = [{"from": "human", "value": "<image> and <image>"}, {"from": "gpt", "value": "two"}]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        json.dumps({"conversations": chat, "images": ["a.png", "b.png"]})
        + "\n"
        + json.dumps({"conversations": chat[1:] + chat[1:]})
        + "\n"
    )
    processor = AutoProcessor.from_pretrained(qwen_vl_dir)
    tok = SampleTokenizer(processor.tokenizer, max_length=4096, processor=processor)
    p = planning.plan([corpus], tok, tmp_path / "out", hidden_size=64, num_aux_layers=3)
    assert (p.samples, p.image_samples, p.image_tokens) == (2, 1, 7)
    line = f"  image tokens 7 ({7 / p.tokens:.1%}), in 1 sample with images"
    assert planning.render(p, tmp_path / "out").splitlines()[2] == line
    # A corpus without images says nothing of them.
    assert "image tokens" not in planning.render(
        planning.plan([CORPUS], tok, tmp_path / "out", 64, 3), tmp_path / "out"
    )
