"""`codecs.nvfp4_quantize` as one Triton kernel, for states on the GPU.

The torch ops of `codecs.nvfp4_quantize` pass over a batch's states about eight times: the block maxima, a
float32 quotient of every element, its bucket, its code, the packing. On a small model, whose forwards take a
few milliseconds, those passes cost extraction several percent. Here each program reads its (token, layer) row
twice, once for the row's largest magnitude and once to quantize it block by block, and writes only the
packed codes and the scales.

It computes what the torch ops compute, in the same order and the same float32 roundings (the divisions are
IEEE's, `div_rn`), so its bytes are theirs: tests/unit/store/test_nvfp4_kernel.py holds it to the torch ops
under Triton's interpreter on the CPU, and tests/gpu/test_gpu_codecs.py on the GPU.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

# Blocks of 16 elements a program quantizes at once: 1,024 elements, a few registers a thread.
_BLOCKS_AT_ONCE = 64


@triton.jit
def _round_up_to_bf16(x):
    rounded = ((x.to(tl.int32, bitcast=True) + 0xFFFF) & -0x10000).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < float("inf"), rounded, x)


@triton.jit
def _e4m3(v):
    """Non-negative float32 values up to 448 (or NaN) rounded to e4m3fn, to nearest even, as torch's cast does:
    (the value in float32, its byte). Rounded here rather than by Triton's cast, whose CPU interpreter carries a
    rounding into the exponent wrongly; the cast of the rounded value is then exact anywhere."""
    bits = v.to(tl.int32, bitcast=True)
    # Normal: 3 mantissa bits kept, the 20 below rounded to nearest even; a carry moves into the exponent.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    kept = normal.to(tl.int32, bitcast=True)
    normal_byte = (((kept >> 23) - 120) << 3) | ((kept >> 20) & 7)  # e4m3's exponent bias is float32's less 120
    # Subnormal, steps of 2**-9: adding 2**23 rounds to a whole number, to nearest even.
    steps = (v * 512.0 + 8388608.0) - 8388608.0
    small = v < 0.015625
    value = tl.where(small, steps * 0.001953125, normal)  # 2**-9, a product: exact, where PTX divides approximately
    byte = tl.where(small, steps.to(tl.int32), normal_byte)
    return value, tl.where(v != v, 0x7F, byte).to(tl.uint8)


@triton.jit
def _max_keeping_nan(a, b):
    # A NaN must reach the token's scale, as torch's maximum carries it there: damage stays visible.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _nvfp4_rows(
    states,
    packed,
    blocks,
    scales,
    width,
    layers,
    hidden,
    boundaries,
    BOUNDARIES: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS_AT_ONCE: tl.constexpr,
    TOP: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
    E2M1_TOP: tl.constexpr,
):
    row = tl.program_id(0)
    layer = tl.program_id(1)
    start = row.to(tl.int64) * width + layer * hidden
    nblocks = hidden // BLOCK
    at = tl.arange(0, BLOCKS_AT_ONCE)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]

    absmax = tl.zeros((BLOCKS_AT_ONCE,), dtype=tl.float32)
    for first in range(0, nblocks, BLOCKS_AT_ONCE):
        inside = (first + tl.arange(0, BLOCKS_AT_ONCE))[:, None] < nblocks
        x = tl.load(states + start + first * BLOCK + at, mask=inside, other=0.0).to(tl.float32)
        absmax = _max_keeping_nan(absmax, tl.reduce(tl.abs(x), 1, _max_keeping_nan))
    absmax_all = tl.reduce(absmax, 0, _max_keeping_nan)
    scale = tl.where(absmax_all == 0, 1.0, _round_up_to_bf16(tl.math.div_rn(absmax_all, TOP)))
    tl.store(scales + row * layers + layer, scale)

    for first in range(0, nblocks, BLOCKS_AT_ONCE):
        index = first + tl.arange(0, BLOCKS_AT_ONCE)
        inside = index < nblocks
        x = tl.load(states + start + first * BLOCK + at, mask=inside[:, None], other=0.0).to(tl.float32)
        block_max = tl.reduce(tl.abs(x), 1, _max_keeping_nan)
        quotient = tl.math.div_rn(block_max, scale * E2M1_TOP)
        block, block_byte = _e4m3(tl.minimum(quotient, BLOCK_TOP, propagate_nan=tl.PropagateNan.ALL))
        tl.store(blocks + (start // BLOCK) + index, block_byte, mask=inside)
        step = block * scale
        step = tl.where(step == 0, float("inf"), step)
        q = tl.math.div_rn(x, step[:, None])
        # The e2m1 magnitude's code is how many boundaries it passes; ties go to the even code, which the
        # boundaries' placement (`codecs._e2m1_tables`) already holds, alike for either sign.
        a = tl.abs(q)
        m = tl.zeros(a.shape, dtype=tl.int32)
        for k in tl.static_range(BOUNDARIES):
            m += (a > tl.load(boundaries + k)).to(tl.int32)
        m = tl.where(q != q, 7, m)  # a damaged token's NaN codes as torch.bucketize puts it: past the last boundary
        code = tl.where((q < 0) & (m > 0), m | 8, m).to(tl.uint8)
        low, high = tl.split(tl.reshape(code, (BLOCKS_AT_ONCE, BLOCK // 2, 2)))
        byte = low | (high << 4)
        half = tl.arange(0, BLOCKS_AT_ONCE)[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        tl.store(packed + start // 2 + first * (BLOCK // 2) + half, byte, mask=inside[:, None])


def nvfp4_quantize_rows(
    states: torch.Tensor,
    layers: int,
    packed: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    boundaries: torch.Tensor,
    block: int,
    top: float,
    e2m1_top: float,
) -> None:
    """Fills `packed`, `blocks` and `scales` (`codecs.nvfp4_quantize`'s outputs, allocated) from contiguous
    [T, layers*H] `states`; `boundaries` are the positive e2m1 bucket boundaries, ascending, on states' device."""
    rows, width = states.shape
    if rows == 0:
        return
    # Triton launches on the current device, whatever device the pointers are on.
    with torch.cuda.device(states.device) if states.is_cuda else contextlib.nullcontext():
        _nvfp4_rows[(rows, layers)](
            states,
            packed,
            blocks,
            scales,
            width,
            layers,
            width // layers,
            boundaries,
            **launch_constants(len(boundaries), block, top, e2m1_top),
        )


def launch_constants(boundaries: int, block: int, top: float, e2m1_top: float) -> dict:
    """The kernel's constexprs for `boundaries` positive e2m1 boundaries, blocks of `block` elements, e4m3's `top`
    and e2m1's `e2m1_top`."""
    return {
        "BOUNDARIES": boundaries,
        "BLOCK": block,
        "BLOCKS_AT_ONCE": _BLOCKS_AT_ONCE,
        "TOP": top * e2m1_top,
        "BLOCK_TOP": top,
        "E2M1_TOP": e2m1_top,
    }
