"""Checks made before the engine starts: bad options, models and devices are refused in the process's
first seconds, before SGLang is imported or the output directory is touched, and --dry-run refuses
exactly what the real run refuses, in the same words."""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from extract_runs import REVISION, ROOT, hub_cache
from image_chats import PATCH, save_image
from small_shards import write_shards
from transformers import AutoProcessor

from offline_extract import extraction, hub, planning, preflight
from offline_extract.data.corpus import BadRecordError, Reject, read_corpus
from offline_extract.default_model import TINY_VERSION
from offline_extract.engine.sglang_releases import installed
from offline_extract.testing.models import ARCHITECTURES, build_model
from offline_extract.options import ExtractOptions
from offline_extract.store import manifest, resume

CORPUS = str(ROOT / "examples" / "corpus.jsonl")

# Each is refused with a message holding the needle (the tiny model has 8 decoder layers, context 4096).
REFUSED = {
    "layer past the end": ({"layers": (99,)}, "layer id 99 is out of range: ids are 0..6"),
    "the last layer": ({"layers": (7,)}, "layer id 7 is out of range"),
    "a negative layer": ({"layers": (-1,)}, "layer id -1 is out of range"),
    "duplicate layers": ({"layers": (1, 1, 2)}, "--layers has duplicate ids: [1, 1, 2]"),
    "no layers": ({"layers": ()}, "--layers needs at least one layer id"),
    # The dry run passed it, and said "fits".
    "more tensor-parallel ranks than processes": (
        {"tp": 3},
        "--tp 3 must divide the processes per node (1): a TP group has to stay inside one node",
    ),
    "no sequences a batch": ({"seqs_per_batch": 0}, "--seqs-per-batch must be at least 1, got 0"),
    "no tokens a batch": ({"tokens_per_batch": 0}, "--tokens-per-batch must be at least 1, got 0"),
    "negative verify": ({"parity_samples": -3}, "--verify must be at least 0, got -3"),
    "no memory for the engine": (
        {"mem_fraction_static": 0.0},
        "--mem-fraction-static is a fraction of the GPU's memory, above 0 and at most 1, got 0.0",
    ),
    "a percentage for a fraction": ({"mem_fraction_static": 85.0}, "above 0 and at most 1, got 85.0"),
    "longer than the context": ({"max_length": 5000}, "--max-length 5000 is longer than the model's context of 4096"),
    "a missing directory": ({"model": "/models/nope"}, "no model directory at /models/nope"),
    "a port past the last": ({"port_base": 70000}, "--port-base is a TCP port, from 1 to 65535, got 70000"),
    "a negative port": ({"port_base": -5}, "--port-base is a TCP port, from 1 to 65535, got -5"),
    "an unknown attention backend": (
        {"attention_backend": "flash"},
        f"--attention-backend flash is not one of SGLang {installed().version}'s: triton, ",
    ),
    "an unknown load format": (
        {"load_format": "safetensor"},
        f"--load-format safetensor is not one of SGLang {installed().version}'s: auto, ",
    ),
    "a final store without a final state": (
        {"recipe": "dflash", "final_store": "fp8"},
        "--recipe dflash stores no final state, so --final-store fp8 has no effect",
    ),
    "a gate on random weights": (
        {"load_format": "dummy", "parity_samples": 2},
        "--verify 2 compares the states with HF on the model's own weights, but --load-format dummy",
    ),
}
if not torch.cuda.is_available():
    REFUSED["cuda without a GPU"] = ({"device": "cuda"}, "--device cuda, but torch sees no CUDA GPU")


@pytest.fixture(autouse=True)
def tiny_model_cache(tiny_model_dir, tmp_path_factory, monkeypatch):
    cache = tmp_path_factory.getbasetemp() / "preflight-cache"
    if not cache.exists():
        cache.mkdir()
        (cache / f"tiny-llama-v{TINY_VERSION}").symlink_to(tiny_model_dir)
    monkeypatch.setenv("OFFLINE_EXTRACT_CACHE", str(cache))


@pytest.mark.parametrize("case", REFUSED)
def test_the_real_run_and_the_dry_run_refuse_alike_before_touching_the_output(case, tmp_path, monkeypatch):
    changes, needle = REFUSED[case]
    opts = ExtractOptions(data=(CORPUS,), out=str(tmp_path / "out"), **changes)
    monkeypatch.setattr(extraction, "Engine", lambda cfg: pytest.fail("the engine was started"))
    with pytest.raises(Exception) as real:
        extraction.run(opts)
    with pytest.raises(Exception) as dry:
        extraction.dry_run(opts)
    assert needle in str(real.value)
    assert (type(dry.value), str(dry.value)) == (type(real.value), str(real.value))
    assert not (tmp_path / "out").exists()  # no .lock, no running manifest


@pytest.mark.parametrize(
    "out, needle",
    [
        ("", "--out is empty: name the output directory (it is made if it does not exist)"),
        ("{file}", "--out {file} is a file, not a directory"),
        ("{file}/sub/out", "--out {file}/sub/out cannot be made: {file} is a file, not a directory"),
    ],
)
def test_an_out_that_cannot_be_a_directory_is_refused_by_the_real_and_the_dry_run(out, needle, tmp_path, monkeypatch):
    # An empty --out once wrote the whole run into the current directory; a file on its path failed the
    # real run with a bare errno, while --dry-run said it fits.
    file = tmp_path / "notes.txt"
    file.write_text("a file, not a directory")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(extraction, "Engine", lambda cfg: pytest.fail("the engine was started"))
    opts = ExtractOptions(data=(CORPUS,), out=out.format(file=file))
    for attempt in (extraction.run, extraction.dry_run):
        with pytest.raises(ValueError) as refused:
            attempt(opts)
        assert str(refused.value) == needle.format(file=file)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(
    "out, needle",
    [
        ("a", "a is a symbolic link that loops (a -> b -> a)"),
        ("a/sub", "a is a symbolic link that loops (a -> b -> a)"),
        ("gone", "gone is a symbolic link to nowhere, which does not exist"),
    ],
)
def test_an_out_through_a_broken_symbolic_link_is_refused_by_the_real_and_the_dry_run(
    out, needle, tmp_path, monkeypatch
):
    # A loop passed --dry-run ("fits"); the real run failed with "[Errno 17] File exists", which says no loop.
    monkeypatch.chdir(tmp_path)
    os.symlink("b", "a")
    os.symlink("a", "b")
    os.symlink("nowhere", "gone")
    monkeypatch.setattr(extraction, "Engine", lambda cfg: pytest.fail("the engine was started"))
    opts = ExtractOptions(data=(CORPUS,), out=out)
    for attempt in (extraction.run, extraction.dry_run):
        with pytest.raises(ValueError) as refused:
            attempt(opts)
        assert str(refused.value) == (
            f"--out {out} cannot be made: {needle}. Remove the link, or point it at a directory"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "gone"]


@pytest.mark.parametrize(
    "text, why",
    [
        (b'{"name": "my-site", "files": ["index.html"]}', "it has no format_version and no shards key"),
        (b'{"format_version": 9, "shards": {}}', "its format_version is 9, where this version reads 1 or 2 or 3"),
        (b'{"format_version": 2, "shards": ["a"]}', "its shards are a JSON list, not an object"),
        (b'["a", "b"]', "it holds a JSON list, not an object"),
        (
            b'{"format_version": 2, "sha',
            "it is not valid JSON (Unterminated string starting at: line 1 column 23 (char 22))",
        ),
        (
            b'{"name": "caf\xe9"}',
            "it is not valid JSON ('utf-8' codec can't decode byte 0xe9 in position 13: invalid continuation byte)",
        ),  # Latin-1
    ],
)
def test_an_out_holding_a_manifest_no_run_wrote_is_refused_by_the_real_and_the_dry_run(
    text, why, tmp_path, monkeypatch
):
    # Another tool's manifest.json (an existing folder named by mistake) was merged into the run's: its keys kept,
    # the run's added, the file overwritten; --dry-run said it fits.
    out = tmp_path / "site"
    out.mkdir()
    (out / "manifest.json").write_bytes(text)
    monkeypatch.setattr(extraction, "Engine", lambda cfg: pytest.fail("the engine was started"))
    opts = ExtractOptions(data=(CORPUS,), out=str(out))
    for attempt in (extraction.run, extraction.dry_run):
        with pytest.raises(ValueError) as refused:
            attempt(opts)
        assert str(refused.value).startswith(
            f"--out {out}: {out / 'manifest.json'} is not a manifest offline_extract wrote: {why}. A run neither builds "
            f"on nor overwrites a manifest it did not write, so nothing there was touched: choose a new or empty "
            f"directory for --out"
        )
    assert [(p.name, p.read_bytes()) for p in out.iterdir()] == [("manifest.json", text)]


@pytest.mark.parametrize("names", [("index.json",), ("rejects.jsonl",), ("index.json", "rejects.jsonl")])
def test_an_out_holding_an_index_or_rejects_that_no_run_wrote_is_refused_by_the_real_and_the_dry_run(
    names, tmp_path, monkeypatch
):
    # A run overwrote them at its end: a folder named by mistake lost its own index.json.
    out = tmp_path / "site"
    out.mkdir()
    for name in names:
        (out / name).write_text('{"pages": ["home"]}\n')
    monkeypatch.setattr(extraction, "Engine", lambda cfg: pytest.fail("the engine was started"))
    opts = ExtractOptions(data=(CORPUS,), out=str(out))
    it = "it" if len(names) == 1 else "them"
    for attempt in (extraction.run, extraction.dry_run):
        with pytest.raises(ValueError) as refused:
            attempt(opts)
        assert str(refused.value) == (
            f"--out {out} holds {' and '.join(names)} but neither manifest.json nor shards: no run wrote {it}, and "
            f"this one would overwrite {it}. Choose a new or empty directory for --out"
        )
    assert sorted((p.name, p.read_text()) for p in out.iterdir()) == [(name, '{"pages": ["home"]}\n') for name in names]


def test_weight_files_the_index_lists_but_lacks_are_refused_all_named_before_the_model_loads(
    tiny_model_dir, tmp_path, monkeypatch
):
    # An interrupted download of a sharded checkpoint: every check passed, then SGLang's load failed on the
    # first missing file with a raw traceback.
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tensors = sorted(load_file(model / "model.safetensors").items())
    (model / "model.safetensors").unlink()
    names = [f"model-{i:05d}-of-00008.safetensors" for i in range(1, 9)]
    weight_map = {}
    for i, name in enumerate(names):
        part = dict(tensors[i::8])
        save_file(part, str(model / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index = model / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in names[1:]:
        (model / name).unlink()
    monkeypatch.setattr(extraction, "Engine", lambda cfg: pytest.fail("the engine was started"))
    out = tmp_path / "out"
    opts = ExtractOptions(data=(CORPUS,), out=str(out), model=str(model))
    refusal = (
        f"{index} lists 7 weight files that {model} lacks: {', '.join(names[1:6])} and 2 more. The download "
        f"or copy did not finish: download or copy the model again (a Hugging Face download fetches only what "
        f"is missing), then re-run"
    )
    for attempt in (extraction.run, extraction.dry_run):
        with pytest.raises(FileNotFoundError) as refused:
            attempt(opts)
        assert str(refused.value) == refusal
    assert not out.exists()


@pytest.mark.parametrize("damage", ["weights cut short", "index cut short"])
def test_damaged_weights_are_refused_by_the_dry_run_as_by_the_real_run(damage, tiny_model_dir, tmp_path, monkeypatch):
    # The dry run read the weights only where --out held shards: it said "fits" for a checkpoint the real run refuses.
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    if damage == "weights cut short":
        damaged = model / "model.safetensors"
        os.truncate(damaged, damaged.stat().st_size - 1000)
    else:
        damaged = model / "model.safetensors.index.json"
        damaged.write_text('{"metadata": {}, "weight_map": {"lm_head.weight": "model.saf')
    monkeypatch.setattr(extraction, "Engine", lambda cfg: pytest.fail("the engine was started"))
    opts = ExtractOptions(data=(CORPUS,), out=str(tmp_path / "out"), model=str(model))
    with pytest.raises(ValueError) as real:
        extraction.run(opts)
    with pytest.raises(ValueError) as dry:
        extraction.dry_run(opts)
    assert str(real.value).startswith(f"{damaged} ")
    assert (type(dry.value), str(dry.value)) == (type(real.value), str(real.value))
    assert not (tmp_path / "out").exists()


def test_the_weights_fingerprint_hashes_each_files_name_size_and_safetensors_header(tiny_model_dir, tmp_path):
    # Recomputed here from the files' bytes as _weights_fingerprint's docstring defines it: every recorded run's
    # manifest identity holds this value, so a change to how it is computed must leave it as it was.
    import hashlib

    from safetensors.torch import load_file, save_file

    def fingerprint(model: Path) -> str:
        h = hashlib.sha256()
        for f in sorted(p for p in model.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth")):
            raw = f.read_bytes()
            h.update(f.name.encode() + len(raw).to_bytes(8, "little"))
            if f.suffix == ".safetensors":
                h.update(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        return h.hexdigest()

    assert extraction._weights_fingerprint(tiny_model_dir) == fingerprint(tiny_model_dir)
    sharded = tmp_path / "model"  # two safetensors files and a .bin beside them
    shutil.copytree(tiny_model_dir, sharded)
    tensors = sorted(load_file(sharded / "model.safetensors").items())
    (sharded / "model.safetensors").unlink()
    for i in range(2):
        save_file(dict(tensors[i::2]), str(sharded / f"model-{i + 1:05d}-of-00002.safetensors"))
    (sharded / "training_args.bin").write_bytes(b"pickled options")
    assert extraction._weights_fingerprint(sharded) == fingerprint(sharded)
    assert fingerprint(sharded) != fingerprint(tiny_model_dir)


def test_a_dry_run_refuses_an_out_holding_another_runs_shards_as_the_real_run_will(tmp_path, monkeypatch):
    # It said "fits", exit 0, where the real run refuses once its model has loaded.
    out = tmp_path / "out"
    opts = ExtractOptions(data=(CORPUS,), out=str(out), layers=(0, 2))
    checked = preflight.check(opts)
    # What the run records once loaded: the facts known before, and those the engine and tokenizer decide.
    ran = replace(
        extraction._known_before_loading(opts, checked),
        compute_dtype="float32",
        tokenizer_sha256="t",
        chat_template_sha256="c",
    )
    write_shards(out, [[(0, 2)]])
    resume.claim(out, manifest.run_identity(ran, checked.corpus_paths))
    recorded = manifest.load(out)
    monkeypatch.setattr(extraction, "Engine", lambda cfg: pytest.fail("the engine was started"))

    assert extraction.dry_run(opts).samples == 23, "sample 0 is kept"
    assert extraction.dry_run(replace(opts, layers=None)).samples == 23  # SGLang's default: known only once loaded
    for change, line in (
        ({"layers": (1, 3, 4)}, "layer_ids: [0, 2] -> [1, 3, 4]"),
        ({"max_length": 1024}, "max_length: 4096 -> 1024"),
        ({"store": "fp8", "force": True}, "store: 'bf16' -> 'fp8'"),
        ({"store": "nvfp4", "force": True}, "store: 'bf16' -> 'nvfp4'"),
        ({"final_store": "nvfp4", "force": True}, "final_store: None -> 'nvfp4'"),
    ):
        with pytest.raises(resume.TakeoverError) as refused:
            extraction.dry_run(replace(opts, **change))
        assert f"{out} holds shards of a different run" in str(refused.value) and line in str(refused.value)
    assert manifest.load(out) == recorded


def test_a_dry_run_into_this_runs_finished_output_says_the_run_would_extract_nothing(tmp_path):
    # It sized the whole corpus and said "fits", as if the run would extract it again.
    out = tmp_path / "out"
    opts = ExtractOptions(data=(CORPUS,), out=str(out))
    checked = preflight.check(opts)
    fingerprint = extraction.sample_tokenizer(opts, checked.model.path).fingerprint()
    ran = replace(
        extraction._known_before_loading(opts, checked), layer_ids=(1, 3, 4), compute_dtype="float32", **fingerprint
    )
    write_shards(out, [[(0, 2)]])
    resume.claim(out, manifest.run_identity(ran, checked.corpus_paths))
    assert not extraction.dry_run(opts).finished, "an unfinished run is resumed, not complete"
    manifest.consolidate(out, identity=manifest.run_identity(ran, checked.corpus_paths), status="complete")
    plan = extraction.dry_run(opts)
    assert plan.finished and plan.refusal(out) is None
    assert planning.render(plan, out).splitlines()[-1] == (
        f"{out} already holds this run's finished output: running it extracts nothing"
    )
    grown = tmp_path / "grown.jsonl"
    grown.write_text(Path(CORPUS).read_text() + '{"text": "one more"}\n')
    assert not extraction.dry_run(replace(opts, data=(str(grown),), force=True)).finished, "records to add"


def test_a_dry_run_after_a_crash_says_what_is_kept_and_sizes_what_is_left(tmp_path, monkeypatch):
    # It printed the whole corpus's total and "fits", never that samples were kept and the run would resume.
    out = tmp_path / "out"
    opts = ExtractOptions(data=(CORPUS,), out=str(out))
    checked = preflight.check(opts)
    ran = replace(
        extraction._known_before_loading(opts, checked),
        layer_ids=(1, 3, 4),
        compute_dtype="float32",
        tokenizer_sha256="t",
        chat_template_sha256="c",
    )
    whole = extraction.dry_run(opts)
    write_shards(out, [[(0, 2), (1, 3)], [(5, 2)]])
    resume.claim(out, manifest.run_identity(ran, checked.corpus_paths))  # status running: a crashed attempt
    monkeypatch.setattr(extraction, "Engine", lambda cfg: pytest.fail("the engine was started"))
    plan = extraction.dry_run(opts)
    assert (plan.records, plan.kept, plan.kept_shards, plan.samples) == (24, 3, 2, 21)
    kept_tokens = sum(s.num_tokens for s in _samples(opts, checked, {0, 1, 5}))
    assert plan.tokens == whole.tokens - kept_tokens and plan.total_bytes < whole.total_bytes
    lines = planning.render(plan, out).splitlines()
    assert lines[0] == "records 24: 3 kept, 21 samples to extract, 0 skipped, 0 rejected"
    assert lines[-1] == (
        f"{out} holds 3 samples of an earlier attempt in 2 complete shards: the run resumes, "
        f"extracting the 21 samples left (sized above)"
    )


def _samples(opts, checked, indices):
    tokenizer = extraction.sample_tokenizer(opts, checked.model.path)
    return [tokenizer(r) for r in read_corpus(opts.data) if r.index in indices]


def test_a_dry_run_refuses_an_out_another_live_run_holds_in_the_real_runs_words(tmp_path, monkeypatch):
    # It said "fits", exit 0, where the real run is turned away at once.
    out = tmp_path / "out"
    out.mkdir()
    opts = ExtractOptions(data=(CORPUS,), out=str(out))
    monkeypatch.setattr(extraction, "Engine", lambda cfg: pytest.fail("the engine was started"))
    held = resume.OutputLock(out)  # another open file description: to flock, another holder
    try:
        with pytest.raises(resume.TakeoverError) as real:
            extraction.run(opts)
        plan = extraction.dry_run(opts)
        assert plan.in_use == str(real.value) and f'"pid": {os.getpid()}' in plan.in_use
        assert planning.render(plan, out).splitlines()[-1] == (
            f"{out} is in use by another extraction now: the run would be refused"
        )
    finally:
        held.release()
    assert extraction.dry_run(opts).in_use is None
    # Left by a run killed with SIGKILL: the kernel dropped its lock, and the real run takes the directory.
    (out / resume.LOCK_NAME).write_text('{"pid": 1}')
    assert extraction.dry_run(opts).in_use is None
    assert [(p.name, p.read_text()) for p in out.iterdir()] == [(resume.LOCK_NAME, '{"pid": 1}')], "writes nothing"


def test_every_replicas_port_must_be_a_tcp_port(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(
        ValueError,
        match=r"^--port-base is a TCP port, from 1 to 65532 for 4 data-parallel replicas "
        r"\(each uses port-base \+ its rank\), got 65533$",
    ):
        preflight.check(ExtractOptions(data=(CORPUS,), tp=2, port_base=65533))
    preflight.check(ExtractOptions(data=(CORPUS,), tp=2, port_base=65532))


def test_the_embedded_model_runs_on_the_cpu_unless_told_otherwise(tiny_model_dir, monkeypatch):
    # As the README's main command and --model's help say; on a GPU machine it went to CUDA.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert preflight.check(ExtractOptions(data=(CORPUS,))).device == "cpu"
    assert preflight.check(ExtractOptions(data=(CORPUS,), model=str(tiny_model_dir))).device == "cuda"
    assert preflight.check(ExtractOptions(data=(CORPUS,), device="cuda")).device == "cuda"


def test_a_cpu_run_never_asks_the_cuda_driver_and_hides_the_gpus_in_its_checks(tiny_model_dir, monkeypatch):
    # The driver reads CUDA_VISIBLE_DEVICES once, when first asked: a CPU run that asked it first could no longer
    # hide the GPUs from SGLang (sglang_adapter.hide_gpus).
    def asked():
        raise AssertionError("a CPU run asked the CUDA driver")

    monkeypatch.setattr(torch.cuda, "is_available", asked)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert preflight.resolve_device(None, embedded_model=True) == "cpu"
    assert preflight.resolve_device("cpu") == "cpu"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert preflight.check(ExtractOptions(data=(CORPUS,))).device == "cpu"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert preflight.check(ExtractOptions(data=(CORPUS,), model=str(tiny_model_dir))).device == "cuda"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0", "a GPU run keeps its GPUs"


def test_refusals_come_before_sglang_or_transformers_is_imported(tmp_path):
    # A fresh interpreter, since this one may have imported SGLang for other tests.
    script = f"""
import sys
from offline_extract import extraction
from offline_extract.options import ExtractOptions
for changes in {[changes for changes, _ in REFUSED.values()]!r}:
    try:
        extraction.run(ExtractOptions(data=({CORPUS!r},), out={str(tmp_path / "out")!r}, **changes))
    except Exception as e:
        print(type(e).__name__, e)
    else:
        raise SystemExit(f"{{changes}} was not refused")
for heavy in ("sglang", "transformers"):
    assert not any(m == heavy or m.startswith(heavy + ".") for m in sys.modules), heavy + " was imported"
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("\n") == len(REFUSED)
    assert not (tmp_path / "out").exists()


def test_an_architecture_without_a_capture_rule_is_refused_from_its_config_alone(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel .* is not supported.*LlamaForCausalLM"):
        preflight.check(ExtractOptions(data=(CORPUS,), model=str(tmp_path)))


@pytest.mark.parametrize("changes", [{"store": "nvfp4", "final_store": "bf16"}, {"final_store": "nvfp4"}])
def test_nvfp4_is_refused_for_a_hidden_size_its_blocks_do_not_divide(changes, tiny_model_dir, tmp_path):
    # 72 wide, 6 heads of 12: a real checkpoint of that width, whose weights agree with its config.
    model = build_model(
        "llama",
        tmp_path / "m",
        overrides={"hidden_size": 72, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12},
        tokenizer_dir=tiny_model_dir,
    )
    option = "--store" if "store" in changes else "--final-store"
    with pytest.raises(
        ValueError, match=rf"{option} nvfp4 scales blocks of 16 elements, but .*config.json gives a hidden size of 72"
    ):
        preflight.check(ExtractOptions(data=(CORPUS,), model=str(model), **changes))
    preflight.check(ExtractOptions(data=(CORPUS,), model=str(tiny_model_dir), **changes))  # 64: four blocks


@pytest.mark.parametrize("arch", [*ARCHITECTURES, "kimi_k25", "llama4"])
def test_a_config_read_as_written_agrees_with_transformers(arch, tiny_model_dir, tmp_path, monkeypatch):
    model_dir = build_model(arch, tmp_path / arch, weights=False, tokenizer_dir=tiny_model_dir)

    def outcome():
        try:
            return preflight.resolve_model(str(model_dir))
        except NotImplementedError as e:  # an architecture refused by name, either way
            return str(e)

    as_written = outcome()
    # Without the fields the checks read, transformers supplies the model: the same facts must come out.
    monkeypatch.setattr(preflight, "CONTEXT_KEYS", ())
    assert outcome() == as_written


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 1e6},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 1024,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "rope_theta": 5e5,
        },
    ],
)
def test_rope_parameters_as_transformers_5_writes_them_are_read_without_it(rope, tiny_model_dir, tmp_path, monkeypatch):
    # Every checkpoint transformers 5 saves spells RoPE's settings so: they sent the checks through
    # transformers' config classes, seconds of imports (7-9 s of a real 135M model's start-up on the H200).
    model_dir = build_model("llama", tmp_path / "llama", weights=False, tokenizer_dir=tiny_model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    script = f"""
import sys
from pathlib import Path
from offline_extract import preflight
print(preflight.read_model(Path({str(model_dir)!r})).context_length)
assert not any(m.startswith("transformers.models") for m in sys.modules), "transformers' config classes were imported"
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    monkeypatch.setattr(preflight, "CONTEXT_KEYS", ())  # without the fields the checks read: transformers' reading
    assert int(proc.stdout) == preflight.resolve_model(str(model_dir)).context_length


def test_fields_left_to_transformers_defaults_take_them(tiny_model_dir, tmp_path):
    model_dir = build_model("qwen3", tmp_path / "qwen3", weights=False, tokenizer_dir=tiny_model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    del config["max_position_embeddings"]
    (model_dir / "config.json").write_text(json.dumps(config))
    # Qwen3Config's default, which SGLang sees too (its own fallback for a config without one is 2048).
    assert preflight.resolve_model(str(model_dir)).context_length == 32768


def test_context_length_follows_rope_scaling_as_sglang_reads_it(tiny_model_dir, tmp_path):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}))
    assert preflight.resolve_model(str(model)).context_length == 4 * config["max_position_embeddings"]
    assert preflight.resolve_model(str(tiny_model_dir)).context_length == config["max_position_embeddings"]


def test_strict_dry_run_stops_at_the_first_bad_record_like_the_real_run(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": ""}\n{broken\n')
    first_bad = next(r for r in read_corpus([corpus]) if isinstance(r, Reject))
    with pytest.raises(BadRecordError) as e:
        extraction.dry_run(ExtractOptions(data=(str(corpus),), out=str(tmp_path / "out"), strict=True))
    assert str(e.value) == str(BadRecordError(first_bad))
    assert str(e.value).startswith(f"{corpus}:2 (id 'c.jsonl:2'): text is empty")
    plan = extraction.dry_run(ExtractOptions(data=(str(corpus),), out=str(tmp_path / "out")))
    assert (plan.samples, plan.rejected) == (1, 2)


def test_the_passes_through_the_corpus_before_any_forward_show_their_progress(tmp_path, capsys, monkeypatch):
    """--dry-run and --strict read and tokenize the whole corpus before any forward: minutes on a large one, shown
    as the extraction's progress is (a line every --progress-every seconds here), not passed in silence."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "one two"}\n{"text": "three"}\n{"text": ""}\n{"text": "four"}\n')
    beat = re.compile(r"^(dry run|--strict check): (\d)(?:/4)? samples, (\d+) tokens, ", re.M)
    shown = {"progress": False, "progress_every": 1e-9}
    plan = extraction.dry_run(ExtractOptions(data=(str(corpus),), out=str(tmp_path / "out"), **shown))
    beats = beat.findall(capsys.readouterr().err)
    assert beats[-1] == ("dry run", "4", str(plan.tokens))
    assert [done for _, done, _ in beats] == sorted(done for _, done, _ in beats)
    monkeypatch.setattr(extraction, "Engine", lambda cfg: pytest.fail("the engine was started"))
    with pytest.raises(BadRecordError):
        extraction.run(ExtractOptions(data=(str(corpus),), out=str(tmp_path / "out"), strict=True, **shown))
    beats = beat.findall(capsys.readouterr().err)
    assert beats and beats[-1][:2] == ("--strict check", "3")  # up to the bad record, where it stops
    # --no-progress with --progress-every 0: none.
    extraction.dry_run(ExtractOptions(data=(str(corpus),), out=str(tmp_path / "out"), progress=False, progress_every=0))
    assert not beat.findall(capsys.readouterr().err)


def test_a_hub_id_resolves_through_the_local_cache_to_its_commit(offline_hub, tiny_model_dir):
    hub_cache(offline_hub, "tiny/llama", tiny_model_dir)
    model = preflight.resolve_model("tiny/llama")
    assert model.path == offline_hub / "hub" / "models--tiny--llama" / "snapshots" / REVISION
    assert model.provenance == {"model_repo_id": "tiny/llama", "model_revision": REVISION}
    assert model.num_layers == 8


def test_an_uncached_hub_id_offline_fails_in_one_line(offline_hub):
    with pytest.raises(hub.HubError) as e:
        preflight.resolve_model("nobody/nothing")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("no model directory at nobody/nothing, and model nobody/nothing is not in the local")
    assert message.endswith("HF_HUB_OFFLINE is set")


def test_a_cached_config_without_weights_is_no_model(offline_hub, tiny_model_dir, tmp_path):
    # What an earlier AutoConfig.from_pretrained leaves in the cache.
    (tmp_path / "config-only").mkdir()
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config-only")
    hub_cache(offline_hub, "tiny/llama", tmp_path / "config-only")
    with pytest.raises(hub.HubError, match="incomplete snapshot of model tiny/llama, and HF_HUB_OFFLINE is set"):
        preflight.resolve_model("tiny/llama")


@pytest.mark.parametrize(
    "name, is_id",
    [
        ("Qwen/Qwen3-8B", True),
        ("gpt2", True),
        ("/models/nope", False),
        ("./m", False),
        ("~/m", False),
        ("a/b/c", False),
        ("../m", False),
    ],
)
def test_paths_are_never_taken_for_hub_ids(name, is_id):
    assert hub.looks_like_repo_id(name) is is_id


def test_a_damaged_config_or_saved_data_set_is_named(tmp_path):
    from offline_extract.data.sources import CorpusReadError, open_source

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(ValueError) as refused:
        preflight.read_model(model)
    # It advised deleting it, as for a file of ours that a re-run writes again: a model's is fetched again.
    assert str(refused.value) == (
        f"{model / 'config.json'} is not valid JSON (Expecting property name enclosed in double quotes: line 1 column "
        f"41 (char 40)): it is damaged, or was cut short by an interrupted download or copy. Download or copy it "
        f"again, then re-run"
    )
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_dict.json").write_text("{")
    with pytest.raises(CorpusReadError, match=rf"{saved / 'dataset_dict.json'} is damaged"):
        open_source(str(saved))


def test_a_vision_language_model_tokenizes_with_its_processor_or_is_refused_naming_what_is_missing(
    tiny_model_dir, qwen_vl_dir, tmp_path
):
    model = tmp_path / "vl"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vision_config": {"depth": 1}}))
    opts = ExtractOptions(data=(CORPUS,), model=str(model))
    with pytest.raises(ValueError) as refused:
        extraction.sample_tokenizer(opts, model)
    assert str(refused.value) == (
        f"{model} is a vision-language model (its config.json has a vision_config), but AutoProcessor finds no image "
        f"processor there (preprocessor_config.json or processor_config.json, and its tokenizer files)"
    )
    AutoProcessor.from_pretrained(qwen_vl_dir).save_pretrained(model)
    tokenizer = extraction.sample_tokenizer(opts, model)
    assert tokenizer.processor is not None and tokenizer.fingerprint()["image_processor_sha256"] is not None
    save_image(tmp_path / "a.png", PATCH, 2 * PATCH)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        json.dumps(
            {
                "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "ok"}],
                "images": ["a.png"],
            }
        )
        + "\n"
    )
    (sample,) = tokenizer.many(list(read_corpus([corpus])))
    assert int(sample.images.token_mask.sum()) == 2


def test_a_llama4_checkpoint_whose_index_names_no_tower_refuses_its_image_chats_naming_the_index(
    tiny_model_dir, tmp_path, monkeypatch
):
    """SGLang builds Llama 4's vision tower only from weights the checkpoint's index names, else runs it text-only:
    without them the first image chat is refused as it is tokenized, before any forward (the dry run's, or the
    --strict run's before the model loads), naming the record, the index and the prefixes it lacks, where the
    forward would fail inside SGLang naming neither; its text records still tokenize. The run refuses them before
    the model loads."""
    model = build_model("llama4", tmp_path / "m", tokenizer_dir=tiny_model_dir)
    save_image(tmp_path / "a.png", PATCH, PATCH)
    reply = {"from": "gpt", "value": "ok"}
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        json.dumps({"conversations": [{"from": "human", "value": "hi"}, reply]})
        + "\n"
        + json.dumps(
            {"id": "pic", "conversations": [{"from": "human", "value": "<image>"}, reply], "images": ["a.png"]}
        )
        + "\n"
    )
    opts = ExtractOptions(data=(str(corpus),), model=str(model), out=str(tmp_path / "out"))
    records = list(read_corpus([corpus]))
    text, image = extraction.sample_tokenizer(opts, model).many(records)
    assert text.images is None and image.images is not None, "with the tower's weights indexed, it takes images"

    index = model / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    document["weight_map"] = {k: v for k, v in document["weight_map"].items() if k.startswith("language_model.")}
    index.write_text(json.dumps(document))
    refusal = (
        f"{corpus}:2 (id 'pic') holds 1 image, but {model} runs text-only in SGLang: its index {index} names no "
        f"vision_model.* or multi_modal_projector.* weights, and SGLang builds the vision tower only from the "
        f"weights the index names. Give the checkpoint with its vision weights, or a corpus without images"
    )
    monkeypatch.setattr(extraction, "Engine", lambda cfg: pytest.fail("the engine was started"))
    for attempt in (extraction.dry_run, extraction.run, lambda o: extraction.run(replace(o, strict=True))):
        with pytest.raises(ValueError) as refused:
            attempt(opts)
        assert str(refused.value) == refusal
    assert not (tmp_path / "out").exists()
    (text,) = extraction.sample_tokenizer(opts, model).many(records[:1])
    assert text.images is None


def test_the_token_budget_and_the_writers_default_by_device_and_by_model(tmp_path, tiny_model_dir):
    """A dense model of hidden size 1024 or less gets 64k tokens a forward on a GPU, where a 16k forward of
    it is short beside each batch's host work, and 8 writers for the states it makes fastest; a wider one and
    a MoE model (whose warm-up compiles per token count up to the budget) 16k and 4; the CPU 4k and 4 whatever
    the model. The facts come from the model's config."""
    from offline_extract.options import default_tokens_per_batch, default_writers

    wide = build_model("llama", tmp_path / "wide", weights=False, overrides={"hidden_size": 2048})
    moe = build_model("qwen3_moe", tmp_path / "moe", weights=False)
    budgets, writers = {}, {}
    for name, path in (("tiny", tiny_model_dir), ("wide", wide), ("moe", moe)):
        model = preflight.read_model(Path(path))
        budgets[name] = [default_tokens_per_batch(d, model.hidden_size, model.moe) for d in ("cuda", "cpu")]
        writers[name] = [default_writers(d, model.hidden_size, model.moe) for d in ("cuda", "cpu")]
    assert budgets == {"tiny": [65536, 4096], "wide": [16384, 4096], "moe": [16384, 4096]}
    assert writers == {"tiny": [8, 4], "wide": [4, 4], "moe": [4, 4]}


def _refused_alike(opts: ExtractOptions, monkeypatch) -> str:
    """The words the real run and the dry run both refuse `opts` with, before the engine starts."""
    monkeypatch.setattr(extraction, "Engine", lambda cfg: pytest.fail("the engine was started"))
    said = set()
    for attempt in (extraction.run, extraction.dry_run):
        with pytest.raises(ValueError) as refused:
            attempt(opts)
        said.add(str(refused.value))
    (words,) = said
    return words


def _edited_model(tiny_model_dir, tmp_path, **changes) -> Path:
    """A copy of the tiny model whose config.json has `changes`."""
    model = tmp_path / "edited"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))
    return model


@pytest.mark.parametrize(
    "key, value", [("num_hidden_layers", -1), ("num_hidden_layers", 0), ("hidden_size", 0), ("num_hidden_layers", 2.5)]
)
def test_a_config_without_a_layer_or_a_width_is_refused_by_the_real_and_the_dry_run(
    key, value, tiny_model_dir, tmp_path, monkeypatch
):
    # num_hidden_layers -1 passed both, and the run died inside SGLang on an AssertionError.
    model = _edited_model(tiny_model_dir, tmp_path, **{key: value})
    opts = ExtractOptions(data=(CORPUS,), model=str(model), out=str(tmp_path / "out"))
    assert _refused_alike(opts, monkeypatch) == (
        f"{model / 'config.json'} gives {key} {value!r}, where a whole number of at least 1 belongs: put back "
        f"the config.json that came with the weights"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "key, value, said",
    [
        (
            "hidden_size",
            10**7,
            "the weights say 64: model.embed_tokens.weight in model.safetensors has the shape [384, 64]",
        ),
        (
            "vocab_size",
            10**9,
            "the weights say 384: model.embed_tokens.weight in model.safetensors has the shape [384, 64]",
        ),
        (
            "intermediate_size",
            10**8,
            "the weights say 160: model.layers.0.mlp.down_proj.weight in model.safetensors has the shape [64, 160]",
        ),
        ("num_hidden_layers", 12, "the weights hold no model.layers.N.* for layers 8, 9, 10, 11"),
    ],
)
def test_a_config_whose_sizes_are_not_the_weights_is_refused_by_the_real_and_the_dry_run(
    key, value, said, tiny_model_dir, tmp_path, monkeypatch
):
    # hidden_size 10**7 passed both (the dry run said "fits"), and the run died allocating 4e15 bytes.
    model = _edited_model(tiny_model_dir, tmp_path, **{key: value})
    opts = ExtractOptions(data=(CORPUS,), model=str(model), out=str(tmp_path / "out"))
    assert _refused_alike(opts, monkeypatch) == (
        f"{model / 'config.json'} gives {key} {value}, but {said}. The config is not these weights': put back "
        f"the config.json that came with them"
    )
    assert not (tmp_path / "out").exists()
    # SGLang's dummy loader draws weights of the config's shapes: a config edited for it is its own.
    assert preflight.check(replace(opts, load_format="dummy")).model.path == model


@pytest.mark.parametrize(
    "arch, kind",
    [("qwen3_vl", {}), ("llama4", {}), ("qwen3_moe", {}), ("deepseek_v3", {"fp8": True}), ("gpt_oss", {"mxfp4": True})],
)
def test_every_kind_of_checkpoint_passes_the_sizes_and_its_decoder_is_found(arch, kind, tiny_model_dir, tmp_path):
    """A text config nested in a wrapper's (text_config.), weights under another name than model. (with an index,
    Llama 4's), experts, FP8 and MXFP4 weights: the config agrees with its own weights, and a wrong width is
    named where that decoder's embedding says otherwise."""
    model = build_model(arch, tmp_path / arch, tokenizer_dir=tiny_model_dir, **kind)
    assert preflight.read_model(model).hidden_size == 256
    config = json.loads((model / "config.json").read_text())
    (config.get("text_config") or config)["hidden_size"] = 512
    (model / "config.json").write_text(json.dumps(config))
    nested = "text_config." if "text_config" in config else ""
    with pytest.raises(
        ValueError, match=rf"gives {nested}hidden_size 512, but the weights say 256: \S*embed_tokens.weight "
    ):
        preflight.read_model(model)


def test_a_pickled_checkpoint_holding_code_is_refused_in_one_line_by_the_real_and_the_dry_run(
    tiny_model_dir, tmp_path, monkeypatch
):
    # SGLang's load refused it through a 100-line traceback advising weights_only=False, once the model was built.
    model = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save({"w": torch.ones(1), "f": print}, model / "pytorch_model.bin")
    opts = ExtractOptions(data=(CORPUS,), model=str(model), out=str(tmp_path / "out"))
    assert _refused_alike(opts, monkeypatch).startswith(
        f"{model / 'pytorch_model.bin'} holds pickled objects beyond tensors (builtins.print), which are refused"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("inside", ["out", "deeper/out", "."])
def test_an_out_inside_a_corpus_folder_is_refused_by_the_real_and_the_dry_run(inside, tmp_path, monkeypatch):
    # The run's own files changed the folder's fingerprint: every run ended "the corpus changed while this run read
    # it", naming no cause, and a rerun the same.
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"text": "one"}, {"text": "two"}]).save_to_disk(str(saved))
    before = sorted(p.name for p in saved.iterdir())
    out = saved / inside
    opts = ExtractOptions(data=(str(saved),), out=str(out))
    assert _refused_alike(opts, monkeypatch) == (
        f"--out {out} is inside the corpus folder --data {saved}, every file of which the corpus's fingerprint "
        f"takes in: the run's own files would change the corpus it records, and the run would never be marked "
        f"complete. Choose an --out outside {saved}"
    )
    assert sorted(p.name for p in saved.iterdir()) == before
    # Beside it, the same corpus runs.
    assert preflight.check(replace(opts, out=str(tmp_path / "out"))).sources[0].kind == "saved"


def test_image_chats_for_a_text_only_model_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    # The run loaded the model first, then stopped at the first image chat and left its manifest at "running", which
    # inspect read as an interrupted run that a rerun would finish.
    save_image(tmp_path / "a.png", PATCH, PATCH)
    corpus = tmp_path / "c.jsonl"
    picture = {"id": "pic", "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]}
    corpus.write_text('{"text": "first"}\n' + json.dumps({**picture, "images": ["a.png"]}) + "\n")
    opts = ExtractOptions(data=(str(corpus),), out=str(tmp_path / "out"))
    assert _refused_alike(opts, monkeypatch) == (
        f"{corpus}:2 (id 'pic') holds 1 image, but the default model is a text-only model (its config.json has no "
        f"vision_config): nothing of it reads images. Give a vision-language model, or a corpus without images"
    )
    assert not (tmp_path / "out").exists()
