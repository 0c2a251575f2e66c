"""The CPU-checkable parts of the peer comparison (benchmarks/peers/): corpus hand-off, accounting, reading
SpecForge's output layout, SGLang's own return_hidden_states path and its capture-only aux mode against our
engine, and the result files that a bench cut short leaves."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from extract_runs import ROOT
from transformers import AutoTokenizer

from benchmarks.extraction_vs_prefill import BenchOptions, ResultFiles, synthetic_corpus
from benchmarks.peers import baselines, specforge
from benchmarks.peers.accounting import LayerTally, PeerRow, TreePeakRss, split_layers
from benchmarks.peers.corpus import chat_records, load_batches, save_batches
from benchmarks.peers.sglang_engine import returned_states
from benchmarks.peers.table import rows
from offline_extract.data.tokenization import SampleTokenizer
from offline_extract.engine.distributed import Layout
from offline_extract.engine.parity import TOLERANCES
from offline_extract.engine.sglang_releases import installed


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def seqs(hf_tokenizer):
    samples = synthetic_corpus(
        SampleTokenizer(hf_tokenizer, max_length=2048),
        BenchOptions(mean_length=300, max_length=2048, num_tokens=30_000),
    )
    return [s.input_ids for s in samples]


def test_batches_round_trip_with_their_warmup(tmp_path, seqs):
    batches = [seqs[:3], seqs[3:4], seqs[4:9]]
    save_batches(tmp_path / "b.npz", batches, warmup=1)
    back, warmup = load_batches(tmp_path / "b.npz")
    assert warmup == 1
    assert [len(b) for b in back] == [3, 1, 5]
    assert all(np.array_equal(x, y) for b, c in zip(batches, back) for x, y in zip(b, c))


def test_chat_records_render_back_to_the_samples_tokens(seqs, hf_tokenizer):
    """What SpecForge will tokenize: the tokenizer's template over the records, no special tokens added."""
    records = chat_records(seqs, hf_tokenizer)
    assert len(records) == len(seqs)
    extra = []
    for ids, rec in zip(seqs, records):
        assert rec["conversations"][0]["role"] == "user"
        text = hf_tokenizer.apply_chat_template(rec["conversations"], tokenize=False, add_generation_prompt=False)
        back = np.asarray(hf_tokenizer(text, add_special_tokens=False)["input_ids"])
        same = int(np.argmin(np.append(back[: len(ids)] == ids[: len(back)], False)))
        # Identical up to the cut; the template then closes the message the sample was cut in.
        assert same >= len(ids) - 2, (same, len(ids))
        extra.append(len(back) - len(ids))
    assert max(abs(e) for e in extra) <= 2
    assert np.mean(extra) < 1.5


def test_chat_records_refuse_text_of_another_shape(hf_tokenizer):
    ids = np.asarray(hf_tokenizer("<|bos|>plain text, no chat", add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError, match="not a chat"):
        chat_records([ids], hf_tokenizer)


def test_layer_tally_tells_same_states_from_scaled_and_other_layers():
    g = torch.Generator().manual_seed(0)
    ours = {"1": torch.randn(50, 64, generator=g), "final": torch.randn(50, 64, generator=g)}
    tally = LayerTally()
    tally.add("same", ours, {k: v.to(torch.bfloat16) for k, v in ours.items()})
    tally.add("pre-norm-like", ours, {"1": ours["1"], "final": 3 * ours["final"]})
    s = tally.summary()
    assert s["1"]["cosine_min"] > 0.999 and s["1"]["samples"] == 2 and s["1"]["tokens"] == 100
    assert s["final"]["cosine_min"] > 0.999
    assert s["final"]["norm_ratio_mean"] == pytest.approx(2.0, rel=1e-2)  # (1 + 3) / 2: the scale shows
    other = LayerTally()
    other.add("off-by-one", ours, {"1": ours["final"]})
    assert abs(other.summary()["1"]["cosine_mean"]) < 0.2
    assert "final" not in other.summary(), "a layer the peer does not store is not reported"
    with pytest.raises(ValueError, match="layer 1"):
        other.add("short", ours, {"1": ours["1"][:10]})


def test_split_layers_keeps_the_ascending_order():
    aux = torch.cat([torch.full((4, 8), float(k)) for k in (1, 15, 28)], dim=-1)
    layers = split_layers(aux, torch.zeros(4, 8), [1, 15, 28])
    assert list(layers) == ["1", "15", "28", "final"]
    assert [layers[k][0, 0].item() for k in ("1", "15", "28")] == [1.0, 15.0, 28.0]
    with pytest.raises(ValueError, match="multiple"):
        split_layers(torch.zeros(4, 10), None, [1, 15, 28])


def test_tree_peak_rss_counts_child_processes():
    hog = "import time; b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(3)"
    proc = subprocess.Popen([sys.executable, "-c", hog])
    with TreePeakRss(proc.pid, interval=0.05) as rss:
        proc.wait()
    assert rss.peak > 300 << 20


def _fake_specforge_output(out: Path, prepared, order, batch_size, hidden=8):
    """What prepare_hidden_states.py writes: per sample a dict, rows padded to the batch's longest."""
    expected = list(prepared.expected.values())
    t0 = time.time() - 100
    for b in range(0, len(order), batch_size):
        group = [expected[i] for i in order[b : b + batch_size]]
        pad = max(map(len, group))
        for j, ids in enumerate(group):
            idx = b + j
            padded = np.zeros(pad, dtype=np.int64)
            padded[: len(ids)] = ids
            states = torch.arange(pad, dtype=torch.float32)[:, None].expand(pad, hidden)
            rec = {
                "input_ids": torch.from_numpy(padded),
                "loss_mask": torch.zeros(pad, dtype=torch.long),
                "aux_hidden_state": states.repeat(1, 3)[None].bfloat16(),
                "hidden_state": states[None].bfloat16(),
            }
            path = out / f"rows_0-2000/data_{idx}.ckpt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(rec, path)
            stamp = t0 + 10 * (b // batch_size + 1)
            os.utime(path, (stamp, stamp))


def test_specforge_output_is_accounted_without_its_padding(tmp_path, seqs, hf_tokenizer):
    prepared = specforge.prepare(tmp_path / "in", seqs[:12], hf_tokenizer, max_length=2048)
    assert len(prepared.data.read_text().splitlines()) == 12
    order = list(reversed(range(12)))  # it shuffles: files are not in corpus order
    _fake_specforge_output(tmp_path / "out", prepared, order, batch_size=4)
    out = specforge.read_output(tmp_path / "out", prepared, batch_size=4)
    own = [len(x) for x in prepared.expected.values()]
    assert out.files == 12 and not out.unmatched
    assert out.real_tokens == sum(own)
    assert out.stored_tokens > out.real_tokens, "padding is stored"
    later = sum(own[i] for i in order[4:])
    assert out.steady_tok_s == pytest.approx(later / 20, rel=1e-6)  # batches 2 and 3 finish 10 s apart each
    path, ids = out.matched[0]
    layers, stored_ids = specforge.load_states(path, len(ids), [1, 15, 28])
    assert list(layers) == ["1", "15", "28", "final"]
    assert layers["final"].shape == (len(ids), 8) and np.array_equal(stored_ids, ids)


def test_specforge_counts_unknown_files_by_their_unpadded_length(tmp_path, seqs, hf_tokenizer):
    prepared = specforge.prepare(tmp_path / "in", seqs[:2], hf_tokenizer, max_length=2048)
    path = tmp_path / "out" / "rows_0-2000" / "data_0.ckpt"
    path.parent.mkdir(parents=True)
    torch.save({"input_ids": torch.tensor([0, 7, 9, 11, 0, 0])}, path)
    out = specforge.read_output(tmp_path / "out", prepared, batch_size=4)
    assert out.unmatched == [str(path)] and out.real_tokens == 4 and out.steady_tok_s is None


def test_specforge_command_is_its_documented_launch(tmp_path):
    argv = specforge.command(
        Path("s.py"),
        Path("m"),
        Path("d.jsonl"),
        Path("o"),
        Path("c"),
        max_length=8192,
        batch_size=32,
        attention_backend="fa3",
        draft_config=Path("cfg.json"),
    )
    assert argv[:5] == ["torchrun", "--standalone", "--nproc_per_node", "1", "s.py"]
    flags = dict(zip(argv[5::2], argv[6::2]))
    assert flags["--chat-template"] == specforge.CHAT_TEMPLATE and flags["--batch-size"] == "32"
    assert flags["--strategy"] == "eagle3" and flags["--draft-model-config"] == "cfg.json"
    assert specforge.capture_layers(32) == [1, 15, 28]


def test_returned_states_take_the_one_prompt_block():
    out = {"meta_info": {"hidden_states": [[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]]}}
    assert returned_states(out, 3, "s", torch.bfloat16).tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    with pytest.raises(RuntimeError, match="one block of 4"):
        returned_states(out, 4, "s", torch.bfloat16)
    with pytest.raises(RuntimeError, match="no hidden states"):
        returned_states({"meta_info": {}}, 3, "s", torch.bfloat16)


def test_cross_check_fills_the_row_and_unknown_baselines_are_refused():
    g = torch.Generator().manual_seed(1)
    state = torch.randn(5, 16, generator=g)
    pending = baselines.Pending(PeerRow("p", "1", "cmd", 1.0, 2.0, 3, None), [("s0", np.arange(5), {"final": state})])
    row = baselines.cross_check(pending, lambda ids: {"final": state.clone(), "1": state})
    assert set(row.cosine_vs_ours) == {"final"} and row.cosine_vs_ours["final"]["cosine_min"] > 0.9999
    assert row.to_json()["cosine_vs_ours"]["final"]["tokens"] == 5
    with pytest.raises(ValueError, match="unknown baseline"):
        baselines.check_names(["hf", "vllm"])


def test_result_files_hold_each_part_as_it_finishes(tmp_path):
    """A run cut short between parts leaves, in every result file, a valid JSON of the parts done so far."""
    opts = BenchOptions(
        model="/models/m",
        baselines=("sglang-engine", "hf"),
        outs=("/dev/shm/x", "/"),
        results_dir=str(tmp_path),
        command="python bin/bench.py --baseline sglang-engine --baseline hf",
    )
    files = ResultFiles(opts, Layout())
    assert not list(tmp_path.iterdir()), "nothing is written before a part is done"

    def saved() -> list[dict]:
        assert not list(tmp_path.glob(".*")), "no temporary file is left"
        return [json.loads(p.read_text()) for p in sorted(tmp_path.iterdir())]

    peer = PeerRow("sglang-engine", "0.5.17", "c", 1400.0, 8196.0, 11 << 30, None, notes={"num_tokens": 9})
    files.peer(peer)
    disk, tmpfs = saved()
    assert (
        disk
        == tmpfs
        == {
            "command": opts.command,
            "peers": [peer.to_json()],
            "parts": {
                "done": ["peer sglang-engine"],
                "left": ["ours", "peer hf", "cross-check sglang-engine", "cross-check hf"],
            },
        }
    )
    assert rows(tmpfs, "r.json")[0].startswith("| ours **not measured**: parts left ours, ")

    files.measured(0, {"command": opts.command, "extract_tok_s": 30000.0, "out_kind": "tmpfs"})
    disk, tmpfs = saved()
    assert tmpfs["extract_tok_s"] == 30000.0 and "ours" in tmpfs["parts"]["done"]
    assert "extract_tok_s" not in disk and "ours" in disk["parts"]["left"], "the other file's ours is not measured yet"
    files.measured(1, {"command": opts.command, "extract_tok_s": 20000.0, "out_kind": "disk"})
    files.peer(PeerRow("hf", "5", "c", 7000.0, None, None, None))
    peer.cosine_vs_ours = {"final": {"cosine_min": 1.0}}  # what cross_check fills in
    files.done("cross-check sglang-engine")
    disk, tmpfs = saved()
    assert tmpfs["peers"][0]["cosine_vs_ours"] == {"final": {"cosine_min": 1.0}} and tmpfs["peers"][1]["name"] == "hf"
    assert tmpfs["parts"]["left"] == ["cross-check hf"]
    files.done("cross-check hf")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n.rsplit("_", 1)[0] for n in names] == [
        "bench_m_lognormal_disk_bf16_none_w1_tp1",
        "bench_m_lognormal_tmpfs_bf16_none_w1_tp1",
    ]
    assert [d["parts"]["left"] for d in saved()] == [[], []]
    assert [d["extract_tok_s"] for d in files.write(final=True)] == [30000.0, 20000.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == names, "rewritten in place, under the names of the first save"


# The bench up to our engine, in a process of its own: run_bench's first part (the peers in their own
# processes, each saved as it finishes), then where run_bench would load our engine it says so and waits.
_PEERS_THEN_OURS = """
import sys, time
from pathlib import Path
from transformers import AutoTokenizer
from benchmarks.extraction_vs_prefill import BenchOptions, ResultFiles, peers_first
from benchmarks.peers.baselines import PeerOptions
from benchmarks.peers.corpus import load_batches
from offline_extract.engine.distributed import Layout

model, batches_file, work, results, moved_on = sys.argv[1:]
batches, warmup = load_batches(Path(batches_file))
popts = PeerOptions(workdir=work, cross_check_samples=3, device="cpu", sglang_attention_backend="torch_native",
                    sglang_mem_fraction_static=0.5)
opts = BenchOptions(model=model, load_format="auto", dtype="float32", max_length=2048, warmup_batches=warmup,
                    baselines=("sglang-engine",), peer_options=popts, results_dir=results, command="the bench command")
peers_first(opts, ResultFiles(opts, Layout()), Path(model), AutoTokenizer.from_pretrained(model), batches, num_layers=2)
Path(moved_on).touch()
time.sleep(600)
"""


@pytest.mark.slow
def test_sglang_return_hidden_states_is_our_post_norm_final_state(tmp_path, tiny_model_dir, tiny_engine, seqs):
    """The bench's sglang-engine peer, run on CPU in fp32, in a bench stopped by SIGTERM (as `timeout` stops a
    run) once the peer has finished: the result JSON holds the peer's row, and the states it left
    show that sglang.Engine(enable_return_hidden_states=True) returns, per prompt token, the state after
    the final norm, equal to our engine's `last`."""
    work, results, log = tmp_path / "work", tmp_path / "results", tmp_path / "bench.log"
    save_batches(tmp_path / "batches.npz", [seqs[:2], seqs[2:5], seqs[5:6]], warmup=1)
    with open(log, "w") as err:
        bench = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _PEERS_THEN_OURS,
                str(tiny_model_dir),
                str(tmp_path / "batches.npz"),
                str(work),
                str(results),
                str(tmp_path / "moved-on"),
            ],
            cwd=ROOT,
            stderr=err,
            start_new_session=True,
        )
    deadline = time.monotonic() + 600
    try:
        while not (tmp_path / "moved-on").exists():
            assert bench.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "the peer did not finish in 10 min"
            time.sleep(0.2)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGTERM)
    assert bench.wait(timeout=60) == -signal.SIGTERM

    [doc] = [json.loads(p.read_text()) for p in results.iterdir()]
    assert doc["command"] == "the bench command" and "extract_tok_s" not in doc
    assert doc["parts"] == {"done": ["peer sglang-engine"], "left": ["ours", "cross-check sglang-engine"]}
    [row] = doc["peers"]
    assert row["error"] is None, row["error"]
    assert row["notes"]["num_tokens"] == sum(len(s) for s in seqs[2:6]) and row["tok_s"] > 0
    assert row["host_peak_rss_bytes"] > 100 << 20, "the engine's processes are counted"
    [line] = [x for x in log.read_text().splitlines() if x.startswith("peer sglang-engine:")]
    assert line.startswith("peer sglang-engine: finished in ") and "start-up, model load and warm-up included" in line
    assert f"tok/s {row['tok_s']:,.0f} = prompt tokens" in line and "start-up excluded" in line
    assert line.endswith("its states are cross-checked against ours at the end"), "not read as a cross-check done"
    # End to end, as SpecForge's: every token it was given, the warm-up batch too, over launch to exit, which
    # counts its start-up, so it is below the steady rate.
    end_to_end = row["notes"]["end_to_end_tok_s"]
    assert 0 < end_to_end < row["tok_s"] and f"{end_to_end:,.0f} tok/s end to end, its start-up counted" in line

    # What the run would have cross-checked once ours was measured: the first timed samples' states.
    own = json.loads((work / "sglang_engine.json").read_text())
    pending = baselines.Pending(PeerRow(**row), baselines.dumped_states(Path(own["dump"])))
    assert [len(ids) for _, ids, _ in pending.states] == [len(s) for s in seqs[2:5]], "the first timed samples"
    checked = baselines.cross_check(pending, baselines.our_states(tiny_engine))
    assert checked.error is None, checked.error
    final = checked.cosine_vs_ours["final"]
    assert set(checked.cosine_vs_ours) == {"final"} and final["samples"] == 3
    # Stored as bf16 by the peer module, as a user would keep them.
    assert final["cosine_min"] > 0.9999 and final["norm_ratio_mean"] == pytest.approx(1.0, abs=1e-2)


@pytest.mark.slow
def test_sglang_aux_returns_our_aux_layers_where_sglang_has_the_mode(
    request, tmp_path, tiny_model_dir, hf_tokenizer, seqs
):
    """The bench's sglang-aux peer on CPU in fp32, through the real sglang.Engine in its own process. Under an
    SGLang with the capture-only aux mode (0.5.23), the layers it returns for our layer ids, handed over through
    the model file's capture rule, are ours token for token, to fp32 rounding; under one without it (0.5.17)
    the peer is refused, naming the release it needs."""
    popts = baselines.PeerOptions(
        workdir=str(tmp_path / "work"),
        cross_check_samples=3,
        device="cpu",
        sglang_attention_backend="torch_native",
        sglang_mem_fraction_static=0.5,
    )
    [pending] = baselines.run_subprocess_peers(
        ["sglang-aux"],
        popts,
        model_dir=tiny_model_dir,
        tokenizer=hf_tokenizer,
        batches=[seqs[:2], seqs[2:5], seqs[5:6]],
        warmup=1,
        max_length=2048,
        dtype="float32",
        num_layers=8,
        load_format="auto",
    )
    row, release = pending.row, installed()
    if not release.serves_aux_layers:
        assert row.name == "sglang-aux" and not pending.states
        assert (
            "RuntimeError: sglang-aux runs SGLang's capture-only aux mode (--enable-return-aux-hidden-states), "
            f"which SGLang {release.version} lacks; run the bench where SGLang 0.5.23 is installed"
        ) in row.error
        return
    assert row.error is None, row.error
    assert (row.name, row.version) == ("sglang-aux", release.version)
    assert row.notes["stores"]["layers"] == ["1", "3", "4"] and row.bytes_per_token == 2 * 3 * 64 + 4
    engine = request.getfixturevalue("tiny_engine")
    assert tuple(engine.layer_ids) == (1, 3, 4), "the bench's layers are our engine's default ones"
    ours = baselines.our_states(engine)
    assert [len(ids) for _, ids, _ in pending.states] == [len(s) for s in seqs[2:5]], "the first timed samples"
    for sample, ids, theirs in pending.states:
        mine = ours(ids)
        assert set(theirs) == {"1", "3", "4"}
        for key, state in theirs.items():
            bound = TOLERANCES["float32"]["max_rel"] * mine[key].abs().max().item()
            assert state.dtype == torch.float32 and (state - mine[key]).abs().max().item() <= bound, (sample, key)
        # The bound tells layers apart: the next layer's state is far outside it.
        assert (theirs["3"] - mine["4"]).abs().max().item() > 100 * bound
    checked = baselines.cross_check(pending, ours)
    assert set(checked.cosine_vs_ours) == {"1", "3", "4"}
    assert all(v["cosine_min"] > 0.99999 and v["samples"] == 3 for v in checked.cosine_vs_ours.values())


# Stands in for SpecForge's script in the test below: reads the arguments and the corpus the bench hands it,
# tokenizes as it does, pads each batch with id 0 and writes its layout, with states drawn from fixed random
# tables of each token and position, so a read off by one token or sample shows in the cross-check.
_TABLES = "g = torch.Generator().manual_seed(0); tok_t = torch.randn(512, 16, generator=g); pos_t = torch.randn(4096, 16, generator=g)"
_STUB = (
    """
import argparse, json, os
import torch
from transformers import AutoTokenizer
"""
    + _TABLES
    + """
p = argparse.ArgumentParser()
for flag in ("--strategy", "--target-model-path", "--draft-model-config", "--data-path", "--output-path", "--cache-dir",
             "--chat-template", "--max-length", "--tp-size", "--batch-size", "--sglang-attention-backend"):
    p.add_argument(flag)
a = p.parse_args()
assert os.environ["RANK"] == "0", "run under torchrun"
assert os.path.isfile(a.draft_model_config) and a.strategy == "eagle3"
tok = AutoTokenizer.from_pretrained(a.target_model_path)
rows = [json.loads(line)["conversations"] for line in open(a.data_path)]
ids = [tok(tok.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"][: int(a.max_length)]
       for c in rows][::-1]
bs = int(a.batch_size)
for b in range(0, len(ids) - len(ids) % bs, bs):
    pad = max(len(x) for x in ids[b : b + bs])
    for i, x in enumerate(ids[b : b + bs], start=b):
        t = torch.zeros(pad, dtype=torch.long)
        t[: len(x)] = torch.tensor(x)
        h = tok_t[t] + pos_t[:pad]
        os.makedirs(f"{a.output_path}/rows_0-2000", exist_ok=True)
        torch.save({"input_ids": t, "loss_mask": torch.zeros_like(t), "aux_hidden_state": h.repeat(1, 3)[None],
                    "hidden_state": h[None]}, f"{a.output_path}/rows_0-2000/data_{i}.ckpt")
"""
)


def _stub_states(ids):
    scope = {"torch": torch}
    exec(_TABLES, scope)  # the stub's own tables, from the same seed
    h = scope["tok_t"][torch.from_numpy(ids.astype(np.int64))] + scope["pos_t"][: len(ids)]
    return {"1": h, "15": h, "28": h, "final": h}


@pytest.mark.slow
def test_specforge_peer_glue_with_a_stand_in_script(tmp_path, tiny_model_dir, hf_tokenizer, seqs):
    """The bench's specforge peer end to end on CPU, SpecForge's script replaced by _STUB: the command runs
    under torchrun with the peer site on the path, its padded, shuffled output is read back, and every
    stored layer lines up token for token with the ids it belongs to."""
    sf = tmp_path / "specforge"
    (sf / "scripts").mkdir(parents=True)
    (sf / "scripts" / "prepare_hidden_states.py").write_text(_STUB)
    (sf / "configs").mkdir()
    (sf / specforge.DRAFT_CONFIG).write_text("{}")
    site = tmp_path / "site"
    site.mkdir()
    popts = baselines.PeerOptions(
        workdir=str(tmp_path / "work"),
        peer_site=str(site),
        specforge_dir=str(sf),
        specforge_batch_size=4,
        cross_check_samples=6,
    )
    batches = [seqs[:3], seqs[3:8], seqs[8:15]]  # 12 timed samples: 3 batches of 4
    [pending] = baselines.run_subprocess_peers(
        ["specforge"],
        popts,
        model_dir=tiny_model_dir,
        tokenizer=hf_tokenizer,
        batches=batches,
        warmup=1,
        max_length=2048,
        dtype="bfloat16",
        num_layers=32,
        load_format="auto",
    )
    row = pending.row
    assert row.error is None, row.error
    assert row.notes["files"] == 12 and row.notes["unmatched_files"] == 0
    own = sum(len(s) for s in seqs[3:15])
    assert abs(row.notes["real_tokens"] - own) <= 2 * 12, "the samples' tokens, give or take a closing token"
    assert row.notes["stored_tokens"] > row.notes["real_tokens"], "padding stored"
    assert row.bytes_per_token > 4 * 16 * 4, "four fp32 layers of width 16 a real token, and the padding"
    assert row.host_peak_rss_bytes > 50 << 20
    row = baselines.cross_check(pending, _stub_states)
    assert set(row.cosine_vs_ours) == {"1", "15", "28", "final"}
    assert all(v["cosine_min"] > 0.99999 and v["samples"] == 6 for v in row.cosine_vs_ours.values())


def test_table_rows_come_from_the_result():
    stats = {"cosine_mean": 0.99991, "cosine_min": 0.9990, "norm_ratio_mean": 1.0, "samples": 32, "tokens": 9}
    result = {
        "extract_tok_s": 30000.0,
        "out_kind": "tmpfs",
        "bytes_per_token": 32773,
        "host_peak_rss_bytes": 9.5e9,
        "peers": [
            PeerRow("specforge", "0.2.0", "c", 10000.0, 110000.0, 2e10, {"1": stats, "final": stats}).to_json(),
            PeerRow(
                "sglang-engine", "0.5.17", "c", None, None, None, None, error="Trace\nValueError: boom\n"
            ).to_json(),
        ],
    }
    ours, sf, sg = rows(result, "r.json")
    assert "| 30,000 | 1.00 | 32,773 | 9.5 GB |" in ours
    assert "| 10,000 | 3.00 | 110,000 | 20.0 GB | 1: 0.99991 / 0.9990 | 0.99991 / 0.9990, 1.000 | `r.json` |" in sf
    assert "**error**: ValueError: boom" in sg
