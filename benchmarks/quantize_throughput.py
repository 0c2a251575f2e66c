#!/usr/bin/env python
"""What each store's encoding costs the GPU per batch, beside the forward that made the batch: fp8 and nvfp4 (its
kernel, and the torch ops it replaced) against a plain copy of the states, on a small model's batch and the 8B's.

\b
    python benchmarks/quantize_throughput.py [--json out.json]

The states are `residual_like` bf16 [tokens, 4 layers x hidden]; each figure is the median of --repeats timed
calls, CUDA events around each, after two untimed ones.
"""

import statistics
import sys
from pathlib import Path

import click
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: this checkout's benchmarks and offline_extract

from benchmarks import command_line, emit, program  # noqa: E402

from offline_extract.store import codecs  # noqa: E402
from offline_extract.testing.states import residual_like  # noqa: E402

# (name, tokens a batch, hidden size): the bench's default batches for SmolLM2-135M and the 8B shape.
SHAPES = (("small", 65536, 576), ("8b", 16384, 4096))
LAYERS = 4


def _nvfp4_ops(x: torch.Tensor) -> None:
    rows, width = x.shape
    packed = torch.empty(rows, width // 2, dtype=torch.uint8, device=x.device)
    blocks = torch.empty(rows, width // codecs.NVFP4_BLOCK, dtype=codecs.FP8_DTYPE, device=x.device)
    scales = torch.empty(rows, LAYERS, dtype=torch.float32, device=x.device)
    codecs.nvfp4_quantize_ops(x, LAYERS, packed, blocks, scales)


ENCODINGS = {
    "copy": lambda x: x.clone(),
    "fp8": lambda x: codecs.fp8_quantize(x, LAYERS),
    "nvfp4": lambda x: codecs.nvfp4_quantize(x, LAYERS),
    "nvfp4_torch_ops": _nvfp4_ops,
}


def _ms(encode, x: torch.Tensor, repeats: int) -> float:
    for _ in range(2):  # compiles the kernel, warms the allocator
        encode(x)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        encode(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@program(__doc__)
@click.option("--repeats", default=20, show_default=True, help="Timed calls per encoding and shape.")
@click.option("--json", "json_path", default=None, help="Also write the result here.")
def main(repeats: int, json_path: str | None) -> None:
    if not torch.cuda.is_available():
        raise click.UsageError("this benchmark times the GPU's encodings: no CUDA device here")
    rows = {}
    for name, tokens, hidden in SHAPES:
        x = residual_like(tokens, LAYERS, hidden).cuda()
        ms = {enc: _ms(encode, x, repeats) for enc, encode in ENCODINGS.items()}
        gb_s = {enc: x.numel() * x.element_size() / (t * 1e-3) / 1e9 for enc, t in ms.items()}
        rows[name] = {"tokens": tokens, "hidden": hidden, "ms": ms, "bf16_read_gb_s": gb_s}
    device = torch.cuda.get_device_name()
    emit(
        {"command": command_line("python benchmarks/quantize_throughput.py"), "device": device, "shapes": rows},
        json_path,
    )


if __name__ == "__main__":
    main()
