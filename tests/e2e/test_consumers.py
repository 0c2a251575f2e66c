"""Each export opened by the trainer's own reading code (SpecForge 0.2.0, speculators 0.9.0 with
hs-connectors 0.9.0, installed from PyPI into their own environment: tests/e2e/consumers.py), every tensor
compared with what our reader hands out for the same sample.

The runs hold the tiny model's states from the SGLang engine: one post-norm in bf16 and one pre-norm in
fp8 + zstd, so that each trainer gets one run holding its own final state and one converted with the
run's final norm, and the fp8, gzip and plain layouts are all read.
"""

import json

import numpy as np
import pytest
import torch
from consumers import read_exports
from extract_runs import ROOT, run_extract, succeeded

from offline_extract.engine import parity
from offline_extract.engine.reference import load_hf_model
from offline_extract.final_norm import recorded
from offline_extract.testing.shards import synthetic_run, write_samples, write_synthetic
from offline_extract.training.datasets import HiddenStateDataset
from offline_extract.training.export import MANIFEST_NAME, export_specforge, export_speculators

LENGTHS = [23, 7, 61, 2, 40, 15]
CORPUS = ROOT / "examples" / "corpus.jsonl"


@pytest.fixture(scope="module")
def runs(tiny_engine, tiny_model_dir, tmp_path_factory):
    rng = np.random.default_rng(5)
    seqs = [rng.integers(6, 380, n).astype(np.int32) for n in LENGTHS]
    masks = [(rng.random(n) < 0.6).astype(np.uint8) for n in LENGTHS]
    captured = {"post-norm": tiny_engine.capture(seqs)}
    tiny_engine.final_state = "pre-norm"
    try:
        captured["pre-norm"] = tiny_engine.capture(seqs)
    finally:
        tiny_engine.final_state = tiny_engine.cfg.final_state
    outs = {}
    for state, store, compress in (("post-norm", "bf16", "none"), ("pre-norm", "fp8", "zstd")):
        out = tmp_path_factory.mktemp(state) / "out"
        run = synthetic_run(
            tiny_engine.layer_ids,
            tiny_engine.hidden_size,
            model=str(tiny_model_dir),
            num_layers=tiny_engine.num_layers,
            final_state=state,
            store=store,
            compress=compress,
            final_norm=tiny_engine.final_norm().to_json(),
        )
        write_samples(
            out,
            run,
            LENGTHS,
            np.concatenate(seqs),
            np.concatenate(masks),
            captured[state].aux.bfloat16(),
            captured[state].last.bfloat16(),
            shard_bytes=30 * 4 * 64 * 2,
        )
        outs[state] = out
    return outs


@pytest.fixture(scope="module")
def custom_run(tiny_model_dir, tmp_path_factory):
    """bin/extract.py with our layer ids 0 and 2 of the tiny model, the pre-norm final state, in fp32."""
    out = tmp_path_factory.mktemp("custom") / "out"
    corpus = out.parent / "c.jsonl"
    corpus.write_text("".join(CORPUS.read_text().splitlines(keepends=True)[:4]))
    succeeded(
        run_extract(
            out,
            "--model",
            tiny_model_dir,
            "--data",
            corpus,
            "--layers",
            "0,2",
            "--final-state",
            "pre-norm",
            "--dtype",
            "float32",
        )
    )
    return out


@pytest.fixture(scope="module")
def read(runs, custom_run, tmp_path_factory):
    """Every export of the runs, and what the trainers' code read from each."""
    tmp = tmp_path_factory.mktemp("exports")
    dflash = tmp / "dflash-run"
    write_synthetic(dflash, LENGTHS, hidden_size=64, num_aux=5, recipe="dflash", final_state=None)
    exports = {
        ("speculators", "custom"): export_speculators(custom_run, tmp / "spec-custom", progress=False).dest,
        ("specforge", "post-norm"): export_specforge(runs["post-norm"], tmp / "sf-post", progress=False).dest,
        ("specforge", "pre-norm"): export_specforge(runs["pre-norm"], tmp / "sf-pre", progress=False).dest,
        ("speculators", "post-norm"): export_speculators(runs["post-norm"], tmp / "spec-post", progress=False).dest,
        ("speculators", "pre-norm"): export_speculators(runs["pre-norm"], tmp / "spec-pre", progress=False).dest,
        ("specforge", "dflash"): export_specforge(dflash, tmp / "sf-dflash", progress=False).dest,
    }
    jobs = [
        {"format": fmt, "dest": str(dest), "recipe": "dflash" if which == "dflash" else "eagle3"}
        for (fmt, which), dest in exports.items()
    ]
    results = read_exports(jobs, tmp)
    return {key: (dest, result) for (key, dest), result in zip(exports.items(), results)}, dflash


def _ours(out):
    dataset = HiddenStateDataset(out)
    return dataset, [dataset[i] for i in range(len(dataset))]


@pytest.mark.parametrize("run_state", ["post-norm", "pre-norm"])
def test_specforge_reads_our_states_with_the_post_norm_final_state(runs, read, run_state):
    dest, result = read[0][("specforge", run_state)]
    dataset, items = _ours(runs[run_state])
    norm = recorded(dataset.run.final_norm)
    gz = run_state == "pre-norm"  # stored as fp8 + zstd: exported gzipped
    assert result["files"] == len(items) and len(list(dest.rglob("*.ckpt.gz" if gz else "*.ckpt"))) == len(items)
    for i, item in enumerate(items):
        got = result["samples"][i]
        assert torch.equal(got["input_ids"], item["input_ids"])
        # SpecForge drops the last token from the loss (it has no next token to predict).
        mask = item["loss_mask"].long().clone()
        mask[-1] = 0
        assert torch.equal(got["loss_mask"], mask)
        assert torch.equal(got["hidden_state"], item["aux_hidden_states"])
        want = item["hidden_states"] if run_state == "post-norm" else norm.apply(item["hidden_states"]).bfloat16()
        assert torch.equal(got["target"], want)


@pytest.mark.parametrize("run_state", ["post-norm", "pre-norm"])
def test_speculators_reads_our_states_with_the_pre_norm_final_state_and_layer_ids(runs, read, run_state):
    dest, result = read[0][("speculators", run_state)]
    dataset, items = _ours(runs[run_state])
    norm = recorded(dataset.run.final_norm)
    # Its own config resolver read our YAML: HF indices of our layers, and the fp8 backend for the fp8 run.
    assert result["target_layer_ids"] == [k + 1 for k in dataset.run.layer_ids]
    fp8 = run_state == "pre-norm"
    assert (result["hidden_states_backend"], result["transfer"]) == (
        ("fp8", "FP8Transfer") if fp8 else ("file", "FileTransfer")
    )
    assert json.loads((dest / MANIFEST_NAME).read_text())["layer_ids"] == [
        *result["target_layer_ids"],
        dataset.run.num_layers,
    ]
    for i, item in enumerate(items):
        got = result["samples"][i]
        assert torch.equal(got["input_ids"], item["input_ids"])
        assert torch.equal(got["loss_mask"], item["loss_mask"].long())
        # fp8 too: its bf16-arithmetic decode of our bf16 scales is exactly our decode.
        assert torch.equal(got["hidden_states"], item["aux_hidden_states"])
        if run_state == "pre-norm":
            assert torch.equal(got["verifier_last_hidden_states"], item["hidden_states"])
        else:
            assert torch.equal(got["verifier_last_hidden_states"], norm.undo(item["hidden_states"]).bfloat16())


def test_specforge_reads_a_dflash_export(read):
    (_, result), dflash = read[0][("specforge", "dflash")], read[1]
    _, items = _ours(dflash)
    for i, item in enumerate(items):
        got = result["samples"][i]
        assert torch.equal(got["input_ids"], item["input_ids"])
        assert torch.equal(got["loss_mask"], item["loss_mask"].long())
        assert torch.equal(got["hidden_states"], item["aux_hidden_states"])


def test_a_custom_layer_run_trains_speculators_on_the_layers_it_names(custom_run, read, tiny_model_dir):
    """Our ids [0, 2] are HF hidden_states [1, 3]: speculators' own config resolver reads them from the
    export, and the states it hands to training at its ids are HF's at those indices (fp32 run, bf16
    store), the final one HF's final-norm input."""
    dest, result = read[0][("speculators", "custom")]
    dataset, items = _ours(custom_run)
    assert dataset.run.layer_ids == (0, 2) and dataset.run.num_layers == 8
    assert result["target_layer_ids"] == [1, 3]
    assert json.loads((dest / MANIFEST_NAME).read_text())["layer_ids"] == [1, 3, 8]
    hf = load_hf_model(str(tiny_model_dir), "float32", "cpu")
    for i, item in enumerate(items):
        got = result["samples"][i]
        reference = parity.hf_hidden_states(hf, item["input_ids"].tolist(), "cpu", final_state="pre-norm")
        layers = got["hidden_states"].float().reshape(len(item["input_ids"]), 2, -1)
        for position, hf_index in enumerate(result["target_layer_ids"]):
            want = reference[hf_index]
            # bf16 storage of an fp32 state: within a bf16 step of each value.
            assert ((layers[:, position] - want).abs() <= want.abs() * 2**-8 + 1e-6).all(), hf_index
            assert (layers[:, position] - reference[hf_index + 1]).abs().max() > 0.1
        last = got["verifier_last_hidden_states"].float()
        assert ((last - reference[-1]).abs() <= reference[-1].abs() * 2**-8 + 1e-6).all()
