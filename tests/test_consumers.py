"""Each export opened by the trainer's own reading code (SpecForge 0.2.0, speculators 0.9.0 with
hs-connectors 0.9.0, installed from PyPI into their own environment: tests/consumers.py), every tensor
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

from offline_extract.final_norm import RUN_KEY, from_run
from offline_extract.store.index import write_index
from offline_extract.store.schema import Encoding, SampleInfo
from offline_extract.store.writer import ShardWriter
from offline_extract.testing.shards import write_synthetic
from offline_extract.training.datasets import HiddenStateDataset
from offline_extract.training.export import MANIFEST_NAME, export_specforge, export_speculators

LENGTHS = [23, 7, 61, 2, 40, 15]


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
    for state, encoding in (("post-norm", Encoding()), ("pre-norm", Encoding(store="fp8", compress="zstd"))):
        out = tmp_path_factory.mktemp(state) / "out"
        run = {"model": str(tiny_model_dir), "layer_ids": list(tiny_engine.layer_ids), "num_layers": tiny_engine.num_layers,
               "hidden_size": tiny_engine.hidden_size, "final_state": state, "store": encoding.store,
               "compress": encoding.compress, RUN_KEY: tiny_engine.final_norm().to_json()}
        writer = ShardWriter(out, run, shard_bytes=30 * 4 * 64 * 2, encoding=encoding)
        writer.add_batch(
            [SampleInfo(i, f"s{i}", "engine", i + 1, n, False) for i, n in enumerate(LENGTHS)],
            np.concatenate(seqs), np.concatenate(masks), captured[state].aux.bfloat16(), captured[state].last.bfloat16(),
            lengths=LENGTHS,
        )
        writer.close()
        write_index(out)
        outs[state] = out
    return outs


@pytest.fixture(scope="module")
def read(runs, tmp_path_factory):
    """Every export of both runs, and what the trainers' code read from each."""
    tmp = tmp_path_factory.mktemp("exports")
    dflash = tmp / "dflash-run"
    write_synthetic(dflash, LENGTHS, hidden_size=64, num_aux=5, run={"recipe": "dflash", "final_state": None})
    exports = {
        ("specforge", "post-norm"): export_specforge(runs["post-norm"], tmp / "sf-post", progress=False).dest,
        ("specforge", "pre-norm"): export_specforge(runs["pre-norm"], tmp / "sf-pre", progress=False).dest,
        ("speculators", "post-norm"): export_speculators(runs["post-norm"], tmp / "spec-post", progress=False).dest,
        ("speculators", "pre-norm"): export_speculators(runs["pre-norm"], tmp / "spec-pre", progress=False).dest,
        ("specforge", "dflash"): export_specforge(dflash, tmp / "sf-dflash", progress=False).dest,
    }
    jobs = [{"format": fmt, "dest": str(dest), "recipe": "dflash" if which == "dflash" else "eagle3"}
            for (fmt, which), dest in exports.items()]
    results = read_exports(jobs, tmp)
    return {key: (dest, result) for (key, dest), result in zip(exports.items(), results)}, dflash


def _ours(out):
    dataset = HiddenStateDataset(out)
    return dataset, [dataset[i] for i in range(len(dataset))]


@pytest.mark.parametrize("run_state", ["post-norm", "pre-norm"])
def test_specforge_reads_our_states_with_the_post_norm_final_state(runs, read, run_state):
    dest, result = read[0][("specforge", run_state)]
    dataset, items = _ours(runs[run_state])
    norm = from_run(dataset.run)
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
    norm = from_run(dataset.run)
    # Its own config resolver read our YAML: HF indices of our layers, and the fp8 backend for the fp8 run.
    assert result["target_layer_ids"] == [k + 1 for k in dataset.run["layer_ids"]]
    fp8 = run_state == "pre-norm"
    assert (result["hidden_states_backend"], result["transfer"]) == (("fp8", "FP8Transfer") if fp8 else ("file", "FileTransfer"))
    assert json.loads((dest / MANIFEST_NAME).read_text())["layer_ids"] == [*result["target_layer_ids"], dataset.run["num_layers"]]
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
