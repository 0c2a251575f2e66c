#!/usr/bin/env python
"""What an image chat costs the thread that runs the forwards, without a GPU: SGLang's request inputs of each
sample (engine/multimodal.py `image_request`, the Qwen2.5-VL model file's pad_input_ids) made in one go, as
every forward made them before, and on `host_inputs` made ahead (each image's pixels hashed for its pad value,
the M-RoPE positions), as the feed's thread now makes them (`Engine.prepare_images`), in ms an image.

\b
    python benchmarks/image_chats.py /tmp/chats.jsonl --chats 64
    python benchmarks/image_requests.py --shape qwen2_5_vl_7b --data /tmp/chats.jsonl [--json OUT.json]
"""

import importlib
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: this checkout's benchmarks and offline_extract

from benchmarks import command_line, emit, program  # noqa: E402
from benchmarks.feed_rate import model_dir  # noqa: E402


def _ms_an_image(samples, request, images: int) -> float:
    start = time.perf_counter()
    for s in samples:
        request(s)
    return (time.perf_counter() - start) / images * 1e3


@program(help=__doc__)
@click.option("--shape", default="qwen2_5_vl_7b", show_default=True, help="A VISION_LANGUAGE_SHAPES key.")
@click.option("--data", required=True, help="A JSONL corpus of image chats (benchmarks/image_chats.py).")
@click.option("--records", default=24, show_default=True, help="Records taken from its start.")
@click.option("--json", "json_path", default=None, help="Also write the result here.")
def main(shape, data, records, json_path):
    import torch
    from transformers import AutoConfig

    from offline_extract.data.corpus import Record, read_corpus
    from offline_extract.engine.families import BY_NAME
    from offline_extract.engine.multimodal import host_inputs, image_request
    from offline_extract.engine.sglang_adapter import prepare_process
    from offline_extract.extraction import sample_tokenizer
    from offline_extract.options import ExtractOptions

    torch.set_num_threads(1)
    prepare_process("cpu")
    family = BY_NAME["qwen2_5_vl"]
    model_class = getattr(importlib.import_module(f"sglang.srt.models.{family.sglang_module}"), family.sglang_class)
    model = SimpleNamespace(pad_input_ids=lambda ids, mm: model_class.pad_input_ids(None, ids, mm))
    path = model_dir(None, shape)
    config, spec = AutoConfig.from_pretrained(path), family.images
    tokenizer = sample_tokenizer(ExtractOptions(data=(data,), model=str(path)), path)
    chats = [r for r in read_corpus([data]) if isinstance(r, Record) and r.images][:records]
    samples = [s for s in tokenizer.many(chats) if getattr(s, "images", None) is not None]
    images = sum(len(r.images) for r in chats)
    ahead = {id(s): host_inputs(config, spec, s.input_ids, s.images) for s in samples}
    result = {
        "command": command_line("python benchmarks/image_requests.py"),
        "images": images,
        "in_one_go_ms_an_image": _ms_an_image(
            samples, lambda s: image_request(model, config, spec, s.input_ids, s.images), images
        ),
        "on_host_inputs_ahead_ms_an_image": _ms_an_image(
            samples, lambda s: image_request(model, config, spec, s.input_ids, s.images, ahead[id(s)]), images
        ),
    }
    emit(result, json_path)


if __name__ == "__main__":
    main()
