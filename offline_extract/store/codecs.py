"""How hidden states are encoded for storage: fp8 with per-token scales, nvfp4 with block scales under
per-token ones, and the frame codecs of `--compress` (`CODECS`: zstd).

fp8 (`--store fp8`): float8 e4m3 values with one float32 scale per token per stored layer, scale =
absmax / 448 (e4m3's largest finite value) rounded up to a bfloat16 value, so every token's largest
element lands at the format's edge and the 3 mantissa bits are spent on that token's own range. A
bfloat16 scale makes a decode in bfloat16 arithmetic (fp8 -> bf16 times the scale in bf16, what
speculators' FP8 reader does) round exactly as ours does (float32 product, one rounding to bf16): the
product of a 4-bit and an 8-bit significand is exact in float32. The functions are plain torch ops, so
the extraction runs them on the GPU before the copy to host and the reader runs them on the CPU.

nvfp4 (`--store nvfp4`): NVIDIA's NVFP4 layout, e2m1 values (1 sign, 2 exponent, 1 mantissa bit) packed
two a byte with an e4m3 scale per block of 16 elements, under a second float32 scale per token per layer
where NVFP4 has one per tensor: a tensor's scale would tie each sample's bytes to the batch it ran in. The
token scale (absmax / (6 x 448), rounded up to bfloat16) puts the token's largest block at e4m3's top, so
its blocks' scales span e4m3's range below it; without it, activations whose outlier channels pass
6 x 448 saturate their blocks. On SmolLM2-135M (benchmarks/results/fp4-cpu-20261206) each token keeps a cosine of
0.993 or more to its bf16 state in every layer, where MXFP4 (an e8m0 scale per 32) keeps 0.974.
On a GPU its quantizing runs as one Triton kernel (`nvfp4_kernel`), whose bytes are the torch ops'.

zstd (`--compress zstd`): each sample's rows of a tensor become one zstd frame, its bytes grouped by
significance first (byte planes: the bf16 high bytes, sign and exponent, sit together and compress;
the low mantissa bytes barely do). A frame per sample keeps random access: a reader decompresses
exactly the sample it reads, and memory stays one sample's worth.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

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
    _check_layers(width, layers, 1)
    values = torch.empty(rows, width, dtype=FP8_DTYPE, device=states.device)
    scales = torch.empty(rows, layers, dtype=torch.float32, device=states.device)
    for start, stop in _row_chunks(rows, width):
        # The absmax of the bfloat16 values is one of them: taking it before widening them is exact.
        x = states[start:stop].reshape(stop - start, layers, -1)
        scale = _token_scales(torch.linalg.vector_norm(x, ord=float("inf"), dim=-1).float(), FP8_MAX)
        # Widened to float32 by the division itself, so no float32 copy of the states is made first.
        x = x / scale.unsqueeze(-1)
        # e4m3fn has no infinity and torch's cast does not saturate: a quotient rounded a hair past 448
        # would become NaN without the clamp.
        x.clamp_(-FP8_MAX, FP8_MAX)
        values[start:stop].view(stop - start, layers, -1).copy_(x)
        scales[start:stop] = scale
    return values, scales


def _check_layers(width: int, layers: int, block: int) -> None:
    if width % layers or (width // layers) % block:
        raise ValueError(
            f"states of width {width} do not split into {layers} layers"
            + (f" of whole {block}-element blocks" if block > 1 else "")
        )


def _row_chunks(rows: int, width: int) -> Iterator[tuple[int, int]]:
    """Bounds of consecutive row chunks whose float32 quotients stay within _QUANTIZE_BYTES."""
    step = max(1, _QUANTIZE_BYTES // (4 * max(width, 1)))
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def _token_scales(absmax: torch.Tensor, top: float) -> torch.Tensor:
    """Each token's scale from its float32 absmax per layer: absmax / top rounded up to a bfloat16 value, 1 for
    an all-zero token (every scale stays positive), non-finite for a token holding NaN or Inf."""
    # A tensor divisor, not the Python number: CUDA divides by a scalar as a product with its float32
    # reciprocal, one ulp off the true quotient at times, so GPU scales would differ from the CPU's.
    quotient = absmax / torch.full_like(absmax, top)
    return torch.where(absmax == 0, 1.0, _round_up_to_bf16(quotient))


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


def nvfp4_quantize(states: torch.Tensor, layers: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, layers*H] states -> (e2m1 codes packed two a byte [T, layers*H/2] uint8, e4m3 block scales
    [T, layers*H/16], float32 token scales [T, layers]), on states' device; H a multiple of 16.

    An element decodes as e2m1 value x block scale x token scale. The token scale (absmax / (6 * 448)
    rounded up to a bfloat16 value, as fp8's) puts each token's largest block at e4m3's top, so the block
    scales spend e4m3's range on that token's own spread; a block whose scale falls under e4m3's smallest
    step decodes to zeros. NaN or Inf make the token scale non-finite, as under fp8.
    """
    rows, width = states.shape
    _check_layers(width, layers, NVFP4_BLOCK)
    device = states.device
    packed = torch.empty(rows, width // 2, dtype=torch.uint8, device=device)
    blocks = torch.empty(rows, width // NVFP4_BLOCK, dtype=FP8_DTYPE, device=device)
    scales = torch.empty(rows, layers, dtype=torch.float32, device=device)
    if states.is_cuda:  # the same bytes in one kernel, where the ops' passes cost a small model's extraction
        from offline_extract.store.nvfp4_kernel import nvfp4_quantize_rows

        bounds = e2m1_positive_boundaries(device)
        blocks_bytes = blocks.view(torch.uint8)
        nvfp4_quantize_rows(
            states.contiguous(), layers, packed, blocks_bytes, scales, bounds, NVFP4_BLOCK, FP8_MAX, E2M1_MAX
        )
    else:
        nvfp4_quantize_ops(states, layers, packed, blocks, scales)
    return packed, blocks, scales


def nvfp4_quantize_ops(
    states: torch.Tensor, layers: int, packed: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor
) -> None:
    """`nvfp4_quantize` in torch ops, on any device, filling its allocated outputs."""
    rows, width = states.shape
    for start, stop in _row_chunks(rows, width):
        n = stop - start
        x = states[start:stop].reshape(n, layers, -1, NVFP4_BLOCK)
        block_max = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1).float()
        scale = _token_scales(block_max.amax(dim=-1), E2M1_MAX * FP8_MAX)
        # scale x 6 is exact (a bfloat16 value times 3, doubled), so the quotient rounds once, alike on every
        # device; the clamp keeps a quotient rounded a hair past 448 from becoming e4m3fn's NaN.
        block = (block_max / (scale * E2M1_MAX).unsqueeze(-1)).clamp_(max=FP8_MAX).to(FP8_DTYPE)
        # The step of each block's e2m1 grid: a product of 4 and 8 significant bits, exact in float32.
        step = block.float() * scale.unsqueeze(-1)
        # Divided by infinity, a block whose scale rounded to zero codes as zeros, as it decodes.
        step.masked_fill_(step == 0, float("inf"))
        packed[start:stop] = pack_nibbles(e2m1_codes(x / step.unsqueeze(-1))).view(n, -1)
        blocks[start:stop] = block.view(n, -1)
        scales[start:stop] = scale


def nvfp4_dequantize(
    packed: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The inverse of nvfp4_quantize (up to e2m1 rounding): [T, layers*H] in `dtype`. The float32 products are
    exact (2, 4 and 8 significant bits), so the one rounding is to `dtype`."""
    rows, layers = scales.shape
    step = blocks.float().reshape(rows, layers, -1, 1) * scales.reshape(rows, layers, 1, 1)
    x = e2m1_values(packed).reshape(rows, layers, -1, NVFP4_BLOCK) * step
    return x.reshape(rows, -1).to(dtype)


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """float32 values -> their nearest e2m1 codes (uint8 0..15), ties to the even code, saturating at +-6."""
    boundaries, codes = _e2m1_tables(q.device)
    return codes[torch.bucketize(q, boundaries, out_int32=True)]


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] of two e2m1 codes a byte (the first in the low nibble) -> float32 [..., 2n]."""
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return _e2m1_decode_table(packed.device)[nibbles.int()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., 2n] -> [..., n], element 2i in the low nibble of byte i (NVIDIA's and OCP's order)."""
    pairs = codes.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


# e2m1 (OCP's FP4): a sign bit, 2 exponent bits and 1 mantissa bit; code c & 7 stands for E2M1_MAGNITUDES[c & 7].
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = E2M1_MAGNITUDES[-1]
NVFP4_BLOCK = 16  # elements a block scale covers, NVFP4's


@functools.cache
def _e2m1_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The bucket boundaries between e2m1's 15 distinct values in ascending order, and each bucket's code.

    A value on a midpoint goes to the neighbour whose code is even (its mantissa bit 0), as round-to-nearest-
    even does: bucketize puts a value equal to a boundary in the lower bucket, so where the upper neighbour is
    the even one the boundary moves one float32 step down."""
    grid = sorted(
        {(-m if sign else m, (sign << 3 | c) if m else 0) for sign in (0, 1) for c, m in enumerate(E2M1_MAGNITUDES)}
    )
    boundaries = []
    for (low, _), (high, high_code) in zip(grid, grid[1:]):
        mid = torch.tensor((low + high) / 2, dtype=torch.float32)
        boundaries.append(torch.nextafter(mid, torch.tensor(-float("inf"))) if high_code % 2 == 0 else mid)
    return torch.stack(boundaries).to(device), torch.tensor([c for _, c in grid], dtype=torch.uint8, device=device)


@functools.cache
def e2m1_positive_boundaries(device: torch.device) -> torch.Tensor:
    """The boundaries above zero of `_e2m1_tables`, ascending: a magnitude's code is how many it passes."""
    boundaries, _ = _e2m1_tables(device)
    return boundaries[boundaries > 0].contiguous()


@functools.cache
def _e2m1_decode_table(device: torch.device) -> torch.Tensor:
    return torch.tensor([*E2M1_MAGNITUDES, *(-m for m in E2M1_MAGNITUDES)], dtype=torch.float32, device=device)


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
