"""A sequence's images handed to SGLang 0.5.17 as its own server hands them to the ModelRunner.

The server's path for a request with images (multimodal/processors/qwen_vl.py or mllama4.py, and
base_processor.py, then managers/scheduler.py): the HF processor's outputs become one MultimodalDataItem per
run of image tokens, each at the run it fills (a Qwen image's pixel values, its grid beside them; a Llama 4
tile's); each item's pad value, derived from a hash of its pixels, replaces its image tokens in the request's
input ids (the model file's pad_input_ids), which is how the model's embedding step finds where each item's
embeddings go; and for Qwen the M-RoPE positions of the whole sequence are computed once, from the token ids
and the grids.
Here the same SGLang functions run on the outputs the model's HF processor already gave the tokenization
stage (`data.images.Images`), with no tokenizer manager and no HTTP in between.
"""

from __future__ import annotations

import weakref
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from offline_extract.data.images import Images
from offline_extract.engine.families import FAMILIES, ImageModel
from offline_extract.options import default_image_threads


# Vision-language architectures whose image inputs this engine builds, by SGLang class name.
IMAGE_MODELS = {f.sglang_class: f.images for f in FAMILIES if f.images}
# Vision-language models whose SGLang file takes images, but whose image inputs this engine does not build:
# their image records are refused with the reason; their text records run.
_IMAGES_UNSUPPORTED = {f.sglang_class: f.images_refused for f in FAMILIES if f.images_refused}


def image_model(architecture: str, model_path: str) -> ImageModel:
    """The architecture's ImageModel; NotImplementedError naming it where the engine cannot prefill images."""
    spec = IMAGE_MODELS.get(architecture)
    if spec is None:
        reason = _IMAGES_UNSUPPORTED.get(architecture, "it is a text-only model")
        raise NotImplementedError(f"{architecture} ({model_path}) cannot take image inputs: {reason}")
    return spec


def init_embedding_cache() -> None:
    """SGLang's image-embedding cache, which its scheduler makes (mem_cache/kv_cache_builder.py) and the
    model's embedding step reads, made empty and kept so: each image's embeddings are computed in the forward
    that uses them, and no device memory is held for images that may never come again."""
    from sglang.srt.managers.mm_utils import init_mm_embedding_cache

    init_mm_embedding_cache(0)


def _check_processor_outputs(outputs: dict, spec: ImageModel) -> None:
    """Raises ValueError unless the HF processor gave exactly the image inputs `spec`'s model file takes."""
    unknown = outputs.keys() - {spec.feature, *spec.beside, *spec.restating}
    missing = {spec.feature, *spec.beside} - outputs.keys()
    if unknown or missing:
        raise ValueError(
            f"the processor's outputs {sorted(outputs)} are not what {spec.source} takes for images: "
            + "; ".join(
                part
                for part in (
                    f"missing {sorted(missing)}" if missing else "",
                    f"not taken: {sorted(unknown)} (videos and other inputs are not supported)" if unknown else "",
                )
                if part
            )
        )


def _mrope_positions(hf_config, ids_t: torch.Tensor, grid: torch.Tensor):
    """(M-RoPE positions, their delta) of one sequence, from its tokens and its images' grids `grid` (SGLang's
    MRotaryEmbedding.get_rope_index)."""
    from sglang.srt.layers.rotary_embedding import MRotaryEmbedding

    return MRotaryEmbedding.get_rope_index(
        spatial_merge_size=hf_config.vision_config.spatial_merge_size,
        image_token_id=hf_config.image_token_id,
        video_token_id=hf_config.video_token_id,
        vision_start_token_id=hf_config.vision_start_token_id,
        model_type=hf_config.model_type,
        tokens_per_second=getattr(hf_config.vision_config, "tokens_per_second", None),
        input_ids=ids_t.unsqueeze(0),
        image_grid_thw=grid,
        video_grid_thw=None,
    )


@dataclass(frozen=True)
class HostInputs:
    """What SGLang derives on the host from a sequence's images, the same for each forward of it: each item's hash
    of its pixels (the source of its pad value: MultimodalDataItem.set_pad_value, sha256 over every pixel) and,
    for M-RoPE, the positions of the whole sequence. Computed ahead (`host_inputs`, the feed's thread), a forward's
    request only assembles SGLang's inputs around them."""

    hashes: tuple[int, ...]
    mrope: dict  # MultimodalProcessorOutput's M-RoPE fields (`_mrope`); empty for a model without M-RoPE


def host_inputs(hf_config, spec: ImageModel, ids: np.ndarray, images: Images) -> HostInputs | None:
    """`HostInputs` of one sequence; None where SGLang hashes the pixels on the device
    (SGLANG_MM_BUFFER_SIZE_MB), which only the forward's request can do."""
    from sglang.srt.environ import envs

    if envs.SGLANG_MM_BUFFER_SIZE_MB.get() > 0:
        return None
    return _host_inputs(hf_config, spec, images, *_items(hf_config, spec, ids, images))


def _host_inputs(hf_config, spec: ImageModel, images: Images, ids_t: torch.Tensor, items: list) -> HostInputs:
    for item in items:
        item.set_pad_value()
    if not spec.mrope:
        return HostInputs(tuple(item.hash for item in items), {})
    grid = torch.from_numpy(np.ascontiguousarray(images.processor_outputs["image_grid_thw"]))
    return HostInputs(tuple(item.hash for item in items), _mrope(hf_config, ids_t, grid))


class HostWork:
    """Sequences' `HostInputs` computed ahead (`prepare`, on the feed's thread), each kept by its Images for the
    forward's request (`request`) while the sample lives, weakly: a batch's images leave memory with it."""

    def __init__(self):
        self._ahead: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Images -> (its ids, HostInputs)

    def prepare(self, hf_config, spec: ImageModel, seqs, images) -> None:
        """The sequences' `HostInputs`, side by side on `default_image_threads` threads: sha256 releases the GIL
        over a buffer, and on the feed's one thread a batch's images took longer to hash (a 7B Qwen's photo is
        about 10 MB of pixels) than the image threads took to prepare them."""
        todo = [(ids, im) for ids, im in zip(seqs, images) if im is not None]
        if not todo:
            return
        with ThreadPoolExecutor(min(len(todo), default_image_threads()), thread_name_prefix="image-hashes") as pool:
            made = list(pool.map(lambda one: host_inputs(hf_config, spec, *one), todo))
        for (ids, im), ahead in zip(todo, made):
            self._ahead[im] = (ids, ahead)

    def request(self, model, hf_config, spec: ImageModel, ids: np.ndarray, images: Images):
        """`image_request`, on the `HostInputs` prepared for these very ids and images where there are some."""
        ahead_ids, ahead = self._ahead.get(images, (None, None))
        return image_request(model, hf_config, spec, ids, images, ahead if ahead_ids is ids else None)


def _items(hf_config, spec: ImageModel, ids: np.ndarray, images: Images) -> tuple[torch.Tensor, list]:
    """The sequence's ids as a tensor and its images as SGLang's items, one for each run of image tokens."""
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem
    from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor

    outputs = dict(images.processor_outputs)
    _check_processor_outputs(outputs, spec)
    ids_t = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    image_token = hf_config.image_token_id
    placed = (ids_t == image_token).numpy()
    if not np.array_equal(placed, np.asarray(images.token_mask, dtype=bool)):
        raise ValueError(
            f"the image token mask ({int(np.count_nonzero(images.token_mask))} tokens) is not where the sequence's "
            f"image token {image_token} is ({int(placed.sum())} tokens)"
        )
    item = MultimodalDataItem(
        modality=Modality.IMAGE,
        feature=torch.from_numpy(np.ascontiguousarray(outputs[spec.feature])),
        model_specific_data={k: torch.from_numpy(np.ascontiguousarray(outputs[k])) for k in spec.beside},
    )
    # The runs of image tokens, as the server finds them (base_processor.process_and_combine_mm_data).
    item.offsets = BaseMultimodalProcessor.get_mm_items_offset(input_ids=ids_t, mm_token_id=image_token)
    return ids_t, _split(item, spec)


def image_request(model, hf_config, spec: ImageModel, ids: np.ndarray, images: Images, ahead: HostInputs | None = None):
    """(input ids with each image's tokens replaced by its pad value, SGLang's MultimodalInputs) for one
    sequence: what the scheduler sets as a Req's origin_input_ids and hands to its extend_image_inputs.
    `ahead`: its `host_inputs`, computed before; else they are computed here."""
    from sglang.srt.managers.schedule_batch import MultimodalInputs, MultimodalProcessorOutput

    ids_t, items = _items(hf_config, spec, ids, images)
    if ahead is None:
        ahead = _host_inputs(hf_config, spec, images, ids_t, items)
    else:
        for item, hashed in zip(items, ahead.hashes, strict=True):
            item.set_hash(hashed)
    start, end = (getattr(hf_config, name) for name in spec.markers)
    mm = MultimodalInputs.from_processor_output(
        MultimodalProcessorOutput(
            mm_items=items,
            input_ids=ids_t.tolist(),
            im_token_id=hf_config.image_token_id,
            im_start_id=start,
            im_end_id=end,
            # A forward's own copy of the positions: a request may extend them (a retracted one's).
            **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in ahead.mrope.items()},
        )
    )
    # 0.5.23 takes the ids as array("q") only; 0.5.17 takes that as it takes a list.
    return array("q", model.pad_input_ids(array("q", ids_t.tolist()), mm)), mm


def _split(item, spec: ImageModel) -> list:
    """The bundle of a sequence's images split as the server splits it (mm_utils.get_new_expanded_mm_items), one
    item for each run of image tokens: an image's, by its grid (Qwen), or a tile's, one row each (Llama 4)."""
    from sglang.srt.managers.mm_utils import get_new_expanded_mm_items

    runs, rows = len(item.offsets), len(item.feature)
    if spec.mrope:
        grid = item.model_specific_data["image_grid_thw"]
        if len(grid) != runs:
            raise ValueError(f"{len(grid)} images' grids for {runs} runs of image tokens in the sequence")
        unsplit = (
            f"{rows} rows of {spec.feature} do not split into the {len(grid)} images' grids "
            f"({grid.prod(dim=-1).tolist()} patches)"
        )
    else:
        unsplit = f"{rows} rows (tiles) of {spec.feature} for {runs} runs of image tokens: a tile fills each run"
    items = get_new_expanded_mm_items([item])
    # SGLang keeps the bundle whole where its rows do not split among the runs; a lone run is never split.
    if len(items) != runs or (runs == 1 and not spec.mrope and rows != 1):
        raise ValueError(unsplit)
    return items


def _mrope(hf_config, ids_t: torch.Tensor, grid: torch.Tensor) -> dict:
    """MultimodalProcessorOutput's M-RoPE fields: the positions of the whole sequence, computed once."""
    positions, delta = _mrope_positions(hf_config, ids_t, grid)
    return dict(
        video_token_id=hf_config.video_token_id, mrope_positions=positions.squeeze(1), mrope_position_delta=delta
    )
