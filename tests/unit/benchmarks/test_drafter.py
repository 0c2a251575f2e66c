"""benchmarks/drafter (issue 36): the prompt builder, the steps' resume rules, the states our side makes
on CPU through the real engine (bin/extract.py and bin/export.py on the embedded model), SpecForge's
files found back by their tokens, the tied-embedding copy, and the table."""

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from benchmarks.drafter import layout as lay
from benchmarks.drafter import prompts, sglang_runs, states, table, train
from benchmarks.drafter.prompts import dump_jsonl_gz, load_jsonl_gz

ROOT = Path(__file__).resolve().parents[3]


def _fake_stdlib(root: Path, modules: int = 30, funcs: int = 4) -> Path:
    """A standard library stand-in: `modules` modules of `funcs` documented functions, and a test package
    whose docstrings must never be used."""
    root.mkdir(parents=True, exist_ok=True)
    for m in range(modules):
        body = [f'"""Module m{m}: what it is for, said at enough length to be explained."""']
        body += [
            f'def f{i}():\n    """Function {i} of module {m} does thing {i} with enough words to count."""\n'
            for i in range(funcs)
        ]
        (root / f"m{m}.py").write_text("\n".join(body))
    (root / "test").mkdir()
    (root / "test" / "t.py").write_text('"""A test module docstring that is long enough to be used if it were read."""')
    (root / "bad.py").write_text("def (:\n")  # not Python: skipped
    return root


def test_prompts_are_deterministic_counted_and_held_out_by_module(tmp_path):
    root = _fake_stdlib(tmp_path)
    a, b = prompts.build(200, 20, root), prompts.build(200, 20, root)
    assert dump_jsonl_gz(a.train) == dump_jsonl_gz(b.train) and dump_jsonl_gz(a.heldout) == dump_jsonl_gz(b.heldout)
    assert (len(a.train), len(a.heldout)) == (200, 20)
    train_modules = {r["source"] for r in a.train}
    held_modules = {r["source"] for r in a.heldout}
    assert held_modules and not train_modules & held_modules
    assert set(a.source["heldout_modules"]) >= held_modules
    assert not any("test" in r["source"] for r in a.train + a.heldout)
    # Each docstring gives TEMPLATES_PER_DOC training prompts, no two alike.
    texts = [r["conversations"][1]["value"] for r in a.train]
    assert len(set(texts)) == len(texts)
    for r in a.train[:5]:
        assert [t["from"] for t in r["conversations"]] == ["system", "human"]
        assert r["conversations"][0]["value"] == prompts.SYSTEM
    with pytest.raises(ValueError, match="fewer than"):
        prompts.build(10_000, 20, root)


def test_excerpt_cuts_at_a_line_break():
    text = "\n".join(f"line {i} " + "x" * 30 for i in range(40))
    cut = prompts.excerpt(text, 100)
    assert len(cut) <= 100 and text.startswith(cut) and text[len(cut)] == "\n"


def test_the_real_stdlib_gives_the_issues_counts():
    built = prompts.build(20480, 200)
    assert len(built.train) == 20480 and len(built.heldout) == 200
    assert not {r["source"] for r in built.train} & {r["source"] for r in built.heldout}
    assert built.source["licence"] == prompts.LICENCE


def test_pipeline_prompts_step_is_skipped_once_complete(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "drafter" / "pipeline.py"),
        "--data",
        str(tmp_path / "d"),
        "prompts",
        "--train",
        "300",
        "--heldout",
        "20",
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "300 training and 20 held-out" in first.stdout
    made = (tmp_path / "d" / "prompts" / "train.jsonl.gz").read_bytes()
    second = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "complete" in second.stdout
    assert (tmp_path / "d" / "prompts" / "train.jsonl.gz").read_bytes() == made
    assert lay.read_json(tmp_path / "d" / "prompts" / "DONE.json")["train"] == 300


class _FakeEngine:
    """sglang.Engine's generate and shutdown, answering each prompt with its length."""

    def __init__(self, calls):
        self.calls = calls

    def generate(self, input_ids, sampling_params):
        self.calls.append(len(input_ids))
        assert sampling_params["temperature"] == 0.0
        return [
            {
                "text": f"answer of {len(ids)} tokens",
                "output_ids": [1, 2],
                "meta_info": {"completion_tokens": 2, "finish_reason": {"type": "length"}},
            }
            for ids in input_ids
        ]

    def shutdown(self):
        pass


def _prompts_layout(tmp_path, n_train: int, n_held: int = 4) -> lay.Layout:
    layout = lay.Layout(tmp_path / "data", tmp_path / "scratch")
    built = prompts.build(n_train, n_held, _fake_stdlib(tmp_path / "lib"))
    layout.prompts.mkdir(parents=True)
    (layout.prompts / "train.jsonl.gz").write_bytes(dump_jsonl_gz(built.train))
    (layout.prompts / "heldout.jsonl.gz").write_bytes(dump_jsonl_gz(built.heldout))
    lay.mark_done(layout.prompts, **built.source)
    return layout


def test_responses_resume_from_the_parts_written(tmp_path, monkeypatch, tiny_model_dir):
    layout = _prompts_layout(tmp_path, 10)
    calls = []
    monkeypatch.setattr(sglang_runs, "engine", lambda model, device, **kw: _FakeEngine(calls))
    # A deadline already past: no part is started, nothing is marked done.
    done = sglang_runs.responses(layout, str(tiny_model_dir), chunk=4, max_new_tokens=8, deadline=0)
    assert done["written"] == 0 and not lay.is_done(layout.responses) and calls == []
    # A call cut after its first part, as a device call's limit would.
    real_generate = _FakeEngine.generate

    def cut(self, input_ids, sampling_params):
        if self.calls:
            raise KeyboardInterrupt
        return real_generate(self, input_ids, sampling_params)

    monkeypatch.setattr(_FakeEngine, "generate", cut)
    with pytest.raises(KeyboardInterrupt):
        sglang_runs.responses(layout, str(tiny_model_dir), chunk=4, max_new_tokens=8, deadline=float("inf"))
    assert [p.name for p in sorted(layout.responses.glob("part_*"))] == ["part_0000.jsonl.gz"]
    monkeypatch.setattr(_FakeEngine, "generate", real_generate)
    calls.clear()
    done = sglang_runs.responses(layout, str(tiny_model_dir), chunk=4, max_new_tokens=8, deadline=float("inf"))
    assert (done["kept"], done["written"], calls) == (1, 2, [4, 2])
    assert lay.read_json(lay.marker(layout.responses))["completion_tokens"] == 20
    answers = sglang_runs.load_responses(layout)
    assert len(answers) == 10 and all(a.startswith("answer of ") for a in answers.values())


@pytest.mark.slow
def test_responses_and_the_target_served_through_sglang_engine_on_cpu(
    tmp_path, tiny_model_dir, processes_end_with_the_test
):
    """The two sglang.Engine steps as the device calls run them, on CPU with the embedded model: every
    training prompt answered greedily in its part, then the held-out prompts served by the target alone."""
    layout = _prompts_layout(tmp_path, 6)
    pipeline = [
        sys.executable,
        str(ROOT / "benchmarks" / "drafter" / "pipeline.py"),
        "--device",
        "cpu",
        "--model",
        str(tiny_model_dir),
        "--data",
        str(layout.data),
        "--scratch",
        str(layout.scratch),
    ]
    run = subprocess.run(
        [*pipeline, "responses", "--max-new-tokens", "6", "--chunk", "4"], capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 parts written, 0 kept, of 2; complete" in run.stdout
    rows = [r for p in sorted(layout.responses.glob("part_*")) for r in load_jsonl_gz(p)]
    assert [r["id"] for r in rows] == [r["id"] for r in load_jsonl_gz(layout.prompts / "train.jsonl.gz")]
    assert all(0 < r["completion_tokens"] <= 6 for r in rows)
    # SGLang's own lines in the step's log: the scheduler's bound as resolved, and its batches.
    log = (layout.logs / "responses.log").read_text()
    assert f"max_running_requests={sglang_runs.RESPONSES_BATCH}," in log and "Prefill batch" in log
    run = subprocess.run(
        [*pipeline, "serve", "target", "--max-new-tokens", "6", "--speed-prompts", "2"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    served = lay.read_json(layout.serve_record("target"))
    assert served["prompts"] == 4 and served["batch1_prompts"] == 2 and served["batch1_decode_tok_s"] > 0
    assert served["drafter"] is None and "accept_length" not in served
    assert "Prefill batch" in (layout.logs / "serve_target.log").read_text()
    assert [json.loads(line)["step"] for line in layout.commands.read_text().splitlines()] == [
        "responses",
        "serve target",
    ]


def test_acceptance_from_meta_info():
    metas = [
        {"completion_tokens": 10, "spec_verify_ct": 5, "spec_accept_histogram": [1, 2, 2]},
        {"completion_tokens": 6, "spec_verify_ct": 3, "spec_accept_histogram": [2, 0, 0, 1]},
    ]
    got = sglang_runs.acceptance(metas)
    assert got["accept_length"] == 16 / 8
    assert got["accept_histogram"] == [3, 2, 2, 1]
    assert got["first_position_accept_rate"] == 5 / 8


def _responses_for(layout: lay.Layout) -> None:
    records = load_jsonl_gz(layout.prompts / "train.jsonl.gz")
    rng = random.Random(0)
    rows = [
        {
            "id": r["id"],
            "text": " ".join(rng.choice(["alpha", "beta", "gamma"]) for _ in range(rng.randint(3, 12))),
            "completion_tokens": 1,
            "finish_reason": "stop",
        }
        for r in records
    ]
    layout.responses.mkdir(parents=True)
    (layout.responses / "part_0000.jsonl.gz").write_bytes(dump_jsonl_gz(rows))
    lay.mark_done(layout.responses)


def _final_norm(model_dir: Path):
    weight = load_file(model_dir / "model.safetensors")["model.norm.weight"].float()
    eps = json.loads((model_dir / "config.json").read_text())["rms_norm_eps"]
    return lambda h: (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)) * weight


@pytest.mark.slow
def test_our_states_on_cpu_through_the_engine(tmp_path, tiny_model_dir, processes_end_with_the_test):
    """ours and prenorm, made by bin/extract.py on the embedded model: views of every corpus record,
    SpecForge's keys, the same aux states, and prenorm's final state the one before ours' final norm."""
    layout = _prompts_layout(tmp_path, 6)
    _responses_for(layout)
    kw = {"max_length": 512, "keep_store": False, "specforge_batch_size": 2, "attention_backend": "triton"}
    made = {v: states.states(layout, v, str(tiny_model_dir), **kw) for v in ("ours", "prenorm")}
    assert made["ours"]["layers"]["final_state"] == "post-norm"
    assert made["prenorm"]["layers"]["final_state"] == "pre-norm"
    assert not layout.store("ours").exists()  # dropped once exported
    norm = _final_norm(Path(tiny_model_dir))
    for j in range(6):
        a = torch.load(states.specforge_path_of(layout.view("ours"), j), weights_only=True)
        d = torch.load(states.specforge_path_of(layout.view("prenorm"), j), weights_only=True)
        assert set(a) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert torch.equal(a["input_ids"], d["input_ids"]) and torch.equal(a["aux_hidden_state"], d["aux_hidden_state"])
        assert a["loss_mask"].sum() > 0
        assert not torch.allclose(a["hidden_state"].float(), d["hidden_state"].float(), atol=1e-2)
        assert torch.allclose(norm(d["hidden_state"]), a["hidden_state"].float(), atol=2e-2, rtol=2e-2)
    # Complete: skipped, and the command log has both steps' commands.
    assert states.states(layout, "ours", str(tiny_model_dir), **kw)["skipped"]
    logged = [json.loads(line)["step"] for line in layout.commands.read_text().splitlines()]
    assert logged == ["states ours: extract", "states ours: export", "states prenorm: extract"]


def test_offbyone_asks_for_each_default_layer_one_deeper(tmp_path, tiny_model_dir):
    assert states.offbyone_layers(30) == [2, 15, 27]
    argv = states.extract_argv(lay.Layout(tmp_path, tmp_path), "offbyone", str(tiny_model_dir), 512)
    assert argv[argv.index("--layers") + 1] == ",".join(map(str, states.offbyone_layers(8)))
    assert "--store" in states.extract_argv(lay.Layout(tmp_path, tmp_path), "fp8", str(tiny_model_dir), 512)


def test_specforge_files_found_back_by_their_tokens(tmp_path, tiny_model_dir):
    """SpecForge numbers its files in its shuffled order and pads each sample to its batch's longest: the
    view puts each under its corpus position, a chat the corpus holds twice gets both its files, and a file
    of another corpus is named as unmatched."""
    from transformers import AutoTokenizer

    layout = _prompts_layout(tmp_path, 5)
    _responses_for(layout)
    states.corpus(layout)
    lines = layout.corpus.read_text().splitlines()
    twice = {**json.loads(lines[2]), "id": "train-000005"}
    lines.append(json.dumps(twice))
    layout.corpus.write_text("\n".join(lines) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = states.expected_ids(layout, tokenizer, 512)
    assert sorted(expected.values()) == [[0], [1], [2, 5], [3], [4]]
    order = [3, 0, 5, 4, 1, 2]
    feats = layout.features("specforge")
    for i, j in enumerate(order):
        r = json.loads(lines[j])
        text = tokenizer.apply_chat_template(sglang_runs.messages(r), tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        padded = torch.tensor(ids + [0] * 7, dtype=torch.int64)
        path = states.specforge_path_of(feats, i)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"input_ids": padded, "loss_mask": torch.zeros_like(padded)}, path)
    stray = states.specforge_path_of(feats, 6)
    torch.save({"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.zeros(3, dtype=torch.int64)}, stray)
    found, unmatched = states.specforge_positions(layout, str(tiny_model_dir), 512)
    assert unmatched == [str(stray)]
    # The chat held twice: its two files, in sorted order, go to its two positions in corpus order.
    by_file = {2: "data_2.ckpt", 5: "data_5.ckpt"}
    assert {j: Path(p).name for j, p in found.items()} == {
        j: by_file.get(j, f"data_{i}.ckpt") for i, j in enumerate(order)
    }
    assert states.make_view(layout, "specforge", found) == 6
    for j in range(6):
        assert Path(states.specforge_path_of(layout.view("specforge"), j)).resolve() == Path(found[j]).resolve()


def test_unpadded_keeps_a_leading_zero():
    assert states.unpadded(np.array([0, 5, 6, 0, 0])).tolist() == [0, 5, 6]


def test_specforge_gets_a_copy_it_can_load(tmp_path, tiny_model_dir):
    """A single-file checkpoint gets an index naming every tensor, linked files, and lm_head_key the
    checkpoint's own lm_head (the embedded model is untied); a tied one reads the embedding."""
    keys = train.target_copy(str(tiny_model_dir), tmp_path / "copy")
    index = json.loads((tmp_path / "copy" / "model.safetensors.index.json").read_text())
    names = set(load_file(Path(tiny_model_dir) / "model.safetensors"))
    assert set(index["weight_map"]) == names and set(index["weight_map"].values()) == {"model.safetensors"}
    assert keys["index_added"] and keys["lm_head_key"] == "lm_head.weight"
    assert (tmp_path / "copy" / "config.json").resolve() == (Path(tiny_model_dir) / "config.json").resolve()
    assert list(Path(tiny_model_dir).glob("*.index.json")) == []  # the target is untouched
    tied = tmp_path / "tied"
    tied.mkdir()
    from safetensors.torch import save_file

    weights = load_file(Path(tiny_model_dir) / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tied / "model.safetensors")
    (tied / "config.json").write_text((Path(tiny_model_dir) / "config.json").read_text())
    assert train.target_copy(str(tied), tmp_path / "tied-copy")["lm_head_key"] == "model.embed_tokens.weight"


def test_draft_config_and_training_config(tmp_path, tiny_model_dir):
    layout = lay.Layout(tmp_path / "d", tmp_path / "s")
    draft = train.write_draft_config(str(tiny_model_dir), layout.draft_config)
    target = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"] and draft["num_hidden_layers"] == 1
    assert draft["hidden_size"] == target["hidden_size"] and draft["draft_vocab_size"] == target["vocab_size"]
    keys = {"target_copy": "T", "embedding_key": "e", "lm_head_key": "h"}
    a = train.config(
        layout, "ours-s0", layout.view("ours"), keys, seed=0, steps=10, batch_size=4, max_length=512, learning_rate=1e-4
    )
    b = train.config(
        layout,
        "specforge-s0",
        layout.view("specforge"),
        keys,
        seed=0,
        steps=10,
        batch_size=4,
        max_length=512,
        learning_rate=1e-4,
    )
    assert a["training"] == b["training"] and a["model"] == b["model"]
    assert a["data"]["hidden_states_path"] != b["data"]["hidden_states_path"]


def _trained(name: str, steps: int = 2000) -> dict:
    variant, seed = name.rsplit("-s", 1)
    return {
        "variant": variant,
        "seed": int(seed),
        "steps": steps,
        "batch_size": 4,
        "learning_rate": 1e-4,
        "max_length": 2048,
    }


def _serve(name, length, speed, tmp: lay.Layout, samples=100, steps=2000, served_steps=None):
    rec = {"batch1_decode_tok_s": speed, "accept_length": length, "first_position_accept_rate": length and length / 4}
    if name != table.TARGET:
        rec["trained"] = _trained(name, served_steps or steps)
        lay.write_json(tmp.train_record(name), {"view": {"view_samples": samples}, **_trained(name, steps)})
    lay.write_json(tmp.serve_record(name), rec)


def test_table_judges_the_issues_targets(tmp_path):
    layout = lay.Layout(tmp_path, tmp_path / "s")
    _serve("target", None, 100.0, layout)
    for name, length in (
        ("ours-s0", 2.0),
        ("ours-s1", 2.02),
        ("specforge-s0", 2.01),
        ("specforge-s1", 2.03),
        ("offbyone-s0", 1.2),
        ("prenorm-s0", 2.0),
        ("fp8-s0", 1.99),
    ):
        _serve(name, length, 150.0, layout)
    result = table.table(layout)
    v = result["verdicts"]
    assert v["ours_over_specforge"] == pytest.approx(2.01 / 2.02)
    assert v["ours_reaches_parity"] is True
    assert v["gap_within_seed_noise"] is True  # 0.01 behind, seeds 0.02 apart
    assert v["offbyone_margin_in_seed_spreads"] == pytest.approx((2.01 - 1.2) / 0.02)
    assert v["prenorm_over_ours"] == pytest.approx(2.0 / 2.01) and v["prenorm_caught"] is False
    assert v["fp8_over_ours"] == pytest.approx(1.99 / 2.01) and v["fp8_holds"] is True
    for name, length in (("specforge-s0", 2.10), ("specforge-s1", 2.11)):  # (b) ahead by more than seeds explain
        _serve(name, length, 150.0, layout)
    assert table.table(layout)["verdicts"]["gap_within_seed_noise"] is False
    md = result["markdown"]
    assert "| none (target alone) | | | | | 100 | 1.00 |" in md
    assert "| (c) ours, aux layers one deeper | 0 | 100 | 1.200 | 0.300 | 150 | 1.50 |" in md


def test_table_refuses_figures_of_drafters_trained_unalike_or_since_they_were_served(tmp_path):
    # ours-s0 was trained and served for 500 steps, then trained again for 2,000: its serving record is of the
    # drafter before. specforge-s0 stands beside it at 2,000.
    layout = lay.Layout(tmp_path, tmp_path / "s")
    _serve("ours-s0", 1.29, 40.0, layout, steps=2000, served_steps=500)
    _serve("specforge-s0", 1.6, 45.0, layout)
    with pytest.raises(ValueError, match="ours-s0 was served as trained with .*'steps': 500.*'steps': 2000"):
        table.table(layout)
    _serve("ours-s0", 1.29, 40.0, layout, steps=500)
    with pytest.raises(ValueError, match=r"different steps \(ours-s0 500, specforge-s0 2000\)"):
        table.table(layout)
    _serve("ours-s0", 1.59, 40.0, layout)
    assert table.table(layout)["verdicts"]["ours_over_specforge"] == pytest.approx(1.59 / 1.6)


def test_a_drafter_trained_again_since_it_was_served_is_served_again(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from benchmarks.drafter import pipeline

    layout = lay.Layout(tmp_path / "d", tmp_path / "s")
    served = []

    def serving(model, drafter, prompts, **kwargs):  # the engine's figures, which need a GPU for EAGLE-3
        served.append(drafter)
        return {"drafter": drafter, "accept_length": 1.6, "batch1_decode_tok_s": 45.0}

    monkeypatch.setattr(sglang_runs, "serve", serving)
    layout.prompts.mkdir(parents=True)
    (layout.prompts / "heldout.jsonl.gz").write_bytes(dump_jsonl_gz([]))
    args = ["--data", str(layout.data), "--scratch", str(layout.scratch), "--model", str(tmp_path), "serve", "ours-s0"]
    out = CliRunner().invoke(pipeline.main, args)
    assert out.exit_code == 1 and "drafter ours-s0 is not on this machine" in out.output
    lay.mark_done(layout.drafter("ours-s0"), **_trained("ours-s0", 500))
    lay.write_json(layout.serve_record("ours-s0"), {"accept_length": 1.29, "trained": _trained("ours-s0", 500)})
    out = CliRunner().invoke(pipeline.main, args)
    assert out.exit_code == 0 and "complete" in out.output and not served  # the same drafter: not again
    lay.mark_done(layout.drafter("ours-s0"), **_trained("ours-s0", 2000))
    out = CliRunner().invoke(pipeline.main, args)
    assert out.exit_code == 0 and "serving it again" in out.output, out.output
    assert served == [str(layout.drafter("ours-s0"))]
    record = lay.read_json(layout.serve_record("ours-s0"))
    assert record["trained"] == _trained("ours-s0", 2000) and record["accept_length"] == 1.6


def test_table_with_nothing_measured(tmp_path):
    result = table.table(lay.Layout(tmp_path, tmp_path))
    assert result["verdicts"]["ours_over_specforge"] is None
    assert "not measured" in result["markdown"]


def test_every_step_answers_help():
    script = str(ROOT / "benchmarks" / "drafter" / "pipeline.py")
    out = subprocess.run([sys.executable, script, "-h"], capture_output=True, text=True, check=True).stdout
    steps = ("prompts", "responses", "states", "train", "serve", "table", "pack", "drop", "status")
    assert all(f"  {s} " in out for s in steps)
    for step in steps:
        subprocess.run([sys.executable, script, step, "--help"], capture_output=True, text=True, check=True)


def test_pack_brings_back_what_the_prompts_are_not(tmp_path):
    import tarfile

    layout = _prompts_layout(tmp_path, 5)
    _responses_for(layout)
    lay.write_json(layout.serve_record("target"), {"batch1_decode_tok_s": 1.0})
    (layout.scratch / "logs").mkdir(parents=True)
    (layout.scratch / "logs" / "extract_ours.log").write_text("ok\n")
    script = str(ROOT / "benchmarks" / "drafter" / "pipeline.py")
    subprocess.run(
        [
            sys.executable,
            script,
            "--data",
            str(layout.data),
            "--scratch",
            str(layout.scratch),
            "pack",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    with tarfile.open(tmp_path / "out" / "drafter-data.tgz") as tar:
        names = set(tar.getnames())
    assert {
        "responses/part_0000.jsonl.gz",
        "responses/DONE.json",
        "serve/target.json",
        "logs/extract_ours.log",
    } <= names
    assert not any(n.startswith("prompts") for n in names)


def test_compare_names_what_separates_two_variants_files(tmp_path):
    """Unpadded files against padded ones: the trainer's last-position zeroing then trains one more token of
    the padded side, a loss mask that differs is counted, and a perturbed layer shows in its cosines."""
    from benchmarks.drafter import compare

    layout = lay.Layout(tmp_path / "data", tmp_path / "scratch")
    gen = torch.Generator().manual_seed(0)
    for variant in ("ours", "specforge"):
        feats = layout.features(variant)
        positions = {}
        for j in range(4):
            ids = torch.tensor([5, 6, 7, 8, 9 + j])
            mask = torch.tensor([0, 0, 1, 1, 1])
            aux = torch.randn(1, 5, 12, generator=torch.Generator().manual_seed(j))
            final = torch.randn(1, 5, 4, generator=torch.Generator().manual_seed(100 + j))
            if variant == "specforge":
                pad = 2
                ids, mask = (
                    torch.cat([ids, torch.zeros(pad, dtype=ids.dtype)]),
                    torch.cat([mask, torch.zeros(pad, dtype=mask.dtype)]),
                )
                aux, final = (
                    torch.cat([aux, torch.randn(1, pad, 12, generator=gen)], 1),
                    torch.cat([final, torch.randn(1, pad, 4, generator=gen)], 1),
                )
                if j == 1:
                    mask[1] = 1
                if j == 2:
                    aux[0, 3, 4:8] = -aux[0, 3, 4:8]  # aux layer 1 of token 3, turned around
            path = states.specforge_path_of(feats, j)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"input_ids": ids, "loss_mask": mask, "hidden_state": final, "aux_hidden_state": aux}, path)
            positions[j] = str(path)
        states.make_view(layout, variant, positions)
        lay.mark_done(layout.view(variant), view_samples=4)
    result = compare.compare(layout, "ours", "specforge", states_every=1, workers=1)
    assert result["records"] == 4 and result["ids_differ"] == []
    assert result["stored_masks_differ"] == 1
    assert result["padding_tokens_b"] == 8
    # Ours: 3 loss tokens less the last = 2 a record; theirs 3 (4 in record 1).
    assert result["trained_positions"] == {"a": 8, "b": 13}
    assert {"token": "9", "from_end": -1, "count": 1} in result["trained_only"]["b"]
    assert result["states"]["aux_1"]["min_cosine"] < -0.99 and result["states"]["aux_1"]["worst"] == (2, 3)
    for layer in ("aux_0", "aux_2", "final"):
        assert result["states"][layer]["min_cosine"] > 0.9999
