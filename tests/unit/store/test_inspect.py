import io
import json
import math
import re
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from extract_runs import ROOT
from rich.console import Console

from offline_extract.store import inspection, manifest
from offline_extract.store.index import write_index
from offline_extract.store.schema import ShardError
from offline_extract.testing.shards import synthetic_run, write_samples

SCRIPT = ROOT / "bin" / "inspect.py"
H = 4
RUN = synthetic_run((2, 5), layer_convention="after_layer")
LENGTHS = [3, 3, 4]


def known_tensors():
    """Two aux layers and a last state, all exact in bf16, with a NaN and two Infs planted in layer 5."""
    n = sum(LENGTHS) * H
    layer2 = (torch.arange(n, dtype=torch.float32).reshape(-1, H) - 20) / 4
    layer5 = torch.arange(n, dtype=torch.float32).reshape(-1, H) / 2
    layer5[2, 1] = math.nan
    layer5[7, 0] = math.inf
    layer5[8, 2] = -math.inf
    last = (torch.arange(n, dtype=torch.float32).reshape(-1, H) % 7) - 3
    return layer2, layer5, last


def write_known(out_dir, run=RUN):
    layer2, layer5, last = known_tensors()
    input_ids = np.concatenate([np.arange(n) + 100 * (i + 1) for i, n in enumerate(LENGTHS)])
    loss_mask = np.array([0, 1, 1, 0, 0, 1, 0, 1, 1, 1])
    # Two samples (24 hidden-state bytes per token) fill the first shard; the last goes to a second one.
    paths = write_samples(
        out_dir,
        run,
        LENGTHS,
        input_ids,
        loss_mask,
        torch.cat([layer2, layer5], 1),
        last,
        shard_bytes=6 * (3 * H * 2),
        index=False,
    )
    assert len(paths) == 2
    return out_dir


def expected_stats(x):
    values = x.double().numpy().ravel()
    finite = values[np.isfinite(values)]
    return {
        "count": finite.size,
        "mean": finite.mean(),
        "std": finite.std(),
        "absmax": np.abs(finite).max(),
        "nan": int(np.isnan(values).sum()),
        "inf": int(np.isinf(values).sum()),
    }


def check_summary(summary):
    assert summary["num_shards"] == 2
    assert summary["num_samples"] == 3
    assert summary["num_tokens"] == 10
    assert summary["loss_tokens"] == 6
    assert summary["loss_fraction"] == pytest.approx(0.6)
    assert summary["layer_ids"] == [2, 5]
    assert summary["layer_convention"] == "after_layer"
    assert (summary["stored_dtype"], summary["compute_dtype"]) == ("bfloat16", None)
    assert summary["hidden_size"] == H
    assert [layer["name"] for layer in summary["layer_stats"]] == ["layer 2", "layer 5", "last (post-norm)"]
    for layer, tensor in zip(summary["layer_stats"], known_tensors()):
        want = expected_stats(tensor)
        assert layer["count"] == want["count"]
        assert layer["nan"] == want["nan"]
        assert layer["inf"] == want["inf"]
        for key in ("mean", "std", "absmax"):
            assert layer[key] == pytest.approx(want[key], rel=1e-12), (layer["name"], key)


def test_summary_statistics_stream_over_shards_and_chunks(tmp_path, monkeypatch):
    write_known(tmp_path)
    # Three rows per chunk, so statistics are combined across chunks as well as shards.
    monkeypatch.setattr(inspection, "CHUNK_BYTES", 3 * (3 * H) * 4)
    summary = inspection.summarize(tmp_path)
    check_summary(summary)
    assert [layer["nan"] for layer in summary["layer_stats"]] == [0, 1, 0]
    assert [layer["inf"] for layer in summary["layer_stats"]] == [0, 2, 0]


def test_summary_of_a_single_shard(tmp_path):
    write_known(tmp_path)
    summary = inspection.summarize(tmp_path / "shard_001.safetensors")
    assert (summary["num_shards"], summary["num_samples"], summary["num_tokens"]) == (1, 1, 4)
    assert summary["layer_stats"][2]["mean"] == pytest.approx(expected_stats(known_tensors()[2][6:])["mean"])


@pytest.mark.parametrize(
    "encoding, shown",
    [
        ({"store": "bf16", "compress": "none", "final_state": True}, "bf16, uncompressed"),
        (
            {"store": "fp8", "compress": "zstd", "final_state": False},
            "fp8 (e4m3, a float32 scale per token per layer), zstd, no final state",
        ),
        (
            {"store": "nvfp4", "compress": "zstd", "final_state": True, "final_store": "fp8"},
            "nvfp4 (e2m1 two a byte, an e4m3 scale per 16 and a float32 one per token per layer), the final "
            "state fp8 (e4m3, a float32 scale per token per layer), zstd",
        ),
    ],
)
def test_the_summary_says_in_words_how_the_states_are_stored(tmp_path, encoding, shown):
    # It once printed the encoding's JSON keys and values: "store bf16, compress none, final_state True".
    write_known(tmp_path)
    out = io.StringIO()
    inspection.render_summary({**inspection.summarize(tmp_path), "encoding": encoding}, Console(file=out, width=200))
    row = next(line for line in out.getvalue().splitlines() if "stored as" in line)
    assert row.split("│")[2].strip() == shown


def test_layer_ids_must_match_aux_width(tmp_path):
    write_known(tmp_path, run=replace(RUN, layer_ids=(1, 2, 3)))
    with pytest.raises(ShardError, match="3 layer_ids"):
        inspection.summarize(tmp_path)


def run_script(*args, cwd):
    command = [sys.executable, str(SCRIPT), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd)


def test_script_json_on_a_directory(tmp_path):
    write_known(tmp_path / "out")
    write_index(tmp_path / "out")
    result = run_script(tmp_path / "out", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    check_summary(json.loads(result.stdout))


def test_an_unfinished_extraction_is_summarized_only_when_asked(tmp_path):
    out = write_known(tmp_path / "out")
    manifest.consolidate(out, identity={}, status="running")
    refused = run_script(out, "--json", cwd=tmp_path)
    assert refused.returncode == 1 and "unfinished extraction" in refused.stderr and "--allow-partial" in refused.stderr
    assert inspection.sample_view(out, "s0")["id"] == "s0", "one sample is shown either way"
    partial = run_script(out, "--json", "--allow-partial", cwd=tmp_path)
    assert partial.returncode == 0, partial.stderr
    check_summary(json.loads(partial.stdout))


def test_script_shows_a_sample_as_ids_without_tokenizer(tmp_path):
    write_known(tmp_path)
    result = run_script(tmp_path, "--sample", "s1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "no tokenizer_path" in result.stdout
    assert "200 201 [[202]]" in result.stdout  # piped: the loss token bracketed
    assert "300" not in result.stdout


def test_script_errors_name_what_is_wrong(tmp_path):
    write_known(tmp_path)
    result = run_script(tmp_path, "--sample", "nope", cwd=tmp_path)
    assert result.returncode != 0
    assert "'nope'" in result.stderr and str(tmp_path) in result.stderr
    missing = tmp_path / "missing"
    result = run_script(missing, cwd=tmp_path)
    assert result.returncode != 0
    assert (
        f"{missing} does not exist: give an extraction's output directory (its --out) or one of its shards"
        in result.stderr
    )


def test_a_sample_the_run_left_out_is_said_why(tmp_path):
    # It said only "no sample with id ...", though rejects.jsonl says why.
    write_known(tmp_path)
    rows = [
        {
            "source": "/data/c.jsonl",
            "line": 7,
            "index": 6,
            "id": "too-long",
            "kind": "skipped",
            "reason": "5000 tokens > --max-length 4096",
        },
        {"source": "/data/c.jsonl", "line": 9, "index": 8, "id": None, "kind": "rejected", "reason": "invalid JSON"},
    ]
    # A line cut short, one holding a byte that is not UTF-8 (the whole file's read stopped on it, naming no file),
    # and lines that are JSON but not a reject's fields (each stopped the search with a traceback).
    damaged = (
        b"{damaged\n"
        b'{"source": "/data/c.jsonl", "line": 11, "index": 10, "id": "caf\xe9", "kind": "rejected", "reason": ""}\n'
        b'{"source": "/data/c.jsonl", "line": 12}\n[1, 2]\n7\nnull\n'
        b'{"source": 3, "line": 13, "index": 12, "id": "x", "kind": "rejected", "reason": ""}\n'
    )
    (tmp_path / "rejects.jsonl").write_bytes("".join(json.dumps(row) + "\n" for row in rows).encode() + damaged)
    skipped = run_script(tmp_path, "--sample", "too-long", cwd=tmp_path)
    assert skipped.returncode == 1 and "Traceback" not in skipped.stderr
    assert skipped.stderr.strip() == (
        f"Error: no sample with id 'too-long' in {tmp_path}; rejects.jsonl lists it as "
        f"skipped (/data/c.jsonl:7): 5000 tokens > --max-length 4096"
    )
    unnamed = run_script(tmp_path, "--sample", "c.jsonl:9", cwd=tmp_path)
    assert unnamed.stderr.strip().endswith("rejects.jsonl lists it as rejected (/data/c.jsonl:9): invalid JSON")
    # Where two sources share a file name, that id starts with the source as given.
    as_given = run_script(tmp_path, "--sample", "/data/c.jsonl:9", cwd=tmp_path)
    assert as_given.stderr.strip().endswith("rejects.jsonl lists it as rejected (/data/c.jsonl:9): invalid JSON")
    nowhere = run_script(tmp_path, "--sample", "nope", cwd=tmp_path)
    assert nowhere.returncode == 1 and nowhere.stderr.strip() == f"Error: no sample with id 'nope' in {tmp_path}"


def test_a_sample_is_found_by_its_source_as_shown_and_a_miss_names_the_nearest_ids(tmp_path):
    # The metadata shows the source as --data named it ("synthetic" here, "examples/corpus.jsonl" in a run), but
    # only the id was accepted, and a miss said "no sample" with no hint.
    write_known(tmp_path)
    assert inspection.sample_view(tmp_path, "synthetic:2")["id"] == "s1"
    assert inspection.sample_view(tmp_path, "./synthetic:3")["id"] == "s2"
    with pytest.raises(ShardError, match=r"^no sample with id 's7' in .*\(the nearest: 's0', 's1', 's2'\)$"):
        inspection.sample_view(tmp_path, "s7")
    shown = run_script(tmp_path, "--sample", "synthetic:2", cwd=tmp_path)
    assert shown.returncode == 0 and "sample s1" in shown.stdout, shown.stderr
    missed = run_script(tmp_path, "--sample", "s9", cwd=tmp_path)
    assert missed.returncode == 1
    assert missed.stderr.strip() == f"Error: no sample with id 's9' in {tmp_path} (the nearest: 's0', 's1', 's2')"


def test_a_damaged_index_is_said_in_one_line(tmp_path):
    # A traceback ending in the index's name, or (text not UTF-8) in the decoder's bare "can't decode byte".
    write_known(tmp_path)
    (tmp_path / "index.json").write_bytes(b'{"format_version": 2, "run": "caf\xe9"}')
    result = run_script(tmp_path, cwd=tmp_path)
    assert result.returncode == 1 and result.stderr == (
        f"Error: {tmp_path / 'index.json'} is not valid JSON ('utf-8' codec can't decode byte 0xe9 in position 33: "
        f"invalid continuation byte): delete or restore it\n"
    )


def test_an_edited_index_neither_moves_a_sample_nor_passes_unsaid(tmp_path):
    out = write_known(tmp_path)
    write_index(out)
    index = json.loads((out / "index.json").read_text())
    index["samples"]["id"].reverse()
    (out / "index.json").write_text(json.dumps(index))
    view = inspection.sample_view(out, "s0")
    assert [i for span in view["spans"] for i in span["ids"]] == [100, 101, 102]
    with pytest.warns(UserWarning, match=r"index.json does not match the shards .*sample position 0 is id 's2'"):
        assert inspection.summarize(out)["num_samples"] == 3


def test_sample_view_splits_tokens_by_loss_mask(tmp_path):
    write_known(tmp_path)
    write_index(tmp_path)
    view = inspection.sample_view(tmp_path, "s2")
    assert (view["index"], view["row"], view["num_tokens"], view["loss_tokens"]) == (2, 0, 4, 3)
    assert [(span["loss"], span["ids"], span["text"]) for span in view["spans"]] == [
        (False, [300], None),
        (True, [301, 302, 303], None),
    ]


def test_missing_tokenizer_is_reported(tmp_path):
    write_known(tmp_path, run=replace(RUN, tokenizer_path=str(tmp_path / "gone")))
    view = inspection.sample_view(tmp_path, "s0")
    assert view["tokenizer_note"] == f"tokenizer not found at {tmp_path / 'gone'}; showing token ids"
    assert [span["ids"] for span in view["spans"]] == [[100], [101, 102]]


def test_sample_is_decoded_with_loss_tokens_highlighted(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "how": 3, "are": 4, "you": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")

    write_samples(
        tmp_path / "out",
        replace(RUN, tokenizer_path=str(tmp_path / "tok")),
        [5],
        np.array([1, 2, 3, 4, 5]),
        np.array([0, 0, 1, 1, 1]),
        torch.zeros(5, 2 * H),
        torch.zeros(5, H),
        index=False,
    )

    view = inspection.sample_view(tmp_path / "out", "s0")
    assert view["tokenizer_note"] is None
    spans = [(span["loss"], span["text"]) for span in view["spans"]]
    assert spans == [(False, "hello world"), (True, "how are you")]
    out = io.StringIO()
    inspection.render_sample(view, Console(file=out, force_terminal=True, color_system="standard", width=200))
    assert "\x1b[1;32mhow are you" in out.getvalue()
    assert "\x1b[2mhello world" in out.getvalue()
    # Piped or redirected, the output takes no styles: the loss span is bracketed instead of lost.
    piped = io.StringIO()
    inspection.render_sample(view, Console(file=piped, width=200))
    assert "\x1b" not in piped.getvalue()
    assert "legend: [[loss tokens]] / context\nhello world[[how are you]]\n" in piped.getvalue()


def test_a_file_that_is_not_a_shard_is_rejected(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ShardError, match="notes.txt is not a readable safetensors file"):
        inspection.summarize(tmp_path / "notes.txt")


def test_sample_found_in_a_shard_the_index_does_not_list_yet(tmp_path):
    # A run still writing: index.json was written before shard_002 appeared.
    out = write_known(tmp_path)
    write_index(out)
    layer2, layer5, last = (t[:2] for t in known_tensors())
    write_samples(
        out,
        RUN,
        [2],
        np.array([7, 8]),
        np.array([1, 1]),
        torch.cat([layer2, layer5], 1),
        last,
        indices=[3],
        index=False,
        shard_numbers=iter([2]),
    )
    assert inspection.sample_view(out, "s2")["shard"].endswith("shard_001.safetensors")
    view = inspection.sample_view(out, "s3")
    assert view["shard"].endswith("shard_002.safetensors")
    assert [i for span in view["spans"] for i in span["ids"]] == [7, 8]
    with pytest.raises(ShardError, match="no sample with id 'nope'"):
        inspection.sample_view(out, "nope")


def test_image_tokens_are_counted_in_the_summary_and_the_sample_view(tmp_path):
    layer2, layer5, last = known_tensors()
    input_ids = np.arange(sum(LENGTHS))
    loss_mask = np.array([0, 1, 1, 0, 0, 1, 0, 1, 1, 1])
    image_mask = np.array([1, 0, 0, 1, 1, 0, 0, 0, 0, 0], dtype=np.uint8)  # none in the loss
    write_samples(
        tmp_path, RUN, LENGTHS, input_ids, loss_mask, torch.cat([layer2, layer5], 1), last, image_mask=image_mask
    )
    summary = inspection.summarize(tmp_path)
    assert summary["image_tokens"] == 3
    console = Console(file=io.StringIO(), width=200)
    inspection.render_summary(summary, console)
    assert re.search(r"│ image tokens\s+│ 3\s+│", console.file.getvalue())
    view = inspection.sample_view(tmp_path, "s1")
    assert (view["num_tokens"], view["image_tokens"]) == (3, 2)
    # A text-only output says nothing of images.
    write_known(tmp_path / "text")
    assert inspection.summarize(tmp_path / "text")["image_tokens"] == 0
