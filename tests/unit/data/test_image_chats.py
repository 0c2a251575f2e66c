"""Chats with images, through a vision-language model's own HF processor (the tiny Qwen2.5-VL's, `qwen_vl_dir`)."""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from extract_runs import ROOT
from PIL import Image
from image_chats import PATCH, save_image
from transformers import AutoProcessor

from offline_extract.data.corpus import read_corpus
from offline_extract.data.tokenization import IMAGES_AHEAD_PER_THREAD, ChatTemplate, Sample, SampleTokenizer
from offline_extract.testing.models import VL_CHAT_TEMPLATE


@pytest.fixture(scope="module")
def processor(qwen_vl_dir):
    return AutoProcessor.from_pretrained(qwen_vl_dir)


def write_corpus(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def image_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


def test_an_image_chat_is_the_processors_tokens_with_the_loss_on_the_reply_alone(tmp_path, processor):
    save_image(tmp_path / "wide.png", 2 * PATCH, 3 * PATCH)  # 2 x 3 image tokens
    save_image(tmp_path / "small.png", PATCH, PATCH, seed=1)  # 1
    corpus = write_corpus(
        tmp_path / "c.jsonl",
        [
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [image_part("wide.png"), {"type": "text", "text": "and"}, image_part("small.png")],
                    },
                    {"role": "assistant", "content": "Two pictures."},
                ]
            }
        ],
    )
    (record,) = read_corpus([corpus])
    sample = SampleTokenizer(processor.tokenizer, max_length=256, processor=processor)(record)
    assert isinstance(sample, Sample)
    tok, pad = processor.tokenizer, processor.image_token_id
    pictures = [Image.open(tmp_path / name) for name in ("wide.png", "small.png")]
    full = tok.apply_chat_template(
        [
            [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
                {"role": "assistant", "content": "Two pictures."},
            ]
        ],
        chat_template=VL_CHAT_TEMPLATE,
        tokenize=False,
    )[0]
    expected = processor(text=[full], images=pictures, return_tensors="np", add_special_tokens=False)
    assert sample.input_ids.tolist() == expected["input_ids"][0].tolist()
    assert sample.images.token_mask.tolist() == (sample.input_ids == pad).tolist()
    assert int(sample.images.token_mask.sum()) == 6 + 1
    assert set(sample.images.processor_outputs) == {"pixel_values", "image_grid_thw"}
    assert sample.images.processor_outputs["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 2]]
    np.testing.assert_array_equal(sample.images.processor_outputs["pixel_values"], expected["pixel_values"])
    # The loss is the reply and its end-of-turn marker, as for a text chat; never an image token.
    assert tok.decode(sample.input_ids[sample.loss_mask.astype(bool)]) == "Two pictures.<|end|>"
    assert not (sample.loss_mask.astype(bool) & sample.images.token_mask).any()


def test_an_image_in_a_reply_is_left_out_of_the_loss_and_llava_markers_read_alike(tmp_path, processor):
    save_image(tmp_path / "a.png", PATCH, 2 * PATCH)
    corpus = write_corpus(
        tmp_path / "c.jsonl",
        [
            {
                "conversations": [{"from": "human", "value": "draw"}, {"from": "gpt", "value": "here:<image>done"}],
                "images": ["a.png"],
            },
            {
                "messages": [
                    {"role": "user", "content": "draw"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "text", "text": "here:"},
                            image_part("a.png"),
                            {"type": "text", "text": "done"},
                        ],
                    },
                ]
            },
        ],
    )
    llava, openai = SampleTokenizer(processor.tokenizer, max_length=256, processor=processor).many(
        list(read_corpus([corpus]))
    )
    assert llava.input_ids.tolist() == openai.input_ids.tolist()
    assert llava.loss_mask.tolist() == openai.loss_mask.tolist()
    assert llava.images.fingerprint == openai.images.fingerprint
    tok = processor.tokenizer
    in_loss = llava.loss_mask.astype(bool)
    assert tok.decode(llava.input_ids[in_loss]) == "here:<|vision_start|><|vision_end|>done<|end|>"
    assert llava.images.token_mask.sum() == 2 and not (in_loss & llava.images.token_mask).any()


def test_a_bad_image_rejects_its_record_alone_naming_it(tmp_path, processor):
    save_image(tmp_path / "good.png", PATCH, PATCH)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG but not")
    chat = [{"from": "human", "value": "<image>what?"}, {"from": "gpt", "value": "it"}]
    corpus = write_corpus(
        tmp_path / "c.jsonl",
        [
            {"conversations": chat, "images": ["gone.png"]},
            {"conversations": chat, "images": ["broken.png"]},
            {"conversations": chat, "images": ["good.png"]},
        ],
    )
    gone, broken, good = SampleTokenizer(processor.tokenizer, max_length=64, processor=processor).many(
        list(read_corpus([corpus]))
    )
    assert (gone.line, gone.kind, gone.reason) == (1, "rejected", f"images[0] ({tmp_path / 'gone.png'}) not found")
    assert (broken.line, broken.reason) == (
        2,
        f"images[0] ({tmp_path / 'broken.png'}) does not decode: not in an image format PIL reads",
    )
    assert isinstance(good, Sample) and good.images.token_mask.sum() == 1


def test_a_cut_keeps_whole_images_or_skips_the_sample(tmp_path, processor):
    save_image(tmp_path / "a.png", 2 * PATCH, 2 * PATCH)  # 4 image tokens
    chat = [{"from": "human", "value": "look <image>"}, {"from": "gpt", "value": "a long answer " * 8}]
    corpus = write_corpus(tmp_path / "c.jsonl", [{"conversations": chat, "images": ["a.png"]}])
    (record,) = read_corpus([corpus])
    whole = SampleTokenizer(processor.tokenizer, max_length=256, processor=processor)(record)
    last_image = int(np.flatnonzero(whole.images.token_mask)[-1])
    cut = SampleTokenizer(processor.tokenizer, max_length=last_image + 8, processor=processor)(record)
    assert cut.truncated and cut.num_tokens == last_image + 8
    assert cut.images.token_mask.tolist() == whole.images.token_mask[: last_image + 8].tolist()
    assert cut.input_ids.tolist() == whole.input_ids[: last_image + 8].tolist()
    through = SampleTokenizer(processor.tokenizer, max_length=last_image, processor=processor)(record)
    assert (through.kind, through.reason) == (
        "skipped",
        f"keeping its first {last_image} tokens (--max-length {last_image}) would cut its images, whose "
        f"tokens run to token {last_image + 1}: an image is extracted whole or not at all",
    )


def test_trimming_after_the_last_reply_never_drops_a_later_image(tmp_path, processor):
    save_image(tmp_path / "a.png", PATCH, PATCH)
    chat = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}, {"from": "human", "value": "<image>"}]
    corpus = write_corpus(tmp_path / "c.jsonl", [{"conversations": chat, "images": ["a.png"]}])
    (record,) = read_corpus([corpus])
    trimmed = SampleTokenizer(processor.tokenizer, max_length=64, processor=processor, trim_after_last_loss=True)(
        record
    )
    assert trimmed.kind == "skipped" and "(--trim-after-last-loss-token) would cut its images" in trimmed.reason


def test_text_chats_of_a_vision_model_render_with_its_processors_template(tmp_path, processor, qwen_vl_dir):
    corpus = write_corpus(
        tmp_path / "c.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}],
    )
    (record,) = read_corpus([corpus])
    tokenizer = SampleTokenizer(processor.tokenizer, max_length=64, processor=processor)
    sample = tokenizer(record)
    assert sample.images is None
    full = processor.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], tokenize=False
    )
    assert sample.input_ids.tolist() == processor.tokenizer(full, add_special_tokens=False)["input_ids"]
    fingerprint = tokenizer.fingerprint()
    assert fingerprint["image_processor_sha256"] is not None
    other = AutoProcessor.from_pretrained(qwen_vl_dir, max_pixels=PATCH * PATCH * 4)
    other_fingerprint = SampleTokenizer(processor.tokenizer, max_length=64, processor=other).fingerprint()
    assert other_fingerprint["image_processor_sha256"] != fingerprint["image_processor_sha256"]
    assert SampleTokenizer(processor.tokenizer, max_length=64).fingerprint()["image_processor_sha256"] is None


def test_an_image_the_processor_refuses_rejects_its_record(tmp_path, processor):
    # Qwen's resize refuses an aspect ratio past 200.
    save_image(tmp_path / "tiny.png", 1, 250)
    corpus = write_corpus(
        tmp_path / "c.jsonl",
        [
            {
                "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "dot"}],
                "images": ["tiny.png"],
            }
        ],
    )
    (reject,) = SampleTokenizer(processor.tokenizer, max_length=64, processor=processor).many(
        list(read_corpus([corpus]))
    )
    assert reject.reason.startswith("the model's processor refused its images: ") and "aspect ratio" in reject.reason


def test_a_llama4_image_chat_keeps_its_tiles_markers_out_of_the_loss_and_its_patches_as_the_image_tokens(
    tmp_path, tiny_model_dir
):
    """Llama 4's processor widens each image's placeholder into its tiles' patch tokens between markers and
    separators, the placeholder among them: the image tokens are the patches (the config's image_token_id), the
    loss is the reply alone, and the pixels are the processor's own, one 28-pixel tile per row."""
    from transformers import AutoConfig

    from offline_extract.testing.models import build_model

    model = build_model("llama4", tmp_path / "m", weights=False, tokenizer_dir=tiny_model_dir)
    processor, config = AutoProcessor.from_pretrained(model), AutoConfig.from_pretrained(model)
    save_image(tmp_path / "wide.png", PATCH, 2 * PATCH)  # 1 x 2 tiles and the global one: 3 tiles of 4 patches
    save_image(tmp_path / "small.png", PATCH, PATCH, seed=1)  # 1 tile
    corpus = write_corpus(
        tmp_path / "c.jsonl",
        [
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [image_part("wide.png"), image_part("small.png"), {"type": "text", "text": "and"}],
                    },
                    {"role": "assistant", "content": "Two pictures."},
                ]
            }
        ],
    )
    (record,) = read_corpus([corpus])
    tok = processor.tokenizer
    sample = SampleTokenizer(tok, max_length=256, processor=processor, image_token_id=config.image_token_id)(record)
    assert isinstance(sample, Sample)
    tokens = tok.convert_ids_to_tokens(sample.input_ids.tolist())
    image = "".join(tokens[tokens.index("<|image_start|>") : len(tokens) - tokens[::-1].index("<|image_end|>")])
    assert image == (
        "<|image_start|>"
        + "<|patch|>" * 4
        + "<|tile_x_separator|>"
        + "<|patch|>" * 4
        + "<|tile_y_separator|><|image|>"
        + "<|patch|>" * 4
        + "<|image_end|>"
        + "<|image_start|><|image|>"
        + "<|patch|>" * 4
        + "<|image_end|>"
    )
    assert sample.images.token_mask.tolist() == [t == "<|patch|>" for t in tokens]
    assert set(sample.images.processor_outputs) == {"pixel_values"}
    pixels = sample.images.processor_outputs["pixel_values"]
    assert pixels.shape == (4, 3, 28, 28) and pixels.dtype == np.float32
    pictures = [Image.open(tmp_path / name).convert("RGB") for name in ("wide.png", "small.png")]
    own = processor.image_processor(pictures, return_tensors="pt")["pixel_values"]
    assert np.array_equal(pixels, own.float().numpy())
    assert tok.decode(sample.input_ids[sample.loss_mask.astype(bool)]) == "Two pictures.<|end|>"
    assert tok.decode(sample.input_ids[:8]).startswith(tok.bos_token + "<|user|>\n<|image_start|>")


def _same(a, b) -> None:
    """Two outputs of `SampleTokenizer.many` for one record, byte for byte."""
    assert type(a) is type(b)
    if not isinstance(a, Sample):
        assert a.to_json() == b.to_json()
        return
    for field in ("index", "id", "source", "line", "source_len", "truncated"):
        assert getattr(a, field) == getattr(b, field)
    for field in ("input_ids", "loss_mask"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    assert (a.images is None) == (b.images is None)
    if a.images is not None:
        assert a.images.fingerprint == b.images.fingerprint
        assert a.images.token_mask.tobytes() == b.images.token_mask.tobytes()
        assert a.images.processor_outputs.keys() == b.images.processor_outputs.keys()
        for key, x in a.images.processor_outputs.items():
            y = b.images.processor_outputs[key]
            assert (x.dtype, x.shape) == (y.dtype, y.shape) and x.tobytes() == y.tobytes()


def test_image_chats_prepared_on_threads_are_the_serial_ones_in_order(tmp_path, processor, monkeypatch):
    """`image_threads` prepares a call's image chats side by side: the same samples, byte for byte, in corpus
    order, and a broken image in the middle rejects its record alone, named as one at a time names it."""
    for k in range(6):
        save_image(tmp_path / f"{k}.png", PATCH * (1 + k % 3), PATCH * (1 + k % 2), seed=k)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG but not")
    chat = [{"from": "human", "value": "<image>what?"}, {"from": "gpt", "value": "it"}]
    images = [["0.png"], ["1.png", "2.png"], ["broken.png"], None, ["3.png"], ["gone.png"], ["4.png", "5.png"]]
    corpus = write_corpus(
        tmp_path / "c.jsonl",
        [
            {"conversations": chat, "images": names}
            if names is None or len(names) == 1
            else {"conversations": [{"from": "human", "value": "<image> and <image>?"}, chat[1]], "images": names}
            for names in images
        ],
    )
    records = list(read_corpus([corpus]))
    serial = SampleTokenizer(processor.tokenizer, max_length=256, processor=processor, image_threads=1)
    threaded = SampleTokenizer(processor.tokenizer, max_length=256, processor=processor, image_threads=4)
    where = set()
    prepare = threaded._image_chat
    monkeypatch.setattr(threaded, "_image_chat", lambda r: (where.add(threading.current_thread().name), prepare(r))[1])
    one, many = serial.many(records), threaded.many(records)
    assert any(name.startswith("images") for name in where), "the image chats were prepared on the pool's threads"
    assert [type(s).__name__ for s in many] == ["Sample", "Sample", "Reject", "Sample", "Sample", "Reject", "Sample"]
    assert many[2].reason == f"images[0] ({tmp_path / 'broken.png'}) does not decode: not in an image format PIL reads"
    for a, b in zip(one, many, strict=True):
        _same(a, b)


def test_a_processor_failure_on_a_pool_thread_names_the_record(tmp_path, processor, monkeypatch):
    """An error of the processor's own (not a refusal of the images) stops the call, from the pool's thread as
    from the caller's, with the record whose images it was preparing named."""
    for k in range(3):
        save_image(tmp_path / f"{k}.png", PATCH, PATCH, seed=k)
    chat = [{"from": "human", "value": "<image>what?"}, {"from": "gpt", "value": "it"}]
    corpus = write_corpus(tmp_path / "c.jsonl", [{"conversations": chat, "images": [f"{k}.png"]} for k in range(3)])
    records = list(read_corpus([corpus]))
    threaded = SampleTokenizer(processor.tokenizer, max_length=256, processor=processor, image_threads=3)
    prepare = threaded._image_chat

    def failing(record):
        if record.line == 2:
            raise RuntimeError("the processor broke")
        return prepare(record)

    monkeypatch.setattr(threaded, "_image_chat", failing)
    with pytest.raises(RuntimeError, match="the processor broke") as raised:
        threaded.many(records)
    assert raised.value.__notes__ == [f"while preparing the images of {corpus}:2 (id 'c.jsonl:2')"]


# A call's image chats prepared on a thread of its own, as the feed's thread runs them, when the main thread
# fails: the images prepared when it fails, then when the process's exit has joined its threads (atexit).
_FAIL_WHILE_PREPARING = """
import atexit, sys, threading
from transformers import AutoProcessor
from offline_extract.data.corpus import read_corpus
from offline_extract.data.tokenization import SampleTokenizer

model, corpus, failure = sys.argv[1:]
processor = AutoProcessor.from_pretrained(model)
tokenizer = SampleTokenizer(processor.tokenizer, max_length=4096, processor=processor, image_threads=2)
records, prepare, prepared, one_done = list(read_corpus([corpus])), tokenizer._image_chat, [], threading.Event()
def counted(record):
    sample = prepare(record)
    prepared.append(record.line)
    one_done.set()
    return sample
tokenizer._image_chat = counted
threading.Thread(target=tokenizer.many, args=(records,), name="batches-ahead", daemon=True).start()
one_done.wait()
print(len(prepared), flush=True)
atexit.register(lambda: print(len(prepared), flush=True))
raise {"error": RuntimeError("the forwards failed"), "ctrl-c": KeyboardInterrupt()}[failure]
"""


@pytest.mark.parametrize(
    "failure, said", [("error", "RuntimeError: the forwards failed"), ("ctrl-c", "KeyboardInterrupt")]
)
def test_a_failure_beside_the_image_pool_ends_the_process_without_preparing_the_rest(
    tmp_path, qwen_vl_dir, failure, said
):
    """The pool is handed a few records per thread at a time: a process that fails or is stopped while a call
    prepares its image chats on another thread waits at exit for those alone, not for every image of the call."""
    for k in range(48):
        save_image(tmp_path / f"{k}.png", 4 * PATCH, 4 * PATCH, seed=k)
    chat = [{"from": "human", "value": "<image>what?"}, {"from": "gpt", "value": "it"}]
    corpus = write_corpus(tmp_path / "c.jsonl", [{"conversations": chat, "images": [f"{k}.png"]} for k in range(48)])
    proc = subprocess.run(
        [sys.executable, "-c", _FAIL_WHILE_PREPARING, str(qwen_vl_dir), str(corpus), failure],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode != 0 and f"\n{said}" in proc.stderr, proc.stderr[-2000:]
    when_failed, at_exit = map(int, proc.stdout.split())
    assert at_exit - when_failed <= IMAGES_AHEAD_PER_THREAD * 2 + 2 < 48 - when_failed, (when_failed, at_exit)


def test_image_threads_run_torch_on_one_thread_and_give_the_processors_own_pixels(
    tmp_path, tiny_model_dir, monkeypatch
):
    """The 7B shape's processor on photo-sized JPEG and PNG images (resized, so its bicubic resize runs): the
    pool's threads run torch on one thread each, not a team of the process's count each, and their tokens and
    pixels are bit for bit those of the processor called directly, on the caller's thread with torch's threads,
    as a server calls it. The count the process's other threads start with is left as it was."""
    import torch

    from benchmarks.image_chats import write_image_chats
    from offline_extract.testing.models import build_model

    model = build_model("qwen2_5_vl_7b", tmp_path / "m", weights=False, tokenizer_dir=tiny_model_dir)
    processor = AutoProcessor.from_pretrained(model)
    write_image_chats(tmp_path / "c.jsonl", 6, sizes="410x307,640x480,811x603")
    records = list(read_corpus([tmp_path / "c.jsonl"]))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        st = SampleTokenizer(processor.tokenizer, max_length=8192, processor=processor, image_threads=3)
        counts, prepare = set(), st._image_chat
        monkeypatch.setattr(st, "_image_chat", lambda r: (counts.add(torch.get_num_threads()), prepare(r))[1])
        samples = st.many(records)
        started = []
        thread = threading.Thread(target=lambda: started.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert counts == {1} and torch.get_num_threads() == 2 and started == [2]
        for record, sample in zip(records, samples, strict=True):
            pictures = [Image.open(ref.location).convert("RGB") for ref in record.images]
            full, _ = ChatTemplate(processor.tokenizer, processor).render(record.messages)
            expected = processor(text=[full], images=pictures, return_tensors="pt", add_special_tokens=False)
            assert sample.input_ids.tolist() == expected["input_ids"][0].tolist()
            for key in ("pixel_values", "image_grid_thw"):
                got, want = sample.images.processor_outputs[key], expected[key].numpy()
                assert (got.dtype, got.shape) == (want.dtype, want.shape) and got.tobytes() == want.tobytes()
    finally:
        torch.set_num_threads(before)
