"""bin/extract.py end to end on CPU with the embedded tiny model: one process, and torchrun DP=2."""

import gzip
import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from extract_runs import (
    GATE_PARTS,
    REVISION,
    ROOT,
    assert_same_samples,
    extract_command,
    free_port,
    hub_cache,
    run_extract,
    succeeded,
)
from transformers import AutoTokenizer

from offline_extract.data.corpus import Record, read_corpus
from offline_extract.data.tokenization import SampleTokenizer
from offline_extract.engine.sglang_releases import installed
from offline_extract.lifecycle.timings import timing_line
from offline_extract.store import integrity, manifest
from offline_extract.store.index import iter_samples, shard_paths
from offline_extract.store.schema import ShardError
from offline_extract.store.shard import open_shard
from offline_extract.training.datasets import HiddenStateDataset

CORPUS = ROOT / "examples" / "corpus.jsonl"
SINGLE_ARGS = (
    "--data",
    str(CORPUS),
    "--verify",
    "3",
    "--shard-size-mb",
    "0.05",
    "--tokens-per-batch",
    "512",
    "--max-length",
    "512",
)
# Every line a plain run prints is one of ours.
OUR_LINES = re.compile(
    r"^(parity |start-up [\d.]+ s to the first forward:$|  ours |  SGLang's |  parity gate |tail |between forwards, "
    r"|the forwards' thread in |beside it on a core: "
    r"|extract: \d+/24 samples, |records \d+: |tokens [\d,]+: |\d+ new shards, |next: |      python )"
)


@pytest.fixture(scope="module")
def cache_env(tiny_model_dir, tmp_path_factory):
    # The CLI builds the embedded model under OFFLINE_EXTRACT_CACHE; pointing it at a temp dir keeps the
    # tests off the user's cache and proves the build path works from scratch.
    return {"OFFLINE_EXTRACT_CACHE": str(tmp_path_factory.mktemp("cache"))}


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache_env):
    out = tmp_path_factory.mktemp("single") / "out"
    proc = succeeded(run_extract(out, *SINGLE_ARGS, "--progress-every", "0.001", env=cache_env))
    return out, proc


def test_default_run_writes_every_sample_with_its_tokens(single, cache_env):
    out, proc = single
    model_dir = Path(cache_env["OFFLINE_EXTRACT_CACHE"]) / "tiny-llama-v1"
    tok = SampleTokenizer(AutoTokenizer.from_pretrained(model_dir), max_length=4096)
    expected = {r.id: tok(r) for r in read_corpus([CORPUS]) if isinstance(r, Record)}
    got = {info.id: tensors for info, tensors in iter_samples(out)}
    assert set(got) == set(expected) and len(got) == 24
    for sid, sample in expected.items():
        t = got[sid]
        assert t["input_ids"].tolist() == sample.input_ids.tolist()
        assert t["loss_mask"].tolist() == sample.loss_mask.tolist()
        assert t["aux_hidden_states"].dtype == torch.bfloat16
        assert t["aux_hidden_states"].shape == (sample.num_tokens, 3 * 64)
        assert t["hidden_states"].shape == (sample.num_tokens, 64)
        assert torch.isfinite(t["aux_hidden_states"].float()).all()
    assert "records 24: extracted 24, skipped 0, rejected 0, dropped 0" in proc.stderr


def test_records_tokenized_on_processes_of_their_own_give_the_same_samples(single, tmp_path, cache_env):
    # The GPU's default (--tokenizer-processes, default_tokenizer_processes); on CPU a thread's is.
    out = tmp_path / "apart"
    proc = succeeded(run_extract(out, *SINGLE_ARGS, "--tokenizer-processes", "2", env=cache_env))
    assert "records 24: extracted 24, skipped 0, rejected 0, dropped 0" in proc.stderr
    assert_same_samples(single[0], out)
    assert subprocess.run(["pgrep", "-f", "offline_extract.data.tokenizer_processes"]).returncode == 1  # none left
    # Started before SGLang's import and the tokenizer's load, so that their own imports pass beside those.
    marks = manifest.load(out)["timings"]["marks"]
    assert marks["tokenizing processes started"] < min(marks["loading"], marks["tokenizer loading"]), marks


def test_shards_carry_provenance_and_parity(single):
    out, _ = single
    paths = shard_paths(out)
    assert len(paths) > 1, "a 50 KiB shard size must cut several shards"
    run = open_shard(paths[0]).run
    assert run.layer_ids == (1, 3, 4)
    assert run.sglang_capture_points == (2, 4, 5)
    assert "HF output_hidden_states[k+1]" in run.layer_convention
    assert run.final_state == "post-norm" and "after the model's final norm" in run.layer_convention
    assert run.stored_dtype == torch.bfloat16 and run.compute_dtype == "float32" and run.quantization is None
    assert run.sglang_version == installed().version
    for key in ("config_sha256", "weights", "tokenizer_sha256", "chat_template_sha256"):
        assert len(getattr(run, key)) == 64, key
    rows = {r["layer"]: r for r in run.parity}
    assert set(rows) == {"aux 1", "aux 3", "aux 4", "last"}
    assert all(r["ok"] and r["max_rel"] <= 1e-5 for r in rows.values())
    index = json.loads((out / "index.json").read_text())
    assert index["num_samples"] == 24
    assert sorted(s["file"] for s in index["shards"]) == sorted(p.name for p in paths)


def test_a_plain_run_prints_only_its_own_lines_and_parity_before_extraction(single):
    _, proc = single
    lines = proc.stderr.splitlines()
    assert [line for line in lines if not OUR_LINES.match(line)] == []
    kinds = [line.split(" ")[0] for line in lines]
    # The gate's verdict as soon as it is known, then a heartbeat a batch (--progress-every 0.001).
    assert kinds[:4] == ["parity"] * 4 and kinds[4] == "extract:" and kinds.count("parity") == 4
    assert kinds.index("records") > max(i for i, kind in enumerate(kinds) if kind == "extract:")


def test_start_up_and_tail_are_printed_and_kept_in_the_manifest(single):
    out, proc = single
    t = json.loads((out / "manifest.json").read_text())["timings"]
    marks = list(t["marks"].values())
    assert marks == sorted(marks) and marks[0] > 0, "every point counted from the command, in order"
    # torch imported first, then our checks; SGLang imported before the tokenizer starts on its thread. The
    # parity gate's reference weights (--verify) are read on a thread of their own from before SGLang's import.
    preload = ("parity preload started", "parity preload read")
    assert [mark for mark in t["marks"] if mark not in preload][:6] == [
        "importing torch",
        "torch imported",
        "checked",
        "loading",
        "sglang imported",
        "tokenizer loading",
    ]
    assert t["marks"]["checked"] <= t["marks"]["parity preload started"] <= t["marks"]["loading"]
    assert t["marks"]["parity preload read"] <= t["marks"]["verifying"] and t["gate_preload"] == "beside the load"
    assert t["startup_s"] == t["marks"]["first forward"]
    # The parts add up: ours is what SGLang's imports, load and warm-up and the parity gate (--verify) leave.
    sglang = ("torch_import_s", "sglang_import_s", "model_load_s", "warm_up_s")
    assert sum(t[key] for key in sglang) == pytest.approx(t["sglang_s"])
    assert t["ours_s"] + t["sglang_s"] + t["parity_gate_s"] == pytest.approx(t["startup_s"])
    assert t["imports_and_checks_s"] + t["tokenizer_waited_s"] + t["ours_other_s"] == pytest.approx(t["ours_s"])
    assert all(t[key] > 0 for key in (*sglang[:3], "parity_gate_s", "imports_and_checks_s", "tokenizer_s"))
    # The tokenizer loaded beside the model: only the wait for it after the load is ours.
    assert t["tokenizer_beside_load"] and t["marks"]["tokenizer loading"] < t["marks"]["loaded"]
    assert t["tokenizer_waited_s"] == pytest.approx(t["marks"]["tokenizer waited"] - t["marks"]["warm"])
    assert t["to_host_s"] + t["last_shards_s"] + t["rejects_and_index_s"] == pytest.approx(t["tail_s"])
    assert sum(t[key] for key in GATE_PARTS) == pytest.approx(t["parity_gate_s"])
    printed = timing_line(t)  # from the manifest's figures, as the run printed them
    assert f"\n{printed}\n" in proc.stderr
    # A part a line: the one line they made ran to 600 characters (a terminal breaks each to its width).
    assert printed.count("\n") == 7 and max(len(line) for line in printed.splitlines()) <= 220
    line = printed
    assert (
        f"\n  parity gate {t['parity_gate_s']:.1f} s (engine {t['gate_engine_s']:.1f} s; HF: waited "
        f"{t['gate_preload_waited_s']:.1f} s for its weights read beside the load"
    ) in line
    assert f"start-up {t['startup_s']:.1f} s to the first forward:\n  ours {t['ours_s']:.1f} s" in line
    assert f"tokenizer {t['tokenizer_waited_s']:.1f} s waited of its {t['tokenizer_s']:.1f} s beside the load" in line
    assert f"SGLang's {t['sglang_s']:.1f} s (torch import {t['torch_import_s']:.1f} s" in line
    assert f"\ntail {t['tail_s']:.2f} s after the last forward" in line


def test_the_start_up_line_names_the_kernel_prebuild_where_one_ran(single):
    """On CPU nothing is prebuilt (the manifest has no prebuild figures); on a GPU the line says how long
    SGLang's nvcc modules took and how much of it the model load covered."""
    out, _ = single
    t = json.loads((out / "manifest.json").read_text())["timings"]
    assert not [key for key in t if key.startswith("prebuild")] and "prebuild" not in timing_line(t)
    line = timing_line({**t, "prebuild_s": 11.04, "prebuild_during_load_s": 9.51})
    assert f"warm-up {t['warm_up_s']:.1f} s (kernel prebuild 11.0 s, 9.5 s of it during the load)" in line
    # Nor does the CPU engine compile a Triton kernel; a GPU's first run says how many its start-up compiled.
    assert t["triton_compiled"] == 0 and "Triton" not in timing_line(t)
    line = timing_line({**t, "triton_compiled": 19, "triton_compile_s": 28.04})
    assert "(Triton: 19 kernels compiled in 28.0 s)" in line


def test_the_closing_lines_give_the_commands_to_inspect_and_export_the_output_and_they_run(single):
    # The run ended on "1 new shard, 723.5 KB -> out", and the user had to find in the README what came next.
    out, proc = single
    last = proc.stderr.splitlines()[-2:]
    assert last[0].startswith("next: ") and last[1].startswith("      python "), last
    inspect, export = (shlex.split(line.removeprefix("next:").split("  (")[0]) for line in last)
    assert inspect == ["python", str(ROOT / "bin" / "inspect.py"), str(out)]
    assert export == [
        "python",
        str(ROOT / "bin" / "export.py"),
        *("--format", "specforge", str(out), "--to", f"{out}-specforge"),
    ]
    for command in (inspect, export):
        succeeded(subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=600))
    assert (out.parent / f"{out.name}-specforge").is_dir()


def test_a_finished_run_run_again_says_so_without_loading_the_model(single, cache_env):
    out, _ = single
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    # --verbose would show SGLang's start-up, had it started.
    proc = succeeded(run_extract(out, *SINGLE_ARGS, "--verbose", env=cache_env))
    assert proc.stderr.splitlines()[:2] == [
        f"already complete: {out} holds this run's finished output, nothing to extract",
        "records 24: extracted 24 (24 by earlier attempts), skipped 0, rejected 0, dropped 0",
    ]
    assert proc.stderr.splitlines()[2].startswith("next: ") and len(proc.stderr.splitlines()) == 4
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_verbose_shows_the_libraries_loading_a_hub_model_whose_commit_is_recorded(tiny_model_dir, tmp_path, cache_env):
    hub_cache(tmp_path / "hf", "tiny/llama", tiny_model_dir)
    out = tmp_path / "out"
    env = {**cache_env, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    proc = succeeded(
        run_extract(out, "--data", str(CORPUS), "--model", "tiny/llama", "--dtype", "float32", "--verbose", env=env)
    )
    assert [line for line in proc.stderr.splitlines() if not OUR_LINES.match(line)], "nothing but our own lines"
    provenance = {"model_repo_id": "tiny/llama", "model_revision": REVISION}
    assert provenance.items() <= json.loads((out / "manifest.json").read_text())["identity"].items()
    assert provenance.items() <= open_shard(shard_paths(out)[0]).run.to_json().items()


def test_bad_lines_are_recorded_and_good_ones_kept(tmp_path, cache_env):
    lines = CORPUS.read_text().splitlines()[:6]
    bad = ["{not json", '{"messages": [{"role": "bot", "content": "x"}]}', '{"text": ""}']
    corpus = tmp_path / "mixed.jsonl"
    corpus.write_text("\n".join(lines[:2] + bad[:1] + lines[2:4] + bad[1:] + lines[4:]) + "\n")
    out = tmp_path / "out"
    proc = succeeded(run_extract(out, "--data", str(corpus), env=cache_env))
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rejects] == [3, 6, 7]
    assert all(r["source"] == str(corpus) and r["reason"] for r in rejects)
    assert "invalid JSON" in rejects[0]["reason"] and "bot" in rejects[1]["reason"]
    assert len(list(iter_samples(out))) == 6
    assert "records 9: extracted 6, skipped 0, rejected 3, dropped 0" in proc.stderr


@pytest.mark.slow
def test_torchrun_dp2_union_equals_single_process(single, tmp_path, cache_env):
    out1, _ = single
    out2 = tmp_path / "dp2"
    succeeded(
        run_extract(
            out2, "--data", str(CORPUS), "--tokens-per-batch", "512", "--max-length", "512", torchrun=2, env=cache_env
        )
    )
    names = {p.name for p in shard_paths(out2)}
    assert {"shard_000.safetensors", "shard_001.safetensors"} <= names, "both replicas must write"
    assert_same_samples(out1, out2)


def test_help_explains_formats_and_layers():
    proc = succeeded(
        subprocess.run(
            [sys.executable, str(ROOT / "bin" / "extract.py"), "--help"], capture_output=True, text=True, cwd=ROOT
        )
    )
    for needle in ("ShareGPT", "OpenAI", "input_ids", "--layers", "hidden_states[k+1]", "torchrun", "--verify"):
        assert needle in proc.stdout, needle


def test_dry_run_sizes_the_output_and_writes_nothing(tmp_path, cache_env):
    out = tmp_path / "out"
    proc = succeeded(run_extract(out, "--data", str(CORPUS), "--dry-run", env=cache_env))
    assert "records 24: 24 samples, 0 skipped, 0 rejected" in proc.stdout
    assert "aux_hidden_states" in proc.stdout and "fits" in proc.stdout
    assert not out.exists()


def test_a_damaged_checkpoint_index_is_named_with_where_it_breaks_by_the_run_and_the_dry_run(tiny_model_dir, tmp_path):
    # The run stopped on json's bare "Expecting ',' delimiter: line 4 column 5 (char 66)", naming no file; the dry
    # run, which read no weights, said "fits".
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    index = model / "model.safetensors.index.json"
    index.write_text(
        '{\n  "weight_map": {\n    "lm_head.weight": "model.safetensors"\n'
        '    "model.norm.weight": "model.safetensors"\n  }\n}\n'
    )  # a comma left out
    out = tmp_path / "out"
    for dry in ((), ("--dry-run",)):
        proc = run_extract(out, "--model", str(model), "--device", "cpu", "--data", str(CORPUS), *dry)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.splitlines()[-1] == (
            f"Error: {index} is not valid JSON (Expecting ',' delimiter: line 4 column 5 (char 66)): it is damaged, "
            f"or was cut short by an interrupted download or copy. Download or copy it again, then re-run"
        )
        assert not out.exists()


def test_a_pipe_holding_a_record_longer_than_the_tokenizers_maximum_is_extracted_whole(tmp_path, cache_env):
    # Both were lost: the corpus fingerprint read the pipe before the reader did, and transformers'
    # too-long warning went into the shard journal, failing the run at its end.
    lines = CORPUS.read_text().splitlines()[:3] + [json.dumps({"id": "long", "text": "alpha " * 5000})]
    out = tmp_path / "out"
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        extract_command(out, "--data", f"/dev/fd/{read_end}"),
        pass_fds=(read_end,),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **cache_env},
    )
    os.close(read_end)
    with os.fdopen(write_end, "w") as pipe:
        pipe.write("\n".join(lines) + "\n")
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    assert "records 4: extracted 4, skipped 0, rejected 0, dropped 0" in stderr
    recorded = manifest.load(out)
    assert recorded["status"] == "complete" and recorded["result"]["extracted"] == 4
    samples = {info.id: (info, t) for info, t in iter_samples(out)}
    info, t = samples["long"]
    assert info.truncated and t["input_ids"].shape == (4096,)
    assert integrity.verify(out).problems == []


def test_a_pipe_is_refused_where_it_would_be_read_twice(tmp_path, monkeypatch):
    from offline_extract import preflight
    from offline_extract.options import ExtractOptions

    read_end, write_end = os.pipe()
    try:
        with pytest.raises(ValueError, match=rf"--data /dev/fd/{read_end} is a pipe.*--strict reads the corpus"):
            preflight.check(ExtractOptions(data=(f"/dev/fd/{read_end}",), strict=True))
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(ValueError, match="every torchrun rank reads the corpus"):
            preflight.check(ExtractOptions(data=(f"/dev/fd/{read_end}",)))
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_dry_run_refuses_an_out_it_cannot_write(tmp_path, cache_env):
    # /proc/sys takes no new files, whoever asks (root included), like a read-only mount.
    dry = run_extract("/proc/sys/offline_extract_out", "--data", str(CORPUS), "--dry-run", env=cache_env)
    assert dry.returncode == 1 and "Traceback" not in dry.stderr, dry.stderr[-3000:]
    assert "Error: /proc/sys/offline_extract_out cannot be written: its filesystem is read-only" in dry.stderr


def test_a_dry_run_refuses_an_out_another_run_holds_whatever_force_says(tmp_path, cache_env):
    from offline_extract.store import resume

    out = tmp_path / "out"
    out.mkdir()
    held = resume.OutputLock(out)
    try:
        dry = run_extract(out, "--data", str(CORPUS), "--dry-run", "--force", env=cache_env)
    finally:
        held.release()
    assert dry.returncode == 1 and "Traceback" not in dry.stderr, dry.stderr[-3000:]
    assert dry.stdout.splitlines()[-1] == f"{out} is in use by another extraction now: the run would be refused"
    assert f'Error: {out} is in use by another extraction ({{"pid": {os.getpid()}, ' in dry.stderr


@pytest.mark.parametrize(
    "lines, verdict, result",
    [
        (["", "   ", ""], "{corpus} has no records", dict(records=0, skipped=0, rejected=0)),
        (
            ['[{"text": "a JSON array, not JSON lines"}]', "{broken", "\x1f\x8b\x08 gzip bytes"],
            "all 3 records rejected",
            dict(records=3, skipped=0, rejected=3),
        ),
    ],
    ids=["blank", "all-rejected"],
)
def test_a_corpus_without_a_usable_record_says_so_and_completes_the_manifest(
    tmp_path, cache_env, lines, verdict, result
):
    corpus = tmp_path / "blank.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    verdict = verdict.format(corpus=corpus)
    dry = run_extract(out, "--data", str(corpus), "--dry-run", env=cache_env)
    assert dry.returncode == 1 and f"Error: {verdict}" in dry.stderr, dry.stderr[-3000:]
    assert not out.exists()

    proc = run_extract(out, "--data", str(corpus), env=cache_env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    see = f", see {out / 'rejects.jsonl'}" if result["rejected"] else ""
    assert f"Error: {verdict}{see}" in proc.stderr
    assert f"records {result['records']}: extracted 0" in proc.stderr, "the summary is printed"
    recorded = manifest.load(out)
    assert recorded["status"] == "complete"
    assert recorded["result"] == {**result, "dropped": 0, "extracted": 0}
    assert len((out / "rejects.jsonl").read_text().splitlines()) == result["rejected"]
    assert integrity.verify(out).problems == []
    with pytest.raises(ShardError, match="holds no samples"):
        HiddenStateDataset(out)


def test_trim_after_last_loss_token_is_applied_and_recorded(tmp_path, cache_env):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        '{"id": "t", "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},'
        ' {"role": "user", "content": "A closing question that is never answered"}]}\n'
    )
    out = tmp_path / "out"
    succeeded(run_extract(out, "--data", str(corpus), "--trim-after-last-loss-token", env=cache_env))
    ((info, t),) = list(iter_samples(out))
    assert t["loss_mask"][-1] == 1 and info.source_len > t["input_ids"].shape[0]
    assert open_shard(shard_paths(out)[0]).run.trim_after_last_loss_token is True


def test_pre_norm_final_state_passes_the_gate_and_is_recorded(single, tmp_path, cache_env):
    out = tmp_path / "pre"
    succeeded(
        run_extract(
            out,
            "--data",
            str(CORPUS),
            "--verify",
            "2",
            "--final-state",
            "pre-norm",
            "--tokens-per-batch",
            "512",
            "--max-length",
            "512",
            env=cache_env,
        )
    )
    run = open_shard(shard_paths(out)[0]).run
    assert run.final_state == "pre-norm" and "before the model's final norm" in run.layer_convention
    assert {r["layer"]: r["ok"] for r in run.parity}["last (pre-norm)"] is True
    post = {info.id: t for info, t in iter_samples(single[0])}
    for info, t in iter_samples(out):
        assert torch.equal(t["aux_hidden_states"], post[info.id]["aux_hidden_states"])
        # Same model, same batches: only the final state differs, by the norm.
        assert not torch.allclose(t["hidden_states"].float(), post[info.id]["hidden_states"].float(), atol=1e-2)


def test_a_taken_rendezvous_port_is_named_with_the_option_that_moves_it(tmp_path, cache_env):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_extract(tmp_path / "out", "--data", CORPUS, "--port-base", port, env=cache_env)
    assert proc.returncode == 1
    assert f"Error: port {port}, where SGLang's ranks of this replica meet, is taken by another process" in proc.stderr
    assert f"--port-base P gives this run others, P + r for replica r (now P = {port})" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_float32_on_cuda_is_refused_with_what_to_use_instead():
    from offline_extract.preflight import check_dtype

    with pytest.raises(ValueError, match=r"--dtype float32 does not run on CUDA.*--dtype bfloat16.*--device cpu"):
        check_dtype("cuda", "float32")
    check_dtype("cuda:1", "bfloat16")
    check_dtype("cpu", "float32")


def test_a_parquet_file_and_a_cached_hub_data_set_in_one_run(tmp_path, cache_env):
    records = [json.loads(line) for line in CORPUS.read_text().splitlines()[:6]]
    keys = sorted({key for record in records for key in record})
    pq.write_table(
        pa.Table.from_pylist([{key: r.get(key) for key in keys} for r in records[:3]]), tmp_path / "c.parquet"
    )
    hf = tmp_path / "hf"
    snapshot = hf / "hub" / "datasets--org--chats" / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[3:]) + '{"text": ""}\n')
    (hf / "hub" / "datasets--org--chats" / "refs").mkdir()
    (hf / "hub" / "datasets--org--chats" / "refs" / "main").write_text(REVISION)
    out = tmp_path / "out"
    env = {**cache_env, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}
    proc = succeeded(run_extract(out, "--data", str(tmp_path / "c.parquet"), "--data", "org/chats", env=env))
    assert "records 7: extracted 6, skipped 0, rejected 1, dropped 0" in proc.stderr
    assert sorted(info.index for info, _ in iter_samples(out)) == list(range(6))
    (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert (reject["source"], reject["line"], reject["index"], reject["reason"]) == ("org/chats", 4, 6, "text is empty")
    corpus = json.loads((out / "manifest.json").read_text())["identity"]["corpus"]
    assert [c["name"] for c in corpus] == ["c.parquet", REVISION]


@pytest.mark.slow
def test_strict_under_torchrun_reports_the_first_bad_record_in_corpus_order_once(tmp_path, cache_env):
    lines = CORPUS.read_text().splitlines()[:10]
    lines[3] = "{broken"  # record 3: replica 1's
    lines[6] = '{"text": ""}'  # record 6: replica 0's, which the leader would otherwise report
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    proc = run_extract(out, "--data", str(corpus), "--strict", torchrun=2, env=cache_env)
    assert proc.returncode != 0
    assert proc.stderr.count("(--strict stops at the first bad record)") == 1
    assert f"Error: {corpus}:4: invalid JSON" in proc.stderr
    # torchrun prints its own traceback, from wherever it is installed: a venv inside the checkout (as
    # .ci/run makes one) is under ROOT too, so only our package's and scripts' frames count.
    ours = [f'File "{ROOT / part}' for part in ("offline_extract", "bin")]
    assert not any(frame in proc.stderr for frame in ours), "a traceback through our code"
    assert not out.exists()


@pytest.fixture(scope="module")
def stored(tmp_path_factory, cache_env):
    """The first 8 records extracted as bf16, as zstd-compressed fp8 and as zstd-compressed nvfp4 (its final state
    nvfp4 too, the option's default), in the same batches (the other combinations are written and read back in
    test_encodings.py)."""
    corpus = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    corpus.write_text("".join(CORPUS.read_text().splitlines(keepends=True)[:8]))
    outs = {}
    for store, compress in (("bf16", "none"), ("fp8", "zstd"), ("nvfp4", "zstd")):
        out = tmp_path_factory.mktemp(f"{store}-{compress}") / "out"
        succeeded(
            run_extract(
                out,
                "--data",
                str(corpus),
                "--store",
                store,
                "--compress",
                compress,
                "--tokens-per-batch",
                "512",
                "--max-length",
                "512",
                env=cache_env,
            )
        )
        outs[store] = out
    return outs


# Each token's least cosine to the bf16 run's state (the same forward passes), by how the state was stored.
LEAST_COSINE = {"bf16": 1 - 1e-6, "fp8": 0.999, "nvfp4": 0.98}


@pytest.mark.parametrize("store", ["bf16", "fp8", "nvfp4"])
def test_extraction_round_trips_through_reader_export_and_verify(stored, store, tmp_path):
    from offline_extract.training.datasets import HiddenStateDataset
    from offline_extract.training.export import export_specforge, specforge_path

    out = stored[store]
    verify = subprocess.run(
        [sys.executable, str(ROOT / "bin" / "inspect.py"), str(out), "--verify"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert verify.returncode == 0 and "no problems" in verify.stdout, verify.stdout + verify.stderr
    run = open_shard(shard_paths(out)[0]).run
    assert run.store == store and run.compress == ("none" if store == "bf16" else "zstd")
    # Every store keeps the final state in its own encoding unless --final-store says otherwise.
    assert run.final_store is None and run.encoding.store_of("hidden_states") == store
    got, bf16 = HiddenStateDataset(out), HiddenStateDataset(stored["bf16"])
    export_specforge(out, tmp_path / "sf", progress=False)
    for i in range(len(got)):
        item = got[i]
        assert item["id"] == bf16[i]["id"] and torch.equal(item["input_ids"], bf16[i]["input_ids"])
        for name in ("aux_hidden_states", "hidden_states"):
            assert item[name].dtype == torch.bfloat16
            a, b = item[name].float(), bf16[i][name].float()
            layers = a.shape[1] // 64
            cosine = torch.nn.functional.cosine_similarity(a.reshape(-1, layers, 64), b.reshape(-1, layers, 64), dim=-1)
            assert cosine.min() >= LEAST_COSINE[run.encoding.store_of(name)], (item["id"], name)
        # A quantized run exports gzipped by default (export.py: near the run's size instead of decoded bf16's).
        path = specforge_path(tmp_path / "sf", i, gzipped=store != "bf16")
        with gzip.open(path, "rb") if store != "bf16" else open(path, "rb") as f:
            exported = torch.load(io.BytesIO(f.read()), weights_only=True)
        assert torch.equal(exported["aux_hidden_state"][0], item["aux_hidden_states"])
    sizes = {key: sum(p.stat().st_size for p in shard_paths(o)) for key, o in stored.items()}
    # The tiny model's token, 518 bytes in bf16: fp8's 278, 166 under nvfp4 (each of the four states 32 + 4 + 4,
    # the tokens' 6), before zstd; and the shards' metadata.
    assert sizes["fp8"] < 0.6 * sizes["bf16"] and sizes["nvfp4"] < 0.36 * sizes["bf16"], sizes


def test_a_resume_in_another_store_is_refused_writing_nothing(stored, tmp_path, cache_env):
    """Shards of two encodings would not be one data set: the same run in fp8 refuses the nvfp4 output."""
    out = tmp_path / "out"
    shutil.copytree(stored["nvfp4"], out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    corpus = manifest.load(out)["identity"]["corpus"][0]["path"]
    same = ("--tokens-per-batch", "512", "--max-length", "512", "--compress", "zstd")
    refused = run_extract(out, "--data", corpus, *same, "--store", "fp8", env=cache_env)
    assert refused.returncode != 0 and "holds shards of a different run" in refused.stderr, refused.stderr
    assert "store: 'nvfp4' -> 'fp8'" in refused.stderr, refused.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_dflash_recipe_captures_spread_layers_without_final_state_and_skips_short_loss_runs(tmp_path, cache_env):
    from offline_extract.training.datasets import HiddenStateDataset

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        "".join(CORPUS.read_text().splitlines(keepends=True)[:4])
        + '{"id": "scattered", "input_ids": [5, 6, 7, 8, 9], "loss_mask": [1, 0, 1, 0, 1]}\n'
    )
    out = tmp_path / "out"
    succeeded(
        run_extract(
            out,
            "--data",
            str(corpus),
            "--recipe",
            "dflash",
            "--store",
            "fp8",
            "--compress",
            "zstd",
            "--verify",
            "1",
            env=cache_env,
        )
    )
    run = open_shard(shard_paths(out)[0]).run
    assert run.recipe == "dflash" and run.layer_ids == (1, 2, 3, 4, 5) and run.final_state is None
    assert run.min_loss_run == 2
    item = HiddenStateDataset(out)[0]
    assert "hidden_states" not in item and item["aux_hidden_states"].shape[1] == 5 * 64
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["id"], r["kind"]) for r in rejects] == [("scattered", "skipped")]
    assert "consecutive loss tokens is 1" in rejects[0]["reason"]
    identity = json.loads((out / "manifest.json").read_text())["identity"]
    assert (identity["recipe"], identity["store"], identity["compress"]) == ("dflash", "fp8", "zstd")


# bin/extract.py as it runs, with a report of torch's process groups at the very end of the exit (registered
# first, the handler runs last): left to the interpreter's teardown, torch warns on a GPU that
# destroy_process_group() was not called.
_REPORTS_THE_GROUPS_AT_EXIT = """
import atexit, os, sys
sys.path.insert(0, {bin!r})
import _bin_path

def report():
    import torch.distributed as dist
    os.write(2, f"process group at exit: {{dist.is_initialized()}}\\n".encode())

atexit.register(report)
from offline_extract.commands.extract import main
main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [None, 2], ids=["single", "dp2"])
def test_a_run_destroys_its_process_groups_before_it_exits(ranks, tmp_path, cache_env):
    # (TP=2 takes CUDA: tests/gpu covers it.) Other runs on this machine may hold the default ports.
    ports = ("--port-base", free_port()) if ranks else ()
    script = tmp_path / "extract.py"
    script.write_text(_REPORTS_THE_GROUPS_AT_EXIT.format(bin=str(ROOT / "bin")))
    command = [
        part if part != str(ROOT / "bin" / "extract.py") else str(script)
        for part in extract_command(tmp_path / "out", "--data", CORPUS, *ports, torchrun=ranks)
    ]
    proc = succeeded(
        subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **cache_env}, timeout=600)
    )
    reports = re.findall(r"process group at exit: (\w+)", proc.stderr)
    assert reports == ["False"] * (ranks or 1), proc.stderr[-3000:]
    # Promptly: from the manifest's last write ("complete") to the end of every process, torchrun's included.
    manifest_path = tmp_path / "out" / "manifest.json"
    assert json.loads(manifest_path.read_text())["status"] == "complete"
    assert time.time() - manifest_path.stat().st_mtime < 20
