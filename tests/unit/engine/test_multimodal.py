"""A sequence's images turned into SGLang's request inputs (engine/multimodal.py), on SGLang's own functions
and each image family's own pad_input_ids, without an engine; the whole path through the real engine against
HF is in test_architectures.py."""

import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from offline_extract.data.images import Images
from offline_extract.engine.families import BY_NAME, FAMILIES
from offline_extract.engine.multimodal import HostWork, host_inputs, image_model, image_request
from offline_extract.engine.sglang_adapter import prepare_process
from offline_extract.testing.models import QWEN_VISION_TOKENS, VISION_LANGUAGE

START, END, IMAGE, VIDEO = 384, 385, 386, 387


def _pads(item, tokens: int) -> list[int]:
    """The values SGLang pads an item's run of `tokens` image tokens with: 0.5.17 repeats its one pad_value,
    0.5.23 cycles through several (padding_sequence)."""
    if hasattr(item, "padding_sequence"):
        return list(item.padding_sequence(tokens))
    return [item.pad_value] * tokens


def _sglang_model(family):
    """What image_request reads of the loaded model: its pad_input_ids, SGLang's own."""
    prepare_process("cpu")
    cls = getattr(importlib.import_module(f"sglang.srt.models.{family.sglang_module}"), family.sglang_class)
    if family.images.mrope:
        return SimpleNamespace(pad_input_ids=lambda ids, mm: cls.pad_input_ids(None, ids, mm))
    from sglang.srt.managers.mm_utils import MultiModalityDataPaddingPatternMultimodalTokens

    # mllama4.py's pads through the pattern its __init__ makes.
    return SimpleNamespace(
        pad_input_ids=lambda ids, mm: cls.pad_input_ids(
            SimpleNamespace(padding_pattern=MultiModalityDataPaddingPatternMultimodalTokens()), ids, mm
        )
    )


@pytest.fixture(scope="module", params=[f for f in FAMILIES if f.images and f.images.mrope], ids=lambda f: f.name)
def vl(request):
    """The model's pad_input_ids and its config (the random checkpoint's), with the family's ImageModel and the
    width of its pixel rows, for the Qwen families, whose images are placed by their grids."""
    family = request.param
    model = _sglang_model(family)
    make_config, vision_tokens, _ = VISION_LANGUAGE[family.name]
    assert vision_tokens == QWEN_VISION_TOKENS
    config = make_config(388, dict(zip(QWEN_VISION_TOKENS, (START, END, IMAGE, VIDEO))))
    vision = SimpleNamespace(**config["vision_config"])
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    config = SimpleNamespace(**{k: v for k, v in config.items() if k != "vision_config"}, vision_config=vision)
    return SimpleNamespace(model=model, config=config, spec=family.images, width=width)


def _sequence(tokens_per_image):
    """Text, then each image's run of image tokens between the vision markers, then text."""
    ids = [0, 3, 204]
    for n in tokens_per_image:
        ids += [START] + [IMAGE] * n + [END, 60]
    return np.array(ids + [5], dtype=np.int64)


def _images(ids, grids, width, **outputs):
    grids = np.array(grids, dtype=np.int64)
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((int(grids.prod(axis=1).sum()), width)).astype(np.float32)
    return Images({"pixel_values": pixels, "image_grid_thw": grids, **outputs}, ids == IMAGE, "0" * 64)


def _same_request(a, b) -> None:
    (padded_a, mm_a), (padded_b, mm_b) = a, b
    assert padded_a == padded_b
    assert [(i.hash, i.pad_value, i.offsets) for i in mm_a.mm_items] == [
        (i.hash, i.pad_value, i.offsets) for i in mm_b.mm_items
    ]
    assert all(torch.equal(x.feature, y.feature) for x, y in zip(mm_a.mm_items, mm_b.mm_items, strict=True))
    assert torch.equal(mm_a.mrope_positions, mm_b.mrope_positions)
    assert torch.equal(torch.as_tensor(mm_a.mrope_position_delta), torch.as_tensor(mm_b.mrope_position_delta))


def test_a_request_on_host_inputs_made_ahead_is_the_request_made_in_one_go(vl, monkeypatch):
    """The pixels hashed and the positions computed ahead (the feed's thread), the forward's request is the
    one image_request makes alone, and hashes nothing; HostWork uses them for the very ids and images only."""
    model, config, spec, width = vl.model, vl.config, vl.spec, vl.width
    ids = _sequence([2, 4])
    images = _images(ids, [[1, 2, 4], [1, 4, 4]], width)
    whole = image_request(model, config, spec, ids, images)
    work = HostWork()
    work.prepare(config, spec, [ids, ids[:3]], [images, None])
    ahead = host_inputs(config, spec, ids, images)
    from sglang.srt.managers import mm_utils

    hashed = []
    monkeypatch.setattr(mm_utils, "hash_feature", lambda f: hashed.append(f) or 0)
    _same_request(work.request(model, config, spec, ids, images), whole)
    _same_request(image_request(model, config, spec, ids, images, ahead), whole)
    assert not hashed, "the forward's request hashed no pixels"
    again = ids.copy()
    assert work.request(model, config, spec, again, images)[0] != whole[0] and hashed, "other ids: hashed anew"


def test_a_batchs_images_are_hashed_side_by_side_each_for_its_own_sequence(vl, monkeypatch):
    """HostWork.prepare hashes a batch's sequences on threads of their own (sha256 releases the GIL), and each
    sequence's HostInputs are the ones made for it alone."""
    import threading

    from offline_extract.engine import multimodal

    config, spec, width = vl.config, vl.spec, vl.width
    seqs = [_sequence([2 + k]) for k in range(4)]
    images = [_images(ids, [[1, 2, 2 + k]], width) for k, ids in enumerate(seqs)]
    threads, made = set(), multimodal.host_inputs
    monkeypatch.setattr(
        multimodal, "host_inputs", lambda *a: (threads.add(threading.current_thread().name), made(*a))[1]
    )
    monkeypatch.setattr(multimodal, "default_image_threads", lambda: 3)
    work = HostWork()
    work.prepare(config, spec, seqs + [seqs[0][:3]], images + [None])
    assert threads and all(name.startswith("image-hashes") for name in threads)
    for ids, im in zip(seqs, images):
        ahead_ids, ahead = work._ahead[im]
        alone = made(config, spec, ids, im)
        assert ahead_ids is ids and ahead.hashes == alone.hashes
        assert torch.equal(ahead.mrope["mrope_positions"], alone.mrope["mrope_positions"])
    assert len({work._ahead[im][1].hashes for im in images}) == len(images)


def test_each_images_tokens_get_its_own_pad_value_and_the_positions_follow_its_grid(vl):
    model, config, spec, width = vl.model, vl.config, vl.spec, vl.width
    ids = _sequence([2, 4])  # grids 1x2x4 and 1x4x4 patches, merged 2x2: 2 and 4 tokens
    padded, mm = image_request(model, config, spec, ids, _images(ids, [[1, 2, 4], [1, 4, 4]], width))
    padded = np.array(padded)
    assert len(mm.mm_items) == 2
    first, second = _pads(mm.mm_items[0], 2), _pads(mm.mm_items[1], 4)
    assert not set(first) & set(second) and min(first + second) > max(ids)  # no pad value is a vocabulary token
    image = ids == IMAGE
    assert np.array_equal(padded[~image], ids[~image])
    assert padded[image].tolist() == first + second
    # Each item holds its own image's pixel rows: 8 and 16 patches.
    assert [tuple(item.feature.shape) for item in mm.mm_items] == [(8, width), (16, width)]
    # M-RoPE: (time, height, width) positions; an image's tokens share its start position in time and
    # spread over its merged grid's rows and columns, and the text after it continues past its largest.
    positions = mm.mrope_positions
    assert positions.shape == (3, len(ids))
    first_run = np.flatnonzero(image)[:2]
    assert positions[:, first_run].tolist() == [[4, 4], [4, 4], [4, 5]]
    assert torch.equal(positions[:, :4], torch.arange(4).repeat(3, 1))


def test_processor_outputs_it_does_not_take_are_refused_by_name(vl):
    model, config, spec, width = vl.model, vl.config, vl.spec, vl.width
    ids = _sequence([2])
    videos = _images(ids, [[1, 2, 4]], width, pixel_values_videos=np.zeros((8, width), np.float32))
    with pytest.raises(ValueError, match=r"not taken: \['pixel_values_videos'\] \(videos"):
        image_request(model, config, spec, ids, videos)
    no_grid = Images({"pixel_values": np.zeros((8, width), np.float32)}, ids == IMAGE, "0" * 64)
    with pytest.raises(ValueError, match=r"missing \['image_grid_thw'\]"):
        image_request(model, config, spec, ids, no_grid)
    # The processor's mm_token_type_ids restates the image tokens and is accepted.
    image_request(
        model, config, spec, ids, _images(ids, [[1, 2, 4]], width, mm_token_type_ids=(ids == IMAGE)[None].astype(int))
    )


def test_images_that_do_not_fit_the_sequence_are_refused(vl):
    model, config, spec, width = vl.model, vl.config, vl.spec, vl.width
    ids = _sequence([2, 4])
    images = _images(ids, [[1, 2, 4], [1, 4, 4]], width)
    shifted = Images(images.processor_outputs, np.roll(images.token_mask, 1), images.fingerprint)
    with pytest.raises(ValueError, match="image token mask .* is not where the sequence's image token 386 is"):
        image_request(model, config, spec, ids, shifted)
    with pytest.raises(ValueError, match="1 images' grids for 2 runs of image tokens"):
        image_request(model, config, spec, ids, _images(ids, [[1, 2, 4]], width))
    short = dict(images.processor_outputs, pixel_values=images.processor_outputs["pixel_values"][:-1])
    with pytest.raises(ValueError, match=r"23 rows of pixel_values do not split into the 2 images' grids \(\[8, 16\]"):
        image_request(model, config, spec, ids, Images(short, images.token_mask, images.fingerprint))


@pytest.mark.parametrize(
    "architecture, reason",
    [
        ("LlamaForCausalLM", "it is a text-only model"),
        ("KimiK25ForConditionalGeneration", "no class for its MoonViT tower"),
    ],
)
def test_an_architecture_without_image_inputs_is_refused_by_name(architecture, reason):
    with pytest.raises(NotImplementedError, match=rf"{architecture} \(/m\) cannot take image inputs: .*{reason}"):
        image_model(architecture, "/m")


@pytest.fixture(scope="module")
def llama4_chat(tiny_model_dir, tmp_path_factory):
    """A Llama 4 image chat as the tokenization stage makes it from a record, through the tiny Llama 4's own
    processor (a 28 x 56 image: 2 tiles and the global one; a 28 x 28 one: 1 tile; 4 patch tokens each), and the
    config SGLang reads."""
    from image_chats import PATCH, save_image
    from transformers import AutoConfig, AutoProcessor

    from offline_extract.data.corpus import read_corpus
    from offline_extract.data.images import fingerprint
    from offline_extract.data.tokenization import SampleTokenizer
    from offline_extract.testing.models import build_model

    root = tmp_path_factory.mktemp("llama4-chat")
    model = build_model("llama4", root / "m", weights=False, tokenizer_dir=tiny_model_dir)
    processor, config = AutoProcessor.from_pretrained(model), AutoConfig.from_pretrained(model)
    save_image(root / "wide.png", PATCH, 2 * PATCH)
    save_image(root / "small.png", PATCH, PATCH, seed=1)
    (root / "c.jsonl").write_text(
        json.dumps(
            {
                "conversations": [{"from": "human", "value": "<image>look<image>"}, {"from": "gpt", "value": "two"}],
                "images": ["wide.png", "small.png"],
            }
        )
        + "\n"
    )
    (record,) = read_corpus([root / "c.jsonl"])
    sample = SampleTokenizer(
        processor.tokenizer, max_length=256, processor=processor, image_token_id=config.image_token_id
    )(record)
    assert sample.images.fingerprint == fingerprint(record.images)
    return SimpleNamespace(
        sample=sample, config=config, tokens=processor.tokenizer.convert_ids_to_tokens(sample.input_ids.tolist())
    )


def test_each_llama4_tiles_patches_get_its_own_pad_value_at_the_text_positions(llama4_chat):
    family = BY_NAME["llama4"]
    sample, config = llama4_chat.sample, llama4_chat.config
    ids, images = sample.input_ids, sample.images
    padded, mm = image_request(_sglang_model(family), config, family.images, ids, images)
    padded = np.array(padded)
    # One item per tile, as SGLang's server splits the bundle: each fills one run of 4 patch tokens.
    assert [tuple(item.feature.shape) for item in mm.mm_items] == [(1, 3, 28, 28)] * 4
    assert all(
        torch.equal(item.feature[0], torch.from_numpy(images.processor_outputs["pixel_values"][k]))
        for k, item in enumerate(mm.mm_items)
    )
    pads = [_pads(item, 4) for item in mm.mm_items]
    assert len({p for tile in pads for p in tile}) == len({p for p in pads[0]}) * 4 and min(min(pads)) > max(ids)
    assert padded[images.token_mask].tolist() == [p for tile in pads for p in tile]
    assert np.array_equal(padded[~images.token_mask], ids[~images.token_mask])
    # The markers and separators stay tokens (above); the positions are the text's (no M-RoPE).
    assert (mm.im_token_id, mm.im_start_id, mm.im_end_id) == (
        config.image_token_id,
        config.boi_token_index,
        config.eoi_token_index,
    )
    assert mm.mrope_positions is None
    # The loss is the reply's alone: never a patch, a marker or a separator.
    assert not any(
        llama4_chat.tokens[i].startswith("<|image") or llama4_chat.tokens[i].startswith("<|tile")
        for i in np.flatnonzero(sample.loss_mask)
    )


def test_llama4_tiles_that_do_not_fill_the_runs_are_refused(llama4_chat):
    family = BY_NAME["llama4"]
    sample, config = llama4_chat.sample, llama4_chat.config
    images = sample.images
    short = dict(images.processor_outputs, pixel_values=images.processor_outputs["pixel_values"][:-1])
    with pytest.raises(ValueError, match=r"3 rows \(tiles\) of pixel_values for 4 runs of image tokens"):
        image_request(
            _sglang_model(family),
            config,
            family.images,
            sample.input_ids,
            Images(short, images.token_mask, images.fingerprint),
        )


def test_sglangs_llama4_tower_as_the_engine_loads_it_gives_hfs_image_embeddings(tiny_model_dir, tmp_path):
    """Through the engine's load (the tower built only with enable_multimodal and the index's vision weights) and
    the items image_request builds, mllama4.py's tower and projector give HF's embeddings for every tile, on CPU,
    where the decoder cannot run (tests/llama4_tower.py)."""
    from arch_parity import run_report

    from offline_extract.testing.models import build_model

    model = build_model("llama4", tmp_path / "m", tokenizer_dir=tiny_model_dir)
    script = str(Path(__file__).resolve().parents[2] / "llama4_tower.py")
    rep = run_report(model, tmp_path / "report.json", script=script)
    assert rep["has_vision"]
    # 28 x 56: 2 tiles and the global one; 56 x 56 and 28 x 28: 4 tiles and the global one, and 1 (4 tokens each).
    assert [(c["items"], c["image_tokens"]) for c in rep["chats"]] == [(3, 12), (6, 24)]
    for chat in rep["chats"]:
        assert chat["shapes"][0] == chat["shapes"][1] == [chat["image_tokens"], 256]
        assert chat["max_abs"] <= 1e-5 * chat["scale"], chat
