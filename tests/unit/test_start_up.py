"""The start-up's order (docs/start-up.md, issue 26): the tokenizer loads on a thread of its own beside
SGLang's model load, a tokenizer that fails stops that load at once, and the timings count as ours only
the part of the tokenizer's load that the run waited for; under --verify the parity gate's reference
weights are read beside the load too, and the gate's seconds are split into their parts; a gate that fails
(its reference unreadable, or a mismatch) stops the run before any shard, on every rank, naming why.

In-process, with the session's engine handed out where the run builds its own (SGLang cannot start a
second engine in one process), so that the test decides how long the "load" lasts; bin/extract.py runs the
real load end to end in tests/e2e/test_extract_cli.py, whose start-up test checks the same marks."""

import errno
import json
import os
import re
import signal
import threading
from pathlib import Path
import shutil
import time

import numpy as np
import pytest
import torch
from extract_runs import GATE_PARTS, ROOT

from offline_extract import extract_phase, extraction, parity_gate
from offline_extract.lifecycle import interrupts
from offline_extract.lifecycle.host_use import FORWARDS, host_use_line
from offline_extract.lifecycle.timings import timing_line
from offline_extract.options import ExtractOptions

CORPUS = str(ROOT / "examples" / "corpus.jsonl")


def _run(tmp_path, model_dir, **changes):
    settings = dict(
        data=(CORPUS,),
        out=str(tmp_path / "out"),
        model=str(model_dir),
        device="cpu",
        parity_samples=0,
        tokens_per_batch=1024,
        seqs_per_batch=16,
        max_length=1024,
        progress=False,
        progress_every=0,
    )
    opts = ExtractOptions(**{**settings, **changes})
    summary = extraction.run(opts)
    return summary, json.loads((tmp_path / "out" / "manifest.json").read_text())["timings"]


@pytest.fixture
def tokenizer_loaded(monkeypatch):
    """Set once the run's tokenizer is loaded and fingerprinted, on whichever thread loads it."""
    loaded = threading.Event()
    load = extraction.Job._tokenizer_now

    def loading(job):
        tokenizer = load(job)
        loaded.set()
        return tokenizer

    monkeypatch.setattr(extraction.Job, "_tokenizer_now", loading)
    return loaded


def test_the_tokenizer_loads_while_the_model_does_and_only_the_wait_for_it_is_ours(
    tiny_engine, tiny_model_dir, tmp_path, monkeypatch, tokenizer_loaded
):
    def engine(cfg):
        # A load that ends only once the tokenizer is in: were the tokenizer loaded before or after the
        # model, it would not be.
        assert tokenizer_loaded.wait(120), "the tokenizer did not load while the model did"
        return tiny_engine

    monkeypatch.setattr(extraction, "Engine", engine)
    summary, t = _run(tmp_path, tiny_model_dir)
    assert summary.extracted == 24
    m = t["marks"]
    assert m["sglang imported"] <= m["tokenizer loading"] < m["tokenizer loaded"] < m["loaded"] <= m["tokenizer waited"]
    assert t["tokenizer_beside_load"]
    assert t["tokenizer_s"] == pytest.approx(m["tokenizer loaded"] - m["tokenizer loading"])
    # Loaded in full during the load, the tokenizer cost the run only the join after it.
    assert (
        t["tokenizer_waited_s"] == pytest.approx(m["tokenizer waited"] - m["warm"]) and t["tokenizer_waited_s"] < 0.05
    )
    assert t["ours_s"] + t["sglang_s"] + t["parity_gate_s"] == pytest.approx(t["startup_s"])
    assert t["ours_s"] == pytest.approx(t["imports_and_checks_s"] + t["tokenizer_waited_s"] + t["ours_other_s"])
    # Without --verify nothing of HF's is read or timed.
    assert "parity preload started" not in m and not [key for key in t if key.startswith("gate_")]


@pytest.fixture
def gate_spies(monkeypatch):
    """What the preload read, on which thread, once done; and what the gate built HF's model on."""
    from offline_extract.engine import reference

    seen = {"read": threading.Event()}
    read, load = reference.checkpoint_tensors, reference.load_hf_model

    def reading(model_path, resident=False):
        tensors = read(model_path, resident)
        seen.update(preloaded=tensors, thread=threading.current_thread().name, resident=resident)
        seen["read"].set()
        return tensors

    def loading(model_path, dtype, device, tensors=None, **kwargs):
        seen.update(given=tensors, hf=load(model_path, dtype, device, tensors=tensors, **kwargs))
        return seen["hf"]

    monkeypatch.setattr(reference, "checkpoint_tensors", reading)
    monkeypatch.setattr(reference, "load_hf_model", loading)
    return seen


def test_verify_reads_the_reference_weights_beside_the_load_and_the_gate_builds_hf_on_them(
    tiny_engine, tiny_model_dir, tmp_path, monkeypatch, gate_spies
):
    def engine(cfg):
        # A load that ends only once the reference's weights are in host memory: read at the gate, or before
        # the load, they would not be.
        assert gate_spies["read"].wait(120), "the reference's weights were not read while the model loaded"
        return tiny_engine

    monkeypatch.setattr(extraction, "Engine", engine)
    summary, t = _run(tmp_path, tiny_model_dir, parity_samples=4)
    assert summary.extracted == 24 and len(summary.parity) == 4 and all(row["ok"] for row in summary.parity)
    m = t["marks"]
    assert m["checked"] <= m["parity preload started"] <= m["loading"]
    assert m["parity preload read"] < m["loaded"] <= m["verifying"] < m["hf loading"]
    assert gate_spies["thread"] == "parity-preload" and gate_spies["resident"]
    # HF's model is the preloaded tensors themselves (here, on CPU in the checkpoint's dtype, not even copied):
    # the gate read no file again.
    preloaded, hf = gate_spies["preloaded"], gate_spies["hf"]
    assert gate_spies["given"] is preloaded
    assert hf.model.embed_tokens.weight.data_ptr() == preloaded["model.embed_tokens.weight"].data_ptr()
    files = sorted(tiny_model_dir.glob("*.safetensors"))
    assert t["gate_preload"] == "beside the load" and t["gate_preload_bytes"] == sum(f.stat().st_size for f in files)
    assert t["gate_preload_s"] == pytest.approx(m["parity preload read"] - m["parity preload started"])
    # The gate's seconds, split into its parts, add up.
    assert sum(t[key] for key in GATE_PARTS) == pytest.approx(t["parity_gate_s"])
    assert t["gate_hf_forwards_s"] > 0 and t["gate_engine_s"] > 0
    line = timing_line(t)
    # The feed's wait for its batches, made on their own thread (feed.prepared_ahead), and for the writer to
    # free a staging buffer are on record.
    hot_loop = t["marks"]["finished"] - t["marks"]["first forward"]
    assert 0 <= t["input_wait_s"] < hot_loop and 0 <= t["writer_wait_s"] < hot_loop
    # So is where the host's cores went meanwhile: the forwards' own thread on a core for part of the loop.
    use = t["host_use"]
    assert 0 < use["threads"][FORWARDS]["cpu_s"] <= use["host_s"] < hot_loop
    assert line.endswith(
        f"\nbetween forwards, {t['input_wait_s']:.2f} s waited for input, {t['writer_wait_s']:.2f} s for the writer"
        f"\n{host_use_line(use)}"
    )
    assert (
        f"parity gate {t['parity_gate_s']:.1f} s (engine {t['gate_engine_s']:.1f} s; HF: waited "
        f"{t['gate_preload_waited_s']:.1f} s for its weights read beside the load in {t['gate_preload_s']:.1f} s, "
    ) in line


def test_the_records_shown_follow_the_batches_though_they_are_made_ahead(
    tiny_engine, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    # The batches are made on a thread ahead of the forwards (feed.prepared_ahead): counted as read, the records
    # reached 30/30 with most of the tokens still to extract.
    monkeypatch.setattr(extraction, "Engine", lambda cfg: tiny_engine)
    from offline_extract import feed

    monkeypatch.setattr(feed, "_forwards", _slowed(feed._forwards))
    summary, _ = _run(tmp_path, tiny_model_dir, tokens_per_batch=128, progress_every=1e-9)
    lines = re.findall(r"^extract: (\d+)/24 samples, ([\d,]+) tokens", capsys.readouterr().err, re.M)
    shown = [(int(done), int(tokens.replace(",", ""))) for done, tokens in lines]
    assert shown[-1] == (24, summary.tokens) and len({done for done, _ in shown}) > 3
    # Each line's records are about its tokens' share: no more than a batch of records (128 tokens) ahead.
    per_record = summary.tokens / 24
    assert all(done <= tokens / per_record + 128 / per_record + 3 for done, tokens in shown[:-1]), shown


def _slowed(forwards):
    def slowed(engine, batch):
        time.sleep(0.05)  # a forward's time, in which the thread making batches runs ahead
        yield from forwards(engine, batch)

    return slowed


def test_verify_asking_for_more_samples_than_there_are_says_how_many_it_compared(
    tiny_engine, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    # The gate passed on the corpus's 24 samples and said nothing of the 6 more that --verify 30 asked for.
    monkeypatch.setattr(extraction, "Engine", lambda cfg: tiny_engine)
    summary, _ = _run(tmp_path, tiny_model_dir, parity_samples=30)
    assert summary.extracted == 24 and all(row["ok"] for row in summary.parity)
    said = capsys.readouterr().err.splitlines()
    assert "parity gate: 24 samples compared of the 30 --verify asked for: the run had no more to extract" in said


def test_verify_without_room_for_the_preload_reads_the_files_at_the_gate(
    tiny_engine, tiny_model_dir, tmp_path, monkeypatch, gate_spies
):
    monkeypatch.setattr(extraction, "Engine", lambda cfg: tiny_engine)
    monkeypatch.setattr(parity_gate, "_available_host_memory", lambda: 1 << 20)
    summary, t = _run(tmp_path, tiny_model_dir, parity_samples=2)
    assert summary.extracted == 24 and all(row["ok"] for row in summary.parity)
    assert not gate_spies["read"].is_set() and gate_spies["given"] is None
    assert (
        t["gate_preload"].startswith("skipped: 1 x ")
        and "exceed 50% of the host's 1.0 MB available" in t["gate_preload"]
    )
    assert "parity preload started" not in t["marks"] and "gate_preload_s" not in t
    assert sum(t[key] for key in GATE_PARTS) == pytest.approx(t["parity_gate_s"])
    assert f"HF: weights not read ahead ({t['gate_preload']}), " in timing_line(t)


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "model")
    return tmp_path / "model"


def test_a_damaged_weights_file_is_refused_naming_it_before_the_model_loads(model_copy, tmp_path, monkeypatch):
    # SGLang's load failed on it with a traceback naming no file (safetensors' "incomplete metadata, file not fully
    # covered"); the preload's failure, which waited for the gate, named only the model's folder.
    weights = model_copy / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # an interrupted download
    monkeypatch.setattr(extraction, "Engine", lambda cfg: pytest.fail("the engine was started"))
    with pytest.raises(ValueError) as refused:
        _run(tmp_path, model_copy, parity_samples=2)
    assert str(refused.value) == (
        f"{weights} is not a whole safetensors file (Error while deserializing header: incomplete metadata, file not "
        f"fully covered): it is damaged, or was cut short by an interrupted download or copy. Download or copy it "
        f"again, then re-run"
    )
    assert not (tmp_path / "out").exists()


def test_a_preload_that_fails_is_reported_at_the_gate_naming_the_file_and_claims_nothing_verified(
    tiny_engine, model_copy, tmp_path, monkeypatch
):
    """A read that fails after the run's checks (here a disk's I/O error): the failure waits for the gate (the model
    load goes on, it does not hang), names the file, what was wrong and what to do, and no shard is written."""
    from offline_extract.engine import checkpoint, parity

    def failing_read(path, *args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")  # as a failing disk reports it: no file named

    loads = []

    def engine(cfg):
        loads.append(cfg)
        return tiny_engine

    monkeypatch.setattr(checkpoint, "load_file", failing_read)
    monkeypatch.setattr(extraction, "Engine", engine)
    with pytest.raises(parity.ParityError) as stopped:
        _run(tmp_path, model_copy, parity_samples=2)
    assert str(stopped.value) == (
        f"parity gate: reading HF's reference weights from {model_copy} failed: {model_copy / 'model.safetensors'} "
        f"cannot be read (Input/output error): check its permissions and its disk, or copy it again, then re-run"
    )
    assert len(loads) == 1
    out = tmp_path / "out"
    assert not list(out.glob("*.safetensors")) and not (out / "index.json").exists()
    assert json.loads((out / "manifest.json").read_text())["status"] == "running"  # re-running resumes


@pytest.fixture
def two_rank_gate(tiny_engine, model_copy, monkeypatch):
    """Two ranks at the parity gate, meeting over a TCPStore served here as torchrun's agent serves it: the two of
    a TP=2 replica, or (tp=1) two replicas of one rank each. Runs the gate on both, rank 0 on two samples: its
    error, the peer's, and how many seconds after rank 0's the peer's came."""
    import torch.distributed as dist

    from offline_extract.data.tokenization import Sample
    from offline_extract.engine import reference
    from offline_extract.engine.distributed import Coordinator, Layout, free_port
    from offline_extract.lifecycle.timeline import Timeline
    from offline_extract.parity_gate import ParityGate

    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    ids = [np.arange(5, 5 + n) for n in (7, 12)]
    head = [
        Sample(i, str(i), "c.jsonl", i + 1, x, np.ones_like(x, dtype=np.uint8), len(x), False)
        for i, x in enumerate(ids)
    ]

    def job(rank: int, tp: int) -> ParityGate:
        """A rank's gate once its model has loaded (the phases before it are not this test's), one per rank."""
        layout = Layout(rank=rank, world_size=2, local_world_size=2, tp_size=tp)
        opts = ExtractOptions(data=(CORPUS,), model=str(model_copy), device="cpu", parity_samples=len(head))
        j = ParityGate(opts, layout, Coordinator(layout, "gate"), Timeline(), model_copy)
        j.preload = reference.ReferencePreload(str(model_copy)).start() if layout.writes else None
        return j

    def gate(tp: int = 2) -> tuple[Exception | None, Exception | None, float]:
        server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        writer, peer = job(0, tp), job(1, tp)
        stopped = {}

        def peer_gate() -> None:
            # A TP peer's own forwards of the samples are collective under real TP, and another replica's are its
            # own samples; here one engine serves both ranks, so the peer brings none and goes straight to the
            # meeting, as it would after them.
            try:
                peer.judge(tiny_engine, [])
            except Exception as e:
                stopped["peer"] = (e, time.monotonic())

        waiting = threading.Thread(target=peer_gate, daemon=True)
        waiting.start()
        failed = None
        try:
            writer.judge(tiny_engine, head)
        except Exception as e:
            failed = e
        writer_stopped = time.monotonic()
        waiting.join(timeout=10)
        try:
            assert not waiting.is_alive(), "the peer still waits at the gate"
        finally:
            del server  # a peer left waiting stops (the store is gone), and so do the heartbeats, within the test
            for _ in range(100):  # torch's warnings of the heartbeats' last beat are kept with the test's output
                if not any(t.name == "offline_extract-heartbeat" for t in threading.enumerate()):
                    break
                time.sleep(0.05)
        error, when = stopped.get("peer", (None, writer_stopped))
        return failed, error, when - writer_stopped

    return gate


@pytest.mark.parametrize("tp, replica", [(2, ""), (1, "dp replica 0: ")], ids=["tp-peer", "other-replica"])
def test_a_preload_that_fails_on_the_writing_rank_stops_the_other_rank_at_once_naming_the_cause(
    two_rank_gate, model_copy, monkeypatch, tp, replica
):
    """The writing rank's read of the reference's weights fails: its peer, waiting at the gate's meeting,
    stopped only once the writer's heartbeat had been missing for 30 s, saying only that rank 0 stopped answering
    (here, where the writer's process lives on, it waited for ever). The replica that failed is named only where
    the run has several: a run of one replica has none to its user."""
    from offline_extract.engine import checkpoint, parity

    def failing_read(path, *args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(checkpoint, "load_file", failing_read)
    failed, error, delay = two_rank_gate(tp)
    cause = (
        f"parity gate: reading HF's reference weights from {model_copy} failed: {model_copy / 'model.safetensors'} "
        f"cannot be read (Input/output error)"
    )
    assert isinstance(failed, parity.ParityError) and str(failed).startswith(cause)
    assert isinstance(error, parity.ParityError) and str(error).startswith(f"{replica}{cause}")
    assert delay < 10


# The decoder layer from whose output on HF's reference disagrees with the engine (`wrong_reference`): the tiny
# Llama's layer ids, SGLang's default [1, 3, 4] of its 8 layers, then hold one aux layer before it, which must
# pass and go unnamed, and two at or after it.
WRONG_LAYER = 3


@pytest.fixture
def wrong_reference(monkeypatch):
    """HF's reference, as the gate loads it, with decoder layer WRONG_LAYER's MLP output doubled (in HF's model
    alone: the engine and the checkpoint are untouched), as a reference on other weights or a convention gone
    wrong in one stack would disagree. Holds the rows the gate computed, whose figures its verdict must give."""
    from offline_extract.engine import parity, reference

    load, compare = reference.load_hf_model, parity.compare
    seen = {}

    def loading(*args, **kwargs):
        hf = load(*args, **kwargs)
        mlp = hf.get_decoder().layers[WRONG_LAYER].mlp
        # A new tensor: HF's weights are the preload's own, which nothing else should see changed.
        mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight.detach() * 2, requires_grad=False)
        return hf

    def comparing(*args, **kwargs):
        seen["rows"] = compare(*args, **kwargs)
        return seen["rows"]

    monkeypatch.setattr(reference, "load_hf_model", loading)
    monkeypatch.setattr(parity, "compare", comparing)
    return seen


def _names_the_failing_layers(verdict: str, rows: list, layer_ids) -> None:
    """The gate's verdict lists exactly the layers from WRONG_LAYER on, each with the figures computed for it
    (printed to 3 significant figures or 6 decimals), and the rule they broke."""
    from offline_extract.engine import parity

    assert 1 in layer_ids and WRONG_LAYER in layer_ids, "the tiny Llama's default layers changed: re-pick WRONG_LAYER"
    failing = [r for r in rows if not r.ok]
    assert [r.layer for r in failing] == [f"aux {k}" for k in layer_ids if k >= WRONG_LAYER] + ["last"]
    assert f"(required: {parity.criterion('float32', False)})" in verdict
    listed = re.findall(
        r"^ *(aux \d+|last) \(HF hidden_states\[(\d+)\]\): max_abs=(\S+) max_rel=(\S+) "
        r"cosine worst=(\S+) median=(\S+)$",
        verdict,
        re.MULTILINE,
    )
    assert [(layer, int(i)) for layer, i, *_ in listed] == [(r.layer, r.hf_index) for r in failing]
    for (*_, max_abs, max_rel, worst, median), r in zip(listed, failing):
        assert [float(max_abs), float(max_rel)] == pytest.approx([r.max_abs, r.max_rel], rel=5e-3)
        assert [float(worst), float(median)] == pytest.approx([r.cosine, r.median_cosine], abs=1e-6)
        assert r.max_rel > parity.TOLERANCES["float32"]["max_rel"]  # failed by its figures, not by a label


def test_a_mismatch_at_the_gate_stops_the_run_before_any_shard_naming_the_failing_layers(
    tiny_engine, tiny_model_dir, tmp_path, monkeypatch, capfd, wrong_reference, signals_kept
):
    """Through the command, as a user runs it: exit status 1, the gate's verdict its one error, and nothing of the
    extraction in --out."""
    from offline_extract.commands import extract as command

    monkeypatch.setattr(extraction, "Engine", lambda cfg: tiny_engine)
    out = tmp_path / "out"
    argv = ["--data", CORPUS, "--out", str(out), "--model", str(tiny_model_dir), "--device", "cpu", "--verify", "2"]
    argv += ["--tokens-per-batch", "1024", "--seqs-per-batch", "16", "--max-length", "1024", "--no-progress"]
    with pytest.raises(SystemExit) as exited:
        command.main(argv, standalone_mode=True)
    written = sorted(p.name for p in out.iterdir())
    assert not [name for name in written if "shard" in name or name == "index.json"], written
    assert exited.value.code == 1
    err = capfd.readouterr().err
    assert err.startswith("Error: parity gate failed on 2 samples in float32 ")  # one replica: none named
    assert err.endswith("The extracted states do not match HF transformers; refusing to write training data.\n")
    _names_the_failing_layers(err, wrong_reference["rows"], tiny_engine.layer_ids)
    verdict = err.removeprefix("Error: ").removesuffix("\n")
    recorded = json.loads((out / "manifest.json").read_text())
    advice = "Fix what the verdict names (or run in float32, --dtype float32), then re-run"
    assert (recorded["status"], recorded["result"]) == (
        "refused",
        {"refused_by": "the parity gate", "verdict": verdict, "advice": advice},
    )

    # What is left reads as refused, not as an interrupted run that a re-run would finish.
    from click.testing import CliRunner

    from offline_extract.commands import inspect

    checked = CliRunner().invoke(inspect.main, [str(out), "--verify"])
    assert checked.exit_code == 1, checked.output
    assert checked.output == (
        f"verified 0 shards holding 0 samples in {out}: no problems\n"
        f"refused: the run was refused by the parity gate before it extracted anything (manifest.json status "
        f"'refused'); re-running the same command gives the same verdict:\n{verdict}\n{advice}\n"
    )
    summary = CliRunner().invoke(inspect.main, [str(out)])
    assert summary.exit_code == 1 and "interrupted" not in summary.output and "unfinished" not in summary.output
    assert f"{out} was refused by the parity gate before it extracted anything" in summary.output

    # The same command again: the same verdict, and still nothing extracted.
    with pytest.raises(SystemExit) as again:
        command.main(argv, standalone_mode=True)
    assert again.value.code == 1
    assert capfd.readouterr().err.removeprefix("Error: ").removesuffix("\n") == verdict
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".lock")) == ["manifest.json"]
    assert json.loads((out / "manifest.json").read_text())["result"]["verdict"] == verdict


def test_a_mismatch_on_the_writing_rank_stops_its_tp_peer_at_once_naming_the_layers(
    two_rank_gate, tiny_engine, wrong_reference
):
    from offline_extract.engine import parity

    failed, error, delay = two_rank_gate()
    assert isinstance(failed, parity.ParityError) and isinstance(error, parity.ParityError)
    assert str(error) == str(failed)  # the writer's verdict, to the letter
    assert str(error).startswith("parity gate failed on 2 samples in float32 ")
    _names_the_failing_layers(str(error), wrong_reference["rows"], tiny_engine.layer_ids)
    assert delay < 10


def test_under_strict_the_tokenizer_loads_before_the_model_and_counts_as_ours(
    tiny_engine, tiny_model_dir, tmp_path, monkeypatch, tokenizer_loaded
):
    """--strict tokenizes every record before the model loads, so it cannot wait for the load."""

    def engine(cfg):
        assert tokenizer_loaded.is_set(), "the model loaded before the tokenizer"
        return tiny_engine

    monkeypatch.setattr(extraction, "Engine", engine)
    summary, t = _run(tmp_path, tiny_model_dir, strict=True)
    assert summary.extracted == 24
    m = t["marks"]
    assert m["checked"] <= m["tokenizer loading"] < m["tokenizer loaded"] <= m["loading"]
    assert not t["tokenizer_beside_load"] and "tokenizer waited" not in m
    assert t["tokenizer_waited_s"] == t["tokenizer_s"] > 0


@pytest.fixture
def ctrl_c_raises():
    """SIGINT as a command runs with it (cli._Command.invoke, called from Python): `interrupts.guard`, under
    which Ctrl-C raises KeyboardInterrupt. Without it (offline_extract used as a library, or a command still
    importing) the run rightly sends no interrupt."""
    with interrupts.guard(exits_at_once=False):
        yield


def test_a_tokenizer_that_fails_stops_the_model_load_at_once(tiny_model_dir, tmp_path, monkeypatch, ctrl_c_raises):
    loads = []

    def tokenizer(opts, model_dir):
        raise OSError(f"{model_dir} holds no tokenizer")

    def engine(cfg):
        started = time.monotonic()
        while time.monotonic() - started < 120:  # a long load, in Python as SGLang's is
            time.sleep(0.01)
        loads.append(cfg)

    monkeypatch.setattr(extraction, "sample_tokenizer", tokenizer)
    monkeypatch.setattr(extraction, "Engine", engine)
    started = time.monotonic()
    with pytest.raises(OSError, match="holds no tokenizer"):
        _run(tmp_path, tiny_model_dir)
    assert not loads and time.monotonic() - started < 60


def test_a_tokenizer_that_fails_after_the_load_is_raised_once_and_interrupts_nothing_later(
    tiny_engine, tiny_model_dir, tmp_path, monkeypatch
):
    loaded = threading.Event()

    def tokenizer(opts, model_dir):
        assert loaded.wait(120)
        raise ValueError("the chat template does not parse")

    def engine(cfg):
        loaded.set()
        return tiny_engine

    monkeypatch.setattr(extraction, "sample_tokenizer", tokenizer)
    monkeypatch.setattr(extraction, "Engine", engine)
    with pytest.raises(ValueError, match="the chat template does not parse"):
        _run(tmp_path, tiny_model_dir)
    for _ in range(20):  # an interrupt sent by the failed thread and left pending would land here
        time.sleep(0.01)


def test_ctrl_c_while_the_tokenizer_loads_beside_the_model_says_one_line(
    tiny_model_dir, tmp_path, monkeypatch, capfd, signals_kept
):
    # It replayed everything SGLang, torch and HF had printed while hidden (a screenful, tracebacks included where a
    # library logged one) before the line that every other Ctrl-C prints alone.
    from offline_extract.commands import extract as command

    release = threading.Event()

    def tokenizer(opts, model_dir):
        assert release.wait(120)  # still loading when Ctrl-C comes

    def engine(cfg):
        os.write(2, b"a library's line while the model loads\n")
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, on the main thread as the terminal sends it
        started = time.monotonic()
        while time.monotonic() - started < 60:  # a long load, in Python as SGLang's is
            time.sleep(0.01)

    monkeypatch.setattr(extraction, "sample_tokenizer", tokenizer)
    monkeypatch.setattr(extraction, "Engine", engine)
    out = tmp_path / "out"
    try:
        with pytest.raises(SystemExit) as exited:
            command.main(
                [
                    "--data",
                    CORPUS,
                    "--out",
                    str(out),
                    "--model",
                    str(tiny_model_dir),
                    "--device",
                    "cpu",
                    "--no-progress",
                ],
                standalone_mode=True,
            )
    finally:
        release.set()
    assert exited.value.code == 130
    # Stopped before its claim, the run had written nothing to the --out it made: it goes, and the line says so
    # (it promised that a rerun "resumes into" it).
    assert capfd.readouterr().err == f"stopped (Ctrl-C) before anything was written to {out}\n"
    assert not out.exists()


def test_the_last_forward_is_marked_after_a_long_last_samples_last_chunk(
    tiny_engine, tiny_model_dir, tmp_path, monkeypatch
):
    """The feed reads a batch ahead, so the batches run out during the last batch's first forward; the
    tail is counted from its last (here the last chunk of a sample longer than the engine's budget)."""
    from offline_extract.lifecycle.timeline import Timeline

    corpus = tmp_path / "long_last.jsonl"
    long = tiny_engine.cfg.max_tokens_per_batch + 500
    records = [{"input_ids": [5 + i % 300 for i in range(n)]} for n in (40, 60, long)]  # within the vocabulary
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    chunked_at = []
    chunks = tiny_engine.chunks

    def timed_chunks(ids, chunk):
        for part in chunks(ids, chunk):
            chunked_at.append(Timeline().now())
            yield part

    monkeypatch.setattr(tiny_engine, "chunks", timed_chunks)
    monkeypatch.setattr(extraction, "Engine", lambda cfg: tiny_engine)
    summary, t = _run(tmp_path, tiny_model_dir, data=(str(corpus),), max_length=4096)
    assert summary.extracted == 3 and len(chunked_at) == 2
    assert chunked_at[-1] <= t["marks"]["last forward"] <= t["marks"]["drained"]


def test_a_parity_gate_quicker_than_a_twentieth_of_a_second_is_still_reported():
    t = dict.fromkeys(
        (
            "startup_s ours_s imports_and_checks_s tokenizer_waited_s tokenizer_s ours_other_s sglang_s torch_import_s "
            "sglang_import_s model_load_s warm_up_s tail_s to_host_s last_shards_s rejects_and_index_s input_wait_s "
            "writer_wait_s gate_engine_s gate_hf_config_s gate_hf_to_host_s gate_hf_to_device_s gate_hf_forwards_s gate_compare_s"
        ).split(),
        0.001,
    )
    t.update(parity_gate_s=0.01, tokenizer_beside_load=True, gate_preload="no preload", marks={})
    assert "\n  parity gate 0.0 s (engine 0.0 s; HF: weights not read ahead (no preload), " in timing_line(t)
    del t["gate_engine_s"]  # a run without --verify, or a rank that only waited
    assert "parity gate" not in timing_line(t)


def test_kernels_compiled_once_the_run_was_warm_are_named_and_said(tiny_engine, tiny_model_dir, tmp_path, monkeypatch):
    """A kernel the warm-up missed compiles inside the first batches that need it, which then run slowly: the
    manifest names the cache files added after the warm-up and the start-up line says how many."""
    monkeypatch.setattr(extraction, "Engine", lambda cfg: tiny_engine)
    triton = Path(tiny_engine.jit_caches["TRITON_CACHE_DIR"])
    extract = extract_phase.ExtractPhase.run
    cache = triton / f"test-{os.getpid()}-{tmp_path.name}"

    def compiling(phase, *args):
        (cache / "kernel").mkdir(parents=True)
        (cache / "kernel" / "k.cubin").write_bytes(b"0")
        extract(phase, *args)

    try:
        _, quiet = _run(tmp_path / "a", tiny_model_dir)
        monkeypatch.setattr(extract_phase.ExtractPhase, "run", compiling)
        _, compiled = _run(tmp_path / "b", tiny_model_dir)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    assert quiet["compiled_in_extraction"] == 0 and "compiled" not in timing_line(quiet)
    name = f"{triton.name}/{cache.name}/kernel/k.cubin"
    assert compiled["compiled_in_extraction"] == 1 and compiled["compiled_in_extraction_files"] == [name]
    assert timing_line(compiled).endswith("\n1 kernel cache file compiled during the extraction, not in the warm-up")


def test_a_writer_slower_than_the_forwards_shows_as_their_wait_for_it(
    tiny_engine, tiny_model_dir, tmp_path, monkeypatch
):
    """The writer wait is the forwards' own wait for a staging buffer: with a consumer that takes 0.3 s a
    piece, the forwards run ahead by the staging depth and then wait for it, and the manifest says so. The
    consumer is made slow enough that half its time still bounds the wait on a slow CPU, whose forwards of
    this model take up to 0.15 s a piece."""
    from offline_extract import feed

    monkeypatch.setattr(extraction, "Engine", lambda cfg: tiny_engine)
    consume, pieces = feed._WriterFeed.__call__, []

    def slow(self, piece, staged):
        pieces.append(piece)
        time.sleep(0.3)
        consume(self, piece, staged)

    monkeypatch.setattr(feed._WriterFeed, "__call__", slow)
    summary, t = _run(tmp_path, tiny_model_dir, tokens_per_batch=128)
    ahead = 3  # feed.staging_buffers' depth: the pieces staged before the first wait
    assert summary.extracted == 24 and len(pieces) > ahead + 2
    assert t["writer_wait_s"] >= 0.3 * (len(pieces) - ahead - 1) * 0.5
    assert t["input_wait_s"] < t["writer_wait_s"]
