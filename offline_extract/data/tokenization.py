"""Turn corpus Records into token Samples with the loss mask the drafter trains on.

Chat records are rendered with the tokenizer's own chat template, so the tokens are exactly what the
target model sees at inference. The loss covers what the model generates there: each assistant
turn's content and its end-of-turn marker, never the headers the template inserts before it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Iterator, Sequence, cast

import jinja2
import numpy as np

from offline_extract.data.corpus import Record, Reject, Row, parse
from offline_extract.data.images import ImageError, Images, as_array, load_images
from offline_extract.formatting import plural
from offline_extract.options import Overlong, check_choice, default_image_threads


# Records handed to each of `_image_chats`' threads at a time: enough that a slow image (two images, a large
# one) seldom leaves a thread without work, few enough that an exit waits for little.
IMAGES_AHEAD_PER_THREAD = 4


# eq=False: the generated __eq__/__hash__ would compare numpy arrays, which raises.
@dataclass(frozen=True, eq=False)
class Sample:
    index: int
    id: str
    source: str
    line: int
    input_ids: np.ndarray
    loss_mask: np.ndarray
    source_len: int
    truncated: bool
    images: Images | None = None  # None: a text-only sample

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def longest_loss_run(mask: np.ndarray) -> int:
    """The most consecutive loss tokens in a mask."""
    edges = np.diff(np.concatenate(([0], (mask != 0).astype(np.int8), [0])))
    starts, stops = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return int((stops - starts).max()) if len(starts) else 0


class _Unusable(Exception):
    pass


def _assistant_mask(offsets, bounds: list[int]) -> np.ndarray:
    """1 for each token whose characters (`offsets`, the tokenizer's) lie inside an assistant span of
    `bounds` [start_0, end_0, start_1, end_1, ...]."""
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts = np.asarray(bounds[0::2], dtype=np.int64)
    ends = np.asarray(bounds[1::2], dtype=np.int64)
    # The span a token could belong to is the last one starting at or before the token does.
    span = np.searchsorted(starts, offsets[:, 0], side="right") - 1
    inside = (span >= 0) & (offsets[:, 1] <= ends[np.maximum(span, 0)])
    return inside.astype(np.uint8)


# Tokens past --max-length that a text cut before tokenizing must still give: the tokenization near the cut may
# differ from the whole text's, and these keep that difference past what is kept.
CUT_MARGIN_TOKENS = 64


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class _Fit:
    """What a sample keeps of its record's tokens, by `SampleTokenizer`'s options of these names: at most max_length
    (or nothing, overlong "skip"), none after the last loss token (trim_after_last_loss), and nothing where its
    longest run of loss tokens is shorter than min_loss_run."""

    max_length: int
    overlong: Overlong
    trim_after_last_loss: bool
    min_loss_run: int

    def sample(
        self, record: Record, ids: np.ndarray, mask: np.ndarray, cut: bool, images: Images | None = None
    ) -> Sample | Reject:
        """The sample of a record's tokens and loss mask (`cut`: of a text or chat cut before tokenizing) and its
        images: cut to max_length, trimmed, or left out. A cut through an image's tokens leaves the sample out:
        the engine takes an image whole."""
        source_len = len(ids)
        more = "more than " if cut else ""
        if source_len == 0:
            return record.reject("tokenizes to zero tokens")
        truncated = source_len > self.max_length
        if truncated:
            if self.overlong == "skip":
                return record.reject(f"{more}{source_len} tokens > --max-length {self.max_length}", "skipped")
            # Cut before tokenizing, a text (every token) or a chat (its assistant turns) had loss tokens past the cut.
            had_loss = cut or mask.any()
            ids, mask = ids[: self.max_length], mask[: self.max_length]
            if cuts := _cuts_images(record, images, len(ids), f"--max-length {self.max_length}"):
                return cuts
            if had_loss and not mask.any():
                return record.reject(
                    f"{more}{source_len} tokens truncated to --max-length {self.max_length} leave no loss tokens",
                    "skipped",
                )
        if self.trim_after_last_loss:
            # Tokens after the last loss token carry no training signal; states for them are wasted bytes.
            keep = int(np.flatnonzero(mask)[-1]) + 1 if mask.any() else 0
            if keep == 0:
                return record.reject("no loss tokens left to keep (--trim-after-last-loss-token)", "skipped")
            ids, mask = ids[:keep], mask[:keep]
            if cuts := _cuts_images(record, images, keep, "--trim-after-last-loss-token"):
                return cuts
        run = longest_loss_run(mask)
        if run < self.min_loss_run:
            return record.reject(
                f"its longest run of consecutive loss tokens is {run}, fewer than --min-loss-run {self.min_loss_run}",
                "skipped",
            )
        if images is not None and len(images.token_mask) > len(ids):
            images = replace(images, token_mask=images.token_mask[: len(ids)])
        return Sample(record.index, record.id, record.source, record.line, ids, mask, source_len, truncated, images)


class ChatTemplate:
    """The model's chat template, which renders a chat as the model sees it at inference, and finds where its
    assistant turns lie in the text: what the loss mask covers."""

    def __init__(self, tokenizer, processor=None):
        self._tokenizer, self._processor = tokenizer, processor

    @property
    def template(self) -> str | dict | None:
        """The processor's, where it has one, else the tokenizer's."""
        return getattr(self._processor, "chat_template", None) or self._tokenizer.chat_template

    def render(self, messages: tuple[tuple[str, str | tuple], ...]) -> tuple[str, list[int]]:
        """The whole conversation as the chat template renders it, and the character bounds
        [start_0, end_0, start_1, end_1, ...] of its assistant spans. A content of parts (a chat with images)
        is given to the template as HF's content parts, an image's as {"type": "image"}."""
        if self.template is None:
            raise ValueError("the tokenizer has no chat template, which chat records need")
        conversation = [{"role": role, "content": _hf_content(content)} for role, content in messages]
        turns = [i for i, (role, _) in enumerate(messages) if role == "assistant"]
        if not turns:
            raise _Unusable("no assistant turn")
        heads = self._render([conversation[:i] for i in turns], True)
        full, *tails = self._render([conversation] + [conversation[: i + 1] for i in turns], False)

        # Character positions [start_0, end_0, start_1, end_1, ...] of the assistant spans.
        bounds = []
        for i, head, tail in zip(turns, heads, tails):
            for prefix, what in ((head, f"messages[:{i}] with the generation prompt"), (tail, f"messages[:{i + 1}]")):
                if not full.startswith(prefix):
                    raise _Unusable(
                        f"chat template is not prefix-stable: {what} does not render as a prefix"
                        " of the whole conversation"
                    )
                bounds.append(len(prefix))
        if bounds != sorted(bounds):
            raise _Unusable("chat template is not prefix-stable: assistant spans come out of order")
        return full, bounds

    def _render(self, conversations: list[list[dict]], add_generation_prompt: bool) -> list[str]:
        # Always the batched form: transformers cannot render an empty conversation on its own, and
        # the header before an opening assistant turn is exactly that rendering.
        try:
            return self._tokenizer.apply_chat_template(
                conversations,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as e:
            raise _Unusable(f"chat template error: {e}") from None


class SampleTokenizer:
    """Callable mapping a Record to a Sample, or to a Reject when the record cannot be used.

    Data problems become Rejects; configuration problems (a slow tokenizer, chat records with a
    tokenizer that has no chat template) raise, because every record would fail the same way.

    Loss-mask rules:
    - A token is trained on only if its character span lies entirely inside an assistant span. A
      token straddling a boundary is left out: part of it was not generated by the assistant, and
      at inference the prompt is tokenized on its own so such a token never occurs. Templates that
      put special tokens at the boundaries never produce one.
    - A sample whose loss tokens all fall past max_length is skipped (listed and counted as
      skipped): truncated, it has nothing to train on, and its states would be bytes no one reads.
      A record that never had a loss token (an all-zero loss_mask given) is kept as given.

    What a record costs is bounded by max_length, not by its size: no token covers more characters than the
    vocabulary's longest token has (`chars_per_token`), so a text (or a chat's contents, in order) is cut
    before tokenizing to what max_length and CUT_MARGIN_TOKENS tokens can cover at most, and its tokens up
    to max_length are those of the whole text. Its source_len then counts the tokens of the part tokenized
    (more than max_length), not of the whole. A normalizer that folds many characters into few can make the
    cut give too few tokens; then the whole text is tokenized, as it would be without the cut.
    """

    def __init__(
        self,
        tokenizer,
        max_length: int,
        overlong: Overlong = "truncate",
        trim_after_last_loss: bool = False,
        min_loss_run: int = 0,
        model: str = "the model",
        processor=None,
        image_token_id: int | None = None,
        image_threads: int | None = None,
        images_refused: str | None = None,
    ):
        check_choice("overlong", overlong)
        if max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError("SampleTokenizer needs a fast (Rust) tokenizer: the loss mask uses its character offsets")
        self.tokenizer = tokenizer
        self._fit = _Fit(max_length, overlong, trim_after_last_loss, min_loss_run)
        self.model = model  # its name, for a refusal
        # A vision-language model's HF processor (AutoProcessor), which prepares its image records (None for a
        # text-only model); its chat template, where it has one, renders every chat, text and image chats alike.
        # `images_refused`: why a model with a processor takes no image even so (a checkpoint without its tower's
        # weights, extraction._without_its_tower), said after its name when its first image chat is refused.
        self.processor = processor
        self._template = ChatTemplate(tokenizer, processor)
        self.images_refused = TEXT_ONLY if processor is None else images_refused
        if processor is not None:
            self.placeholder_id, self.image_token_id = _image_token_ids(processor, tokenizer, model, image_token_id)
        self.image_threads = image_threads or default_image_threads()  # preparing a `many` call's image chats
        self.vocab_size = len(tokenizer)
        self.chars_per_token = max(map(len, tokenizer.get_vocab()), default=1)
        self._fingerprint: dict | None = None

    @property
    def max_length(self) -> int:
        return self._fit.max_length

    @property
    def chat_template(self) -> str | dict | None:
        """The template every chat is rendered with (`ChatTemplate.template`)."""
        return self._template.template

    @property
    def _cut_chars(self) -> int:
        """The most characters a text keeps before tokenizing (`SampleTokenizer`'s bound)."""
        return (self.max_length + CUT_MARGIN_TOKENS) * self.chars_per_token

    def _encode(self, text: str, **options) -> tuple[dict, bool]:
        """The tokenizer's encoding of `text`, cut first to `_cut_chars` (whether it was): HF's "longer than the
        model's maximum" warning is off (verbose=False), since max_length is applied after."""
        if len(text) > self._cut_chars:
            enc = self.tokenizer(text[: self._cut_chars], verbose=False, **options)
            if len(enc["input_ids"]) >= self.max_length + CUT_MARGIN_TOKENS:
                return enc, True
        return self.tokenizer(text, verbose=False, **options), False

    def __call__(self, record: Record) -> Sample | Reject:
        return self.many([record])[0]

    def many(self, records: Sequence[Record]) -> list[Sample | Reject]:
        """`self(record)` for each record, their texts tokenized in one call of the fast tokenizer per kind
        (text, chats), which spreads them over the machine's cores (the Rust tokenizer's own threads, outside
        the GIL); one at a time, a record's tokens came from one core. A text cut before tokenizing that gave
        too few tokens is tokenized again on its own (`_encode`), as is a chat whose cut contents did
        (`_chat`). Its image chats are prepared side by side (`_image_chats`)."""
        texts: list[tuple[int, str]] = []  # (position, text)
        chats: list[tuple[int, tuple, str, list[int]]] = []  # (position, contents cut, rendered, assistant bounds)
        done: list = [None] * len(records)  # a Reject, or (ids, mask, cut), or with images (ids, mask, cut, images)
        with_images = [r for r in records if r.images]
        if with_images and self.images_refused:
            refuse_images(with_images[0], self.model, self.images_refused)
        pictured = iter(_image_chats(self._image_chat, with_images, self.image_threads))
        for i, record in enumerate(records):
            try:
                if record.images:
                    done[i] = next(pictured)
                elif record.format in ("sharegpt", "openai"):
                    kept = _cut_contents(_text_chat(record), self._cut_chars)
                    chats.append((i, kept, *self._template.render(kept)))
                elif record.format == "text":
                    assert record.text is not None, "a text record has its text (corpus._record)"
                    texts.append((i, record.text))
                elif record.format == "tokens":
                    done[i] = (*_given_tokens(record, self.vocab_size), False)
                else:
                    raise ValueError(f"unknown record format {record.format!r}")
            except _Unusable as e:
                done[i] = record.reject(str(e))
        for (i, _), (enc, cut) in zip(texts, self._encode_many([t for _, t in texts], add_special_tokens=True)):
            ids = np.asarray(enc["input_ids"], dtype=np.int32)
            done[i] = (ids, np.ones(len(ids), dtype=np.uint8), cut)
        encoded = self._encode_many(
            [full for _, _, full, _ in chats], add_special_tokens=False, return_offsets_mapping=True
        )
        for (i, kept, _, bounds), (enc, cut) in zip(chats, encoded):
            ids = np.asarray(enc["input_ids"], dtype=np.int32)
            messages = _text_chat(records[i])
            if kept is messages or len(ids) >= self.max_length + CUT_MARGIN_TOKENS:
                done[i] = (ids, _assistant_mask(enc["offset_mapping"], bounds), cut or kept is not messages)
            else:  # cut, the contents gave too few tokens (`SampleTokenizer`)
                try:
                    done[i] = self._chat_tokens(messages)
                except _Unusable as e:
                    done[i] = records[i].reject(str(e))
        return [d if isinstance(d, Reject) else self._fit.sample(r, *d) for r, d in zip(records, done)]

    def _image_chat(self, record: Record) -> tuple[np.ndarray, np.ndarray, bool, Images]:
        """A chat with images, tokenized by the model's processor, which expands each image's placeholder into
        the image's tokens. The loss mask is the assistant spans' (`ChatTemplate.render`) on the chat's text, carried
        over to the expanded tokens, and never at an image token. Not cut before tokenizing: an image is
        extracted whole or not at all (`_Fit.sample`)."""
        try:
            pictures, fingerprint = load_images(record.images)
        except ImageError as e:
            raise _Unusable(str(e)) from None
        assert record.messages is not None, "a record with images is a chat (corpus._record)"
        full, bounds = self._template.render(record.messages)
        text = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        text_ids = np.asarray(text["input_ids"], dtype=np.int32)
        text_mask = _assistant_mask(text["offset_mapping"], bounds)
        try:
            # Tensors of the images' outputs alone: the processor checks its image tokens by counting them in
            # input_ids, element by element, which took half its time on a tensor and little on a list.
            out = self.processor(
                text=[full], images=pictures, images_kwargs={"return_tensors": "pt"}, add_special_tokens=False
            )
        except ValueError as e:
            raise _Unusable(f"the model's processor refused its images: {e}") from None
        ids = np.asarray(out["input_ids"][0], dtype=np.int32)
        token_mask = ids == self.image_token_id
        widened = _widened(ids, text_ids, self.placeholder_id)
        # The processor only widens the placeholders; anything else would leave the loss mask on other tokens.
        if widened is None or not token_mask.any() or (token_mask & ~widened).any():
            raise _Unusable(
                "the processor's tokens are not the chat template's with each image's placeholder "
                "expanded, so its loss mask cannot be placed"
            )
        mask = np.zeros(len(ids), dtype=np.uint8)
        mask[~widened] = text_mask[text_ids != self.placeholder_id]
        # Per-token outputs (mm_token_type_ids) restate the tokens; the rest are the images' inputs.
        inputs = {
            key: as_array(value)
            for key, value in out.items()
            if key not in ("input_ids", "attention_mask") and tuple(np.shape(value)) != (1, len(ids))
        }
        return ids, mask, False, Images(inputs, token_mask, fingerprint)

    def _encode_many(self, texts: list[str], **options) -> list[tuple[dict, bool]]:
        """`_encode` of each text, the first try of all of them in one call of the tokenizer."""
        if not texts:
            return []
        tried = [t[: self._cut_chars] for t in texts]
        enc = self.tokenizer(tried, verbose=False, **options)
        out = []
        for k, (text, cut) in enumerate(zip(texts, tried)):
            one = {key: values[k] for key, values in enc.items()}
            if len(cut) < len(text) and len(one["input_ids"]) < self.max_length + CUT_MARGIN_TOKENS:
                out.append(self._encode(text, **options))  # too few tokens from the cut: the whole text
            else:
                out.append((one, len(cut) < len(text)))
        return out

    def _chat_tokens(self, messages: TextChat) -> tuple[np.ndarray, np.ndarray, bool]:
        """One chat's tokens, loss mask and whether it was cut before tokenizing (`_encode`)."""
        full, bounds = self._template.render(messages)
        enc, cut = self._encode(full, add_special_tokens=False, return_offsets_mapping=True)
        return np.asarray(enc["input_ids"], dtype=np.int32), _assistant_mask(enc["offset_mapping"], bounds), cut

    def fingerprint(self) -> dict:
        """Hashes identifying the tokenization, for shard metadata: equal hashes mean equal tokens."""
        if self._fingerprint is None:
            state = json.loads(self.tokenizer.backend_tokenizer.to_str())
            # transformers switches truncation/padding on the backend per call, so they vary with
            # whatever was last tokenized; this class uses neither.
            state.pop("truncation", None)
            state.pop("padding", None)
            template = self.chat_template
            if template is not None and not isinstance(template, str):
                template = json.dumps(template, sort_keys=True)
            self._fingerprint = {
                "tokenizer_sha256": _sha256(json.dumps(state, sort_keys=True, ensure_ascii=False)),
                "chat_template_sha256": None if template is None else _sha256(template),
                # How images become pixels and how many tokens each takes (its resize bounds, patch size).
                "image_processor_sha256": None
                if self.processor is None
                else _sha256(self.processor.image_processor.to_json_string()),
            }
        return dict(self._fingerprint)


def from_rows(
    tokenizer: SampleTokenizer, rows: Sequence[Row], wanted: Sequence[bool]
) -> list[tuple[str | None, Sample | Reject | Exception | None]]:
    """(id, what is made of it) for each row of the corpus: its Sample or Reject where `wanted`, else nothing
    (`corpus.parse` reads its id alone), the records among them tokenized together (`SampleTokenizer.many`).
    Where the rows' reading runs is where their Python runs: a tokenizing process's (`tokenizer_processes`).

    A record that the tokenizer refuses whole (a configuration problem: a chat without a chat template, an
    image chat for a model that reads no images) gives the error it raised, in its place: the caller raises
    it there, unless the record's id turns out a duplicate (`corpus.in_order`), which is rejected without
    being tokenized anywhere else."""
    parsed = [parse(row, want) for row, want in zip(rows, wanted)]
    records = [made for _, made in parsed if isinstance(made, Record)]
    samples: Iterator[Sample | Reject | Exception]
    try:
        samples = iter(tokenizer.many(records))
    except Exception:
        samples = iter([_alone(tokenizer, record) for record in records])
    return [(id_, next(samples) if isinstance(made, Record) else made) for id_, made in parsed]


def _alone(tokenizer: SampleTokenizer, record: Record) -> Sample | Reject | Exception:
    try:
        return tokenizer.many([record])[0]
    except Exception as e:
        return e


def _image_token_ids(processor, tokenizer, model: str, image_token_id: int | None) -> tuple[int, int]:
    """(placeholder, image token) ids: the processor's image_token is the placeholder the chat template writes
    and the processor widens into each image's tokens; `image_token_id` is the token among those that the
    model's image embeddings replace (its config's image_token_id), by default the placeholder itself, as Qwen's
    processors repeat it."""
    image_token = getattr(processor, "image_token", None)
    if image_token is None:
        raise ValueError(f"the processor of {model} ({type(processor).__name__}) names no image token")
    placeholder_id = tokenizer.convert_tokens_to_ids(image_token)
    return placeholder_id, placeholder_id if image_token_id is None else image_token_id


def _image_chats(prepare, records: list[Record], threads: int) -> list[tuple | Reject]:
    """`prepare` (`SampleTokenizer._image_chat`) of each record, in order, or its Reject: on `threads` threads,
    as decoding and the processor's torch operations release the GIL in their heavy parts; one at a time, a
    batch of image chats waited on one core for every image's decoding and preparing.

    The threads are handed IMAGES_AHEAD_PER_THREAD records each at a time, not the whole call's at once. They
    are not daemons (the interpreter's teardown would cut them off in C code), so the process's exit waits for
    them: when a run fails or is stopped while the feed's thread is in this call, that wait is for those few
    records, not for every image of the call. An error here drops the records not yet begun."""
    if len(records) < 2 or threads < 2:
        return [_image_chat_or_reject(prepare, r) for r in records]
    one, ahead = partial(_image_chat_or_reject, prepare), IMAGES_AHEAD_PER_THREAD * threads
    pool = ThreadPoolExecutor(min(threads, len(records)), thread_name_prefix="images", initializer=_one_torch_thread)
    try:
        begun = deque(pool.submit(one, r) for r in records[:ahead])
        done = []
        for record in records[ahead:]:
            done.append(begun.popleft().result())
            begun.append(pool.submit(one, record))
        return done + [f.result() for f in begun]
    finally:
        pool.shutdown(cancel_futures=True)


# Held while an image thread takes torch to one thread: torch.set_num_threads also sets the count every thread
# takes at its first torch operation, which `_one_torch_thread` puts back.
_TORCH_THREADS = threading.Lock()


def _one_torch_thread() -> None:
    """An image thread's torch operations (the processor's resize, normalization and patching) on its own core:
    with torch's intra-op threads in each, `image_threads` threads would each start a team as large as the host
    (on 16 cores, 8 teams of 16 threads), which contend for the cores and spin between operations, and a call's
    image chats were prepared slower side by side than one at a time. Their values do not change: torch splits
    these operations by output element. The count the process's other threads start with is put back, from a
    thread of its own, since setting it also sets the setting thread's."""
    import torch

    with _TORCH_THREADS:
        process = torch.get_num_threads()  # this thread's first torch call: the process's count
        torch.set_num_threads(1)
        restore = threading.Thread(target=torch.set_num_threads, args=(process,), name="images-torch-threads")
        restore.start()
        restore.join()


def _image_chat_or_reject(prepare, record: Record) -> tuple | Reject:
    try:
        return prepare(record)
    except _Unusable as e:
        return record.reject(str(e))
    except Exception as e:  # the processor's own failure stops the run, raised from a pool thread or not
        if sys.version_info >= (3, 11):  # Python 3.10 has no notes: the error goes as it came
            e.add_note(f"while preparing the images of {_where(record)}")
        raise


TEXT_ONLY = (
    "is a text-only model (its config.json has no vision_config): nothing of it reads images. Give a "
    "vision-language model, or a corpus without images"
)


class ImagesRefused(ValueError):
    """A record with images, for a model that reads none: every such record would fail alike, so the run stops (as
    for chat records without a chat template), naming the record and the model."""


def refuse_images(record: Record, model: str, why: str) -> None:
    """Raises ImagesRefused for `record`, which holds images that `model` takes none of (`why`)."""
    raise ImagesRefused(f"{_where(record)} holds {plural(len(record.images), 'image')}, but {model} {why}")


def _where(record: Record) -> str:
    return f"{record.source}:{record.line} (id {record.id!r})"


def _given_tokens(record: Record, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A tokens record's input_ids and loss mask (all ones where it gives none)."""
    if record.input_ids and max(record.input_ids) >= vocab_size:
        i, v = next((i, v) for i, v in enumerate(record.input_ids) if v >= vocab_size)
        raise _Unusable(f"input_ids[{i}] = {v} >= vocab size {vocab_size}")
    ids = np.asarray(record.input_ids, dtype=np.int32)
    if record.loss_mask is None:
        return ids, np.ones(len(ids), dtype=np.uint8)
    return ids, np.asarray(record.loss_mask, dtype=np.uint8)


def _widened(ids: np.ndarray, text_ids: np.ndarray, placeholder: int) -> np.ndarray | None:
    """Which of the processor's tokens `ids` stand where the chat's tokens `text_ids` have image placeholders,
    True at each: `ids` must be `text_ids` with each run of placeholders replaced by a non-empty run of tokens
    (Qwen repeats the placeholder; Llama 4 writes each image's tiles between its markers, the placeholder among
    them), else None. The text before the first run starts `ids`; the text between runs is found at its first
    place after the run before it."""
    at = np.flatnonzero(np.diff(np.concatenate(([0], (text_ids == placeholder).astype(np.int8), [0]))))
    bounds = [0, *at.tolist(), len(text_ids)]
    texts = [text_ids[a:b] for a, b in zip(bounds[0::2], bounds[1::2])]
    widened = np.ones(len(ids), dtype=bool)
    start = 0
    for k, text in enumerate(texts):
        end: int | None
        if not k:
            end = 0
        elif k == len(texts) - 1:
            end = len(ids) - len(text)
        else:
            end = _find(ids, text, start + 1)
        if end is None or end < start + (k > 0) or not np.array_equal(ids[end : end + len(text)], text):
            return None
        widened[end : end + len(text)] = False
        start = end + len(text)
    return widened if start == len(ids) and len(texts) > 1 else None


def _find(ids: np.ndarray, text: np.ndarray, start: int) -> int | None:
    """The first position at or after `start` where `ids` holds `text`."""
    if not len(text):
        return start
    for p in start + np.flatnonzero(ids[start : len(ids) - len(text) + 1] == text[0]):
        if np.array_equal(ids[p : p + len(text)], text):
            return int(p)
    return None


def _hf_content(content: str | tuple[str | int, ...]) -> str | list[dict]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part} if isinstance(part, str) else {"type": "image"} for part in content]


def _cuts_images(record: Record, images: Images | None, kept: int, why: str) -> Reject | None:
    """The skip of a sample whose first `kept` tokens would end inside or before its images' tokens."""
    if images is None or not images.token_mask[kept:].any():
        return None
    last = int(np.flatnonzero(images.token_mask)[-1]) + 1
    return record.reject(
        f"keeping its first {kept} tokens ({why}) would cut its images, whose tokens run to token "
        f"{last}: an image is extracted whole or not at all",
        "skipped",
    )


# A chat without images: each turn's content is a text.
TextChat = tuple[tuple[str, str], ...]


def _text_chat(record: Record) -> TextChat:
    """A chat record's turns, where it has no images: each content is then a text (corpus._messages)."""
    assert record.messages is not None and not record.images, "a chat without images"
    return cast(TextChat, record.messages)


def _cut_contents(messages: TextChat, limit: int) -> TextChat:
    """`messages` with their contents cut where together they pass `limit` characters, those after emptied (their
    turns rendered still, past the cut); `messages` itself where they do not."""
    if sum(len(content) for _, content in messages) <= limit:
        return messages
    kept = []
    for role, content in messages:
        kept.append((role, content[:limit]))
        limit -= len(kept[-1][1])
    return tuple(kept)


# Weights never change how text is tokenized; any other file of a model directory might (tokenizer.json,
# tokenizer_config.json, chat_template.jinja, *.tiktoken, remote tokenizer code, ...).
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".onnx"}


def tokenizer_files(model_dir: str | os.PathLike, trust_remote_code: bool = False) -> str:
    """What a tokenizer would be loaded from, as cheaply as listing the model directory: every file but
    the weights, by name, size and modification time, and the transformers version that reads them.

    Two runs with the same value load the same tokenizer, so one can take the other's recorded
    `SampleTokenizer.fingerprint` without loading it (transformers takes seconds to import): a rerun that
    finds its output complete says so at once. Copying or touching the files only costs that shortcut.
    """
    import importlib.metadata

    root = Path(model_dir)
    entries = [
        (str(f.relative_to(root)), st.st_size, st.st_mtime_ns)
        for f in sorted(root.rglob("*"))
        if f.suffix not in _WEIGHT_SUFFIXES and f.is_file() and (st := f.stat())
    ]
    facts = {
        "files": entries,
        "transformers": importlib.metadata.version("transformers"),
        "trust_remote_code": trust_remote_code,
    }
    return _sha256(json.dumps(facts))
