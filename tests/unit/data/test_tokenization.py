import json
import logging
import re

import numpy as np
import pytest
from extract_runs import ROOT
from transformers import AutoTokenizer

from offline_extract.data.corpus import ImageRef, Record, Reject, read_corpus
from offline_extract.data import tokenization
from offline_extract.data.tokenization import Sample, SampleTokenizer, tokenizer_files

EXAMPLES = ROOT / "examples" / "corpus.jsonl"


@pytest.fixture(scope="module")
def load_tokenizer(tiny_model_dir):
    return lambda: AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def tok(load_tokenizer):
    return load_tokenizer()


def chat(*messages, fmt="openai", id="c"):
    return Record(source="s.jsonl", line=4, index=3, id=id, format=fmt, messages=tuple(messages))


def runs(mask):
    """(start, stop) of each run of ones in a 0/1 mask."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[0::2], edges[1::2]))


def check_assistant_runs(tok, sample, contents):
    """Each masked run is exactly one assistant turn: its first content token through its <|end|>."""
    end_id = tok.convert_tokens_to_ids("<|end|>")
    spans = runs(sample.loss_mask)
    assert len(spans) == len(contents)
    for (start, stop), content in zip(spans, contents):
        ids = sample.input_ids[start:stop]
        assert tok.decode(ids) == content + "<|end|>"
        assert ids[0] == tok(content, add_special_tokens=False)["input_ids"][0]
        assert ids[-1] == end_id
        # The token before the run is the header's newline, which inference feeds rather than generates.
        assert tok.convert_ids_to_tokens(sample.input_ids[start - 2 : start].tolist()) == ["<|assistant|>", "Ċ"]


def test_multi_turn_chat_with_system_prompt(tok):
    rec = chat(
        ("system", "Be brief."),
        ("user", "What is the capital of France?"),
        ("assistant", "The capital of France is Paris."),
        ("user", "How many legs does a spider have?"),
        ("assistant", "A spider has eight legs."),
        ("user", "Thank you!"),
        ("assistant", "You are welcome."),
    )
    sample = SampleTokenizer(tok, max_length=1024)(rec)
    assert isinstance(sample, Sample)
    assert (sample.index, sample.id, sample.source, sample.line) == (3, "c", "s.jsonl", 4)
    assert sample.input_ids.dtype == np.int32 and sample.loss_mask.dtype == np.uint8
    full = tok.apply_chat_template([{"role": r, "content": c} for r, c in rec.messages], tokenize=False)
    assert sample.input_ids.tolist() == tok(full, add_special_tokens=False)["input_ids"]
    assert sample.input_ids[0] == tok.bos_token_id
    contents = ["The capital of France is Paris.", "A spider has eight legs.", "You are welcome."]
    check_assistant_runs(tok, sample, contents)
    masked = tok.decode(sample.input_ids[sample.loss_mask.astype(bool)])
    assert masked == "".join(c + "<|end|>" for c in contents)
    assert (sample.num_tokens, sample.source_len, sample.truncated) == (len(sample.input_ids), sample.num_tokens, False)


def test_sharegpt_and_openai_tokenize_identically(tok, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(
        json.dumps({"conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi!"}]})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}]})
        + "\n"
    )
    st = SampleTokenizer(tok, max_length=64)
    a, b = (st(r) for r in read_corpus([path]))
    assert a.input_ids.tolist() == b.input_ids.tolist()
    assert a.loss_mask.tolist() == b.loss_mask.tolist()
    check_assistant_runs(tok, a, ["Hi!"])


def test_trailing_user_turn_opening_assistant_and_empty_reply(tok):
    st = SampleTokenizer(tok, max_length=256)
    opening = st(chat(("assistant", "Hello, how are you today?"), ("user", "I am fine."), ("assistant", "")))
    spans = runs(opening.loss_mask)
    assert tok.decode(opening.input_ids[slice(*spans[0])]) == "Hello, how are you today?<|end|>"
    # An empty reply still teaches the drafter to end the turn.
    assert opening.input_ids[slice(*spans[1])].tolist() == [tok.convert_tokens_to_ids("<|end|>")]

    trailing = st(chat(("user", "Hi"), ("assistant", "Hello."), ("user", "Goodbye.")))
    check_assistant_runs(tok, trailing, ["Hello."])
    last_user = np.flatnonzero(trailing.input_ids == tok.convert_tokens_to_ids("<|user|>"))[-1]
    assert tok.decode(trailing.input_ids[last_user:]) == "<|user|>\nGoodbye.<|end|>"
    assert not trailing.loss_mask[last_user:].any()


def test_token_straddling_the_span_start_is_excluded(load_tokenizer):
    tok = load_tokenizer()
    # A header that ends mid-word, so BPE merges its tail with the reply's first characters.
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' }}"
        "{% if m['role'] == 'assistant' %}Re{% endif %}{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>Re{% endif %}"
    )
    sample = SampleTokenizer(tok, max_length=64)(chat(("user", "Explain."), ("assistant", "cursion is fun")))
    full = tok.apply_chat_template(
        [{"role": "user", "content": "Explain."}, {"role": "assistant", "content": "cursion is fun"}], tokenize=False
    )
    offsets = tok(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    content_start = full.index("cursion")
    straddling = [i for i, (s, e) in enumerate(offsets) if s < content_start < e]
    assert len(straddling) == 1, "precondition: the tokenizer merges across the header boundary"
    assert sample.loss_mask[straddling[0]] == 0
    assert sample.loss_mask[straddling[0] + 1] == 1
    masked = tok.decode(sample.input_ids[sample.loss_mask.astype(bool)])
    assert "cursion is fun<|end|>".endswith(masked) and len(masked) < len("cursion is fun<|end|>")


def test_template_that_is_not_prefix_stable_is_rejected(load_tokenizer):
    tok = load_tokenizer()
    # Like templates that render the final assistant turn differently from earlier ones.
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' }}\n"
        "{% if loop.last %}[final]{% endif %}{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    st = SampleTokenizer(tok, max_length=64)
    result = st(chat(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")))
    assert result == Reject(
        source="s.jsonl",
        line=4,
        index=3,
        id="c",
        reason="chat template is not prefix-stable: messages[:1] with the generation prompt does not render as a "
        "prefix of the whole conversation",
    )


def test_template_errors_are_rejects_and_missing_template_raises(load_tokenizer):
    tok = load_tokenizer()
    tok.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    st = SampleTokenizer(tok, max_length=64)
    rej = st(chat(("system", "s"), ("user", "u"), ("assistant", "a")))
    assert isinstance(rej, Reject) and rej.reason == "chat template error: System role not supported"
    assert isinstance(st(chat(("user", "u"), ("assistant", "a"))), Sample)

    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        st(chat(("user", "u"), ("assistant", "a")))
    assert isinstance(st(Record("s", 1, 0, "t", "text", text="ok")), Sample)


def test_a_text_only_model_refuses_an_image_record_naming_it_and_the_model(tok):
    image = Record(
        source="s.jsonl",
        line=9,
        index=8,
        id="pic",
        format="openai",
        messages=(("user", (0, "what is it?")), ("assistant", "a cat")),
        images=(ImageRef("messages[0].content[0].image_url", "/data/cat.png"),),
    )
    tokenizer = SampleTokenizer(tok, max_length=64, model="/models/tiny-llama")
    with pytest.raises(ValueError) as refused:
        tokenizer.many([chat(("user", "q"), ("assistant", "a")), image])
    assert str(refused.value) == (
        "s.jsonl:9 (id 'pic') holds 1 image, but /models/tiny-llama is a text-only model (its config.json has no "
        "vision_config): nothing of it reads images. Give a vision-language model, or a corpus without images"
    )


def test_plain_text(tok):
    text = "The quick brown fox jumps over the lazy dog."
    sample = SampleTokenizer(tok, max_length=64)(Record("s", 1, 0, "t", "text", text=text))
    assert sample.input_ids[0] == tok.bos_token_id
    assert sample.input_ids.tolist() == tok(text)["input_ids"]
    assert tok.decode(sample.input_ids[1:]) == text
    assert sample.loss_mask.tolist() == [1] * sample.num_tokens


def test_pre_tokenized_with_and_without_loss_mask(tok):
    st = SampleTokenizer(tok, max_length=64)
    with_mask = st(Record("s", 1, 0, "t", "tokens", input_ids=(10, 11, 383), loss_mask=(0, 1, 1)))
    assert with_mask.input_ids.tolist() == [10, 11, 383] and with_mask.loss_mask.tolist() == [0, 1, 1]
    without = st(Record("s", 2, 1, "u", "tokens", input_ids=(10, 11, 12)))
    assert without.loss_mask.tolist() == [1, 1, 1]
    assert without.input_ids.dtype == np.int32 and without.loss_mask.dtype == np.uint8

    too_big = st(Record("s", 3, 2, "v", "tokens", input_ids=(10, 384, 999, 11)))
    assert too_big == Reject("s", 3, 2, "v", f"input_ids[1] = 384 >= vocab size {len(tok)}")
    assert len(tok) == 384

    empty = st(Record("s", 4, 3, "w", "tokens", input_ids=()))
    assert empty == Reject("s", 4, 3, "w", "tokenizes to zero tokens")


def test_truncate_and_skip(tok):
    rec = Record("s", 1, 0, "t", "text", text="Hidden states are vectors of floating point numbers.")
    full = SampleTokenizer(tok, max_length=1000)(rec)
    n = full.num_tokens
    assert n > 5

    cut = SampleTokenizer(tok, max_length=5)(rec)
    assert (cut.num_tokens, cut.source_len, cut.truncated) == (5, n, True)
    assert cut.input_ids.tolist() == full.input_ids[:5].tolist()
    assert cut.loss_mask.tolist() == [1] * 5

    exact = SampleTokenizer(tok, max_length=n)(rec)
    assert (exact.num_tokens, exact.truncated) == (n, False)

    skipped = SampleTokenizer(tok, max_length=5, overlong="skip")(rec)
    assert skipped == Reject("s", 1, 0, "t", f"{n} tokens > --max-length 5", kind="skipped")
    assert isinstance(SampleTokenizer(tok, max_length=n, overlong="skip")(rec), Sample)

    with pytest.raises(ValueError, match="overlong"):
        SampleTokenizer(tok, max_length=5, overlong="drop")


def test_chat_truncated_before_any_reply_is_skipped_not_kept_with_a_zero_mask(tok):
    rec = chat(
        ("user", "Please explain recursion in detail."), ("assistant", "Recursion is a function calling itself.")
    )
    whole = SampleTokenizer(tok, max_length=4096)(rec)
    skipped = SampleTokenizer(tok, max_length=6)(rec)
    assert skipped == Reject(
        rec.source,
        rec.line,
        rec.index,
        rec.id,
        f"{whole.source_len} tokens truncated to --max-length 6 leave no loss tokens",
        kind="skipped",
    )

    partial = SampleTokenizer(tok, max_length=whole.source_len - 1)(rec)
    assert partial.loss_mask[-1] == 1 and partial.input_ids[-1] != tok.convert_tokens_to_ids("<|end|>")

    # A record that never had a loss token is the user's to judge, truncated or not.
    given = Record("s", 1, 0, "z", "tokens", input_ids=tuple(range(10, 20)), loss_mask=(0,) * 10)
    assert isinstance(SampleTokenizer(tok, max_length=6)(given), Sample)


def test_fingerprint(load_tokenizer):
    tok = load_tokenizer()
    fp = SampleTokenizer(tok, max_length=8).fingerprint()
    assert set(fp) == {"tokenizer_sha256", "chat_template_sha256", "image_processor_sha256"}
    assert fp.pop("image_processor_sha256") is None  # a text-only model's
    assert all(len(v) == 64 and int(v, 16) >= 0 for v in fp.values())

    # transformers leaves truncation settings on the backend after a call; that must not matter.
    other = load_tokenizer()
    other("some text", truncation=True, max_length=3)
    assert SampleTokenizer(other, max_length=99).fingerprint() == {**fp, "image_processor_sha256": None}

    other.chat_template = other.chat_template.replace("\n", "\n\n")
    changed = SampleTokenizer(other, max_length=8).fingerprint()
    assert changed["tokenizer_sha256"] == fp["tokenizer_sha256"]
    assert changed["chat_template_sha256"] != fp["chat_template_sha256"]

    other.backend_tokenizer.add_tokens(["<|extra|>"])
    assert SampleTokenizer(other, max_length=8).fingerprint()["tokenizer_sha256"] != fp["tokenizer_sha256"]


def test_needs_a_fast_tokenizer():
    class Slow:
        is_fast = False

    with pytest.raises(TypeError, match="fast"):
        SampleTokenizer(Slow(), max_length=8)


def test_example_corpus_is_valid(tok):
    records = list(read_corpus([EXAMPLES]))
    assert [r for r in records if isinstance(r, Reject)] == []
    assert {r.format for r in records} == {"sharegpt", "openai", "text", "tokens"}
    assert 20 <= len(records) <= 30
    st = SampleTokenizer(tok, max_length=512)
    samples = [st(r) for r in records]
    assert all(isinstance(s, Sample) and not s.truncated for s in samples)
    chats = [(r, s) for r, s in zip(records, samples) if r.messages]
    assert any(sum(role == "assistant" for role, _ in r.messages) >= 2 for r, _ in chats)
    assert any(r.messages[0][0] == "system" for r, _ in chats)
    for r, s in chats:
        replies = "".join(c + "<|end|>" for role, c in r.messages if role == "assistant")
        assert tok.decode(s.input_ids[s.loss_mask.astype(bool)]) == replies


def test_trim_after_last_loss_token(tiny_model_dir):
    from transformers import AutoTokenizer

    from offline_extract.data.corpus import Record
    from offline_extract.data.tokenization import SampleTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = (("user", "Hello"), ("assistant", "Hi there."), ("user", "Bye now, thanks a lot"))
    rec = Record(source="c.jsonl", line=1, index=0, id="a", format="openai", messages=msgs)
    full = SampleTokenizer(tok, max_length=4096)(rec)
    trimmed = SampleTokenizer(tok, max_length=4096, trim_after_last_loss=True)(rec)
    last = int(np.flatnonzero(full.loss_mask)[-1])
    assert full.num_tokens > last + 1, "the closing user turn must add tokens after the last loss token"
    assert trimmed.input_ids.tolist() == full.input_ids[: last + 1].tolist()
    assert trimmed.loss_mask[-1] == 1 and trimmed.loss_mask.sum() == full.loss_mask.sum()
    no_loss = Record(source="c.jsonl", line=2, index=1, id="b", format="tokens", input_ids=(5, 6), loss_mask=(0, 0))
    reject = SampleTokenizer(tok, max_length=4096, trim_after_last_loss=True)(no_loss)
    assert reject.kind == "skipped" and "no loss tokens" in reject.reason


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_records_longer_than_the_tokenizers_own_maximum_raise_no_library_warning(load_tokenizer):
    tok = load_tokenizer()
    # HF's own handler holds whatever stderr it found at import; what its loggers emit is heard here.
    kept = _Kept()
    logging.getLogger("transformers").addHandler(kept)
    tok.model_max_length = 16  # HF warns once per tokenizer past this; max_length is what applies here
    st = SampleTokenizer(tok, max_length=1000)
    text = Record("s", 1, 0, "t", "text", text="alpha " * 40)
    reply = chat(("user", "hello " * 20), ("assistant", "world " * 20))
    try:
        assert st(text).num_tokens > 16 and st(reply).num_tokens > 16
        ours = list(kept.messages)
        tok("alpha " * 40)  # the check can fail: HF does warn when asked to
    finally:
        logging.getLogger("transformers").removeHandler(kept)
    assert ours == [] and "Token indices" in kept.messages[-1]


def test_tokenizer_files_change_with_any_file_but_the_weights(tmp_path, monkeypatch):
    for name, text in (("tokenizer.json", "{}"), ("tokenizer_config.json", "{}"), ("model.safetensors", "w")):
        (tmp_path / name).write_text(text)
    first = tokenizer_files(tmp_path)
    (tmp_path / "model.safetensors").write_text("other weights")
    assert tokenizer_files(tmp_path) == first
    assert tokenizer_files(tmp_path, trust_remote_code=True) != first
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    second = tokenizer_files(tmp_path)
    assert second != first
    (tmp_path / "tokenizer_config.json").write_text('{"x": 1}')
    third = tokenizer_files(tmp_path)
    assert third != second
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.0.1")  # another transformers
    assert tokenizer_files(tmp_path) != third


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_a_model_directory_without_tokenizer_files_is_named(tiny_model_dir, tmp_path, model_type):
    # Qwen: transformers built an empty tokenizer, so every chat record failed with "the tokenizer has no chat
    # template" and every text record "tokenizes to zero tokens"; Llama: it raised its own words, naming no
    # directory and advising to install sentencepiece.
    from offline_extract import extraction
    from offline_extract.options import ExtractOptions

    config = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    with pytest.raises(ValueError) as refused:
        extraction.sample_tokenizer(ExtractOptions(data=("c.jsonl",)), tmp_path)
    message = str(refused.value)
    assert str(tmp_path) in message.splitlines()[0]
    assert (
        f"put the model's tokenizer files (tokenizer.json, or tokenizer.model) beside {tmp_path / 'config.json'}"
        in message
    )
    assert (
        extraction.sample_tokenizer(ExtractOptions(data=("c.jsonl",)), tiny_model_dir).vocab_size
        == config["vocab_size"]
    )


class _Counted:
    """A tokenizer that records the length of every text it is given, otherwise the tokenizer itself."""

    def __init__(self, tok):
        self._tok, self.lengths = tok, []

    def __call__(self, text, **options):
        self.lengths.extend(map(len, text) if isinstance(text, list) else [len(text)])
        return self._tok(text, **options)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)


def _words(n_chars: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = ["the", "spider", "has", "eight", "legs,", "Paris", "is", "capital.", "émigré", "日本", "\n", "  "]
    return "".join(rng.choice(words, size=n_chars // 3) + " ")[:n_chars]


def test_an_overlong_text_is_cut_before_tokenizing_and_keeps_the_whole_texts_tokens(tok):
    # A 50 MB line was tokenized whole (9.6 GB, 245 s) for its first 4,096 tokens.
    st = SampleTokenizer(_Counted(tok), max_length=256)
    bound = (256 + tokenization.CUT_MARGIN_TOKENS) * st.chars_per_token
    assert st.chars_per_token == max(len(t) for t in tok.get_vocab())
    for seed in range(3):
        text = _words(40_000, seed)  # small enough to tokenize whole for the reference
        whole = tok(text, add_special_tokens=True)["input_ids"][:256]
        sample = st(Record(source="s.jsonl", line=1, index=0, id="t", format="text", text=text))
        assert sample.input_ids.tolist() == whole and sample.truncated and sample.source_len > 256
        assert max(st.tokenizer.lengths) <= bound < len(text)
    big = st(Record(source="s.jsonl", line=1, index=0, id="t", format="text", text=_words(5_000_000)))
    assert big.num_tokens == 256 and max(st.tokenizer.lengths) <= bound
    skipping = SampleTokenizer(tok, max_length=256, overlong="skip")
    skipped = skipping(Record(source="s.jsonl", line=1, index=0, id="t", format="text", text=_words(5_000_000)))
    assert skipped.kind == "skipped" and re.fullmatch(r"more than \d+ tokens > --max-length 256", skipped.reason)


def test_an_overlong_chat_is_cut_before_rendering_and_keeps_the_whole_chats_tokens_and_mask(tok):
    st = SampleTokenizer(_Counted(tok), max_length=256)
    bound = (256 + tokenization.CUT_MARGIN_TOKENS) * st.chars_per_token
    for long_turn in ("user", "assistant"):
        messages = [("user", "hi"), ("assistant", "hello"), (long_turn, _words(40_000)), ("assistant", "bye")]
        if long_turn == "user":
            messages.insert(3, ("assistant", "fine"))
        rec = chat(*messages)
        whole = SampleTokenizer(tok, max_length=10**6)(rec)  # no cut: every content is within its bound
        sample = st(rec)
        assert sample.input_ids.tolist() == whole.input_ids[:256].tolist()
        assert sample.loss_mask.tolist() == whole.loss_mask[:256].tolist()
        assert max(st.tokenizer.lengths) <= bound + 200  # the cut contents and the template's own text
    # Its loss past the cut: skipped, as a chat tokenized whole is.
    late = st(chat(("user", _words(5_000_000)), ("assistant", "too late")))
    assert late.kind == "skipped" and late.reason.startswith("more than ") and "leave no loss tokens" in late.reason
    assert max(st.tokenizer.lengths) <= bound + 200


def test_records_tokenized_together_are_tokenized_as_one_by_one(tok):
    """SampleTokenizer.many, which the run tokenizes with (one call of the fast tokenizer for many records,
    spread over the cores), gives each record exactly the sample or reject it gives alone."""
    records = list(read_corpus([EXAMPLES]))
    records += [
        Record(source="s.jsonl", line=1, index=90, id="t", format="text", text="word " * 300),  # truncated
        Record(source="s.jsonl", line=1, index=92, id="cut", format="text", text=_words(40_000)),  # cut first
        chat(("user", _words(40_000)), ("assistant", "late"), id="cut-chat"),  # cut first, then skipped
        chat(("user", "hi"), id="no-reply"),  # rejected: no assistant turn
        Record(source="s.jsonl", line=2, index=91, id="empty", format="tokens", input_ids=()),  # zero tokens
    ]
    st = SampleTokenizer(_Counted(tok), max_length=128)
    together, alone = st.many(records), [st.many([r])[0] for r in records]
    assert len(together) == len(records) and max(st.tokenizer.lengths) < 40_000
    assert sum(isinstance(s, Sample) for s in together) >= 21 and sum(isinstance(s, Reject) for s in together) == 3
    for a, b in zip(together, alone):
        assert type(a) is type(b)
        if isinstance(a, Reject):
            assert a == b
        else:
            assert (a.index, a.id, a.source_len, a.truncated) == (b.index, b.id, b.source_len, b.truncated)
            assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
            assert a.input_ids.dtype == np.int32 and a.loss_mask.dtype == np.uint8


def test_the_processors_tokens_are_the_chats_with_its_placeholders_widened_and_nothing_before_them():
    """`_widened` places the loss mask of an image chat: a token the processor writes before the chat's text is
    no image's, so the tokens are refused, as they are for one written after it."""
    placeholder, text = 7, np.array([1, 2, 7, 3])
    widened = tokenization._widened(np.array([1, 2, 5, 5, 3]), text, placeholder)
    assert widened.tolist() == [False, False, True, True, False]
    assert tokenization._widened(np.array([9, 1, 2, 5, 5, 3]), text, placeholder) is None
    assert tokenization._widened(np.array([1, 2, 5, 5, 3, 9]), text, placeholder) is None
