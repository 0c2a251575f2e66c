"""How hidden states are encoded for storage: fp8 with per-token scales, and the frame codecs of
`--compress` (`CODECS`: zstd).

fp8 (`--store fp8`): float8 e4m3 values with one float32 scale per token per stored layer, scale =
absmax / 448 (e4m3's largest finite value) rounded up to a bfloat16 value, so every token's largest
element lands at the format's edge and the 3 mantissa bits are spent on that token's own range. A
bfloat16 scale makes a decode in bfloat16 arithmetic (fp8 -> bf16 times the scale in bf16, what
speculators' FP8 reader does) round exactly as ours does (float32 product, one rounding to bf16): the
product of a 4-bit and an 8-bit significand is exact in float32. The functions are plain torch ops, so
the extraction runs them on the GPU before the copy to host and the reader runs them on the CPU.

zstd (`--compress zstd`): each sample's rows of a tensor become one zstd frame, its bytes grouped by
significance first (byte planes: the bf16 high bytes, sign and exponent, sit together and compress;
the low mantissa bytes barely do). A frame per sample keeps random access: a reader decompresses
exactly the sample it reads, and memory stays one sample's worth.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import zstandard

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
# The float32 quotient a chunk of rows makes at most (512 MiB: 4096 tokens of 4 layers of 8192 on the GPU,
# whose memory is the forward's activation room). A small model's 64k-token batch takes two chunks, so its
# quantizing is a few kernel launches, not dozens.
_QUANTIZE_BYTES = 512 << 20
ZSTD_LEVEL = 1
# What the states gain from zstd is entropy coding (a plane of sign and exponent bytes takes few values),
# hardly repeats: level 1's match finder costs most of the time and finds little. Matches of 7 bytes or
# more, looked up in a 256-entry hash table that stays in L1 cache, keep the few worth having, faster at
# the same ratio (docs/output.md, "Encodings"). The frames are ordinary zstd frames.
_ZSTD_MIN_MATCH, _ZSTD_HASH_LOG = 7, 8


def fp8_quantize(states: torch.Tensor, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, layers*H] states -> (e4m3 values [T, layers*H], float32 scales [T, layers]), on states' device.

    An all-zero token gets scale 1 (every scale stays positive); NaN or Inf make that token's scale
    non-finite, so the damage stays visible in the scales (`inspect --verify` reports it).
    """
    rows, width = states.shape
    if width % layers:
        raise ValueError(f"states of width {width} do not split into {layers} layers")
    values = torch.empty(rows, width, dtype=FP8_DTYPE, device=states.device)
    scales = torch.empty(rows, layers, dtype=torch.float32, device=states.device)
    step = max(1, _QUANTIZE_BYTES // (4 * max(width, 1)))
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        # The absmax of the bfloat16 values is one of them: taking it before widening them is exact.
        x = states[start:stop].reshape(stop - start, layers, -1)
        absmax = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1).float()
        # A tensor divisor, not the Python number: CUDA divides by a scalar as a product with its float32
        # reciprocal, one ulp off the true quotient at times, so GPU scales would differ from the CPU's.
        quotient = absmax / torch.full_like(absmax, FP8_MAX)
        scale = torch.where(absmax == 0, 1.0, _round_up_to_bf16(quotient))
        # Widened to float32 by the division itself, so no float32 copy of the states is made first.
        x = x / scale.unsqueeze(-1)
        # e4m3fn has no infinity and torch's cast does not saturate: a quotient rounded a hair past 448
        # would become NaN without the clamp.
        x.clamp_(-FP8_MAX, FP8_MAX)
        values[start:stop].view(stop - start, layers, -1).copy_(x)
        scales[start:stop] = scale
    return values, scales


def _round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Positive float32 values rounded up to the next bfloat16 value (its top 16 bits); NaN and Inf are
    left as they are, so a damaged token stays visible in its scale."""
    bits = x.view(torch.int32)
    rounded = ((bits + 0xFFFF) & -0x10000).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x)


def fp8_dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The inverse of fp8_quantize (up to e4m3 rounding): [T, layers*H] in `dtype`."""
    rows, width = values.shape
    layers = scales.shape[-1]
    x = values.reshape(rows, layers, width // layers).float() * scales.reshape(rows, layers, 1)
    return x.reshape(rows, width).to(dtype)


def compress_frame(tensor: torch.Tensor, compressor: zstandard.ZstdCompressor) -> bytes:
    """One zstd frame of a CPU tensor's bytes, byte plane by byte plane."""
    by_element = tensor.contiguous().view(torch.uint8).numpy().reshape(-1, tensor.element_size())
    planes = np.empty(by_element.shape[::-1], dtype=np.uint8)
    # One strided copy per plane: about twice as fast as a transposed copy of the whole array.
    for b in range(by_element.shape[1]):
        planes[b] = by_element[:, b]
    return compressor.compress(planes.data)


def decompress_frame(frame, dtype: torch.dtype, rows: int, decompressor: zstandard.ZstdDecompressor) -> torch.Tensor:
    """The [rows, width] tensor compress_frame was given, from its frame (bytes or a uint8 tensor); the
    width follows from the frame's size."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if isinstance(frame, torch.Tensor):
        frame = frame.numpy()
    size = zstandard.frame_content_size(frame)
    if size < 0 or size % max(rows * itemsize, 1) or (rows == 0 and size):
        raise ValueError(f"a zstd frame of {size} bytes does not hold {rows} rows of {dtype}")
    raw = decompressor.decompress(frame, max_output_size=size)
    count = size // itemsize
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(itemsize, count)
    by_element = np.empty((count, itemsize), dtype=np.uint8)
    for b in range(itemsize):
        by_element[:, b] = planes[b]
    return torch.from_numpy(by_element.reshape(-1)).view(dtype).reshape(rows, -1 if rows else 0)


def compressor() -> zstandard.ZstdCompressor:
    # Frames carry their content size, so a reader can check it before trusting the bytes, and a checksum
    # of the content, which decompression checks: a flipped byte fails the read instead of being served.
    params = zstandard.ZstdCompressionParameters.from_level(
        ZSTD_LEVEL,
        strategy=zstandard.STRATEGY_FAST,
        min_match=_ZSTD_MIN_MATCH,
        hash_log=_ZSTD_HASH_LOG,
        write_content_size=True,
        write_checksum=True,
    )
    return zstandard.ZstdCompressor(compression_params=params)


def decompressor() -> zstandard.ZstdDecompressor:
    return zstandard.ZstdDecompressor()


class FrameCodec:
    """A `--compress` codec: one sample's rows of a state tensor as one frame and back. A frame states its
    content size in its first `header_bytes`, so that `inspect --verify` checks every frame against its
    sample without decoding it, and carries a checksum of its content, which decoding checks."""

    header_bytes: int
    errors: tuple[type[Exception], ...]  # what decoding a damaged frame raises, besides ValueError

    def encoder(self) -> Callable[[torch.Tensor], bytes]:
        """A function of one thread at a time: a [rows, width] CPU tensor -> its frame."""
        raise NotImplementedError

    def decoder(self) -> Callable[..., torch.Tensor]:
        """A function of one thread at a time: (frame, dtype, rows) -> the [rows, width] tensor encoded."""
        raise NotImplementedError

    def content_size(self, header: bytes) -> int:
        """The bytes a frame holds, from its first `header_bytes`; -1 where the header is damaged."""
        raise NotImplementedError


class Zstd(FrameCodec):
    header_bytes = 18  # zstd's longest frame header (ZSTD_FRAMEHEADERSIZE_MAX)
    errors = (zstandard.ZstdError,)

    def encoder(self) -> Callable[[torch.Tensor], bytes]:
        cctx = compressor()
        return lambda rows: compress_frame(rows, cctx)

    def decoder(self) -> Callable[..., torch.Tensor]:
        dctx = decompressor()
        return lambda frame, dtype, rows: decompress_frame(frame, dtype, rows, dctx)

    def content_size(self, header: bytes) -> int:
        try:
            return zstandard.frame_content_size(header)
        except zstandard.ZstdError:
            return -1


# Each of --compress's choices but "none" (options.Compression), by name.
CODECS: dict[str, FrameCodec] = {"zstd": Zstd()}
