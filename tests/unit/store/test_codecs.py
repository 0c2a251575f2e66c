import pytest
import torch

from offline_extract.store import codecs
from offline_extract.options import choices
from offline_extract.store.codecs import (
    CODECS,
    FP8_MAX,
    compress_frame,
    compressor,
    decompress_frame,
    decompressor,
    NVFP4_BLOCK,
    fp8_dequantize,
    fp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
)
from offline_extract.store.schema import Encoding
from offline_extract.testing.states import activation_like, residual_like


def test_fp8_scale_is_each_tokens_absmax_per_layer_over_448_rounded_up_to_bf16():
    x = residual_like(50, 3, 64)
    values, scales = fp8_quantize(x, layers=3)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (50, 3)
    absmax = x.float().reshape(50, 3, 64).abs().amax(-1)
    exact = absmax / 448
    # The smallest bf16 value at or above absmax / 448: never below it (no element past 448), and less
    # than one bf16 step (2^-7 relative) above it.
    assert torch.equal(scales.bfloat16().float(), scales)
    assert (scales >= exact).all() and (scales < exact * (1 + 2**-7)).all()
    assert (scales > exact).any()
    # Each token's largest element lands on e4m3's edge (446.3..448 rounds to 448).
    assert torch.equal(values.float().reshape(50, 3, 64).abs().amax(-1), torch.full((50, 3), FP8_MAX))


def test_fp8_decoded_in_bf16_arithmetic_equals_our_float32_decode():
    # speculators' FP8 reader multiplies in bf16; with bf16 scales the product rounds once, as ours does.
    x = residual_like(200, 4, 64)
    values, scales = fp8_quantize(x, layers=4)
    theirs = values.to(torch.bfloat16).reshape(200, 4, 64) * scales.to(torch.bfloat16).reshape(200, 4, 1)
    assert torch.equal(theirs.reshape(200, -1), fp8_dequantize(values, scales))


def test_fp8_decoded_states_keep_every_tokens_direction():
    x = residual_like(400, 4, 256)
    decoded = fp8_dequantize(*fp8_quantize(x, layers=4))
    assert decoded.dtype == torch.bfloat16 and decoded.shape == x.shape
    per_layer = lambda t: t.float().reshape(400, 4, 256)  # noqa: E731
    cosine = torch.nn.functional.cosine_similarity(per_layer(decoded), per_layer(x), dim=-1)
    assert cosine.min() >= 0.999
    # e4m3 keeps 3 mantissa bits: every element within half a step (1/16 relative) plus bf16 rounding,
    # or below the smallest subnormal step of its token's scale.
    err = (per_layer(decoded) - per_layer(x)).abs()
    _, scales = fp8_quantize(x, layers=4)
    floor = scales.reshape(400, 4, 1) * 2.0**-9
    assert (err <= per_layer(x).abs() * (1 / 16 + 1 / 128) + floor).all()


def test_fp8_zero_token_gets_a_positive_scale_and_nan_shows_in_its_scale():
    x = residual_like(4, 2, 8)
    x[1] = 0
    x[2, 3] = float("nan")  # layer 0 of token 2
    values, scales = fp8_quantize(x, layers=2)
    assert scales[1].tolist() == [1.0, 1.0]
    assert torch.equal(fp8_dequantize(values, scales)[1], torch.zeros(16, dtype=torch.bfloat16))
    assert scales[2, 0].isnan() and scales[2, 1].isfinite()
    assert torch.isfinite(scales[[0, 3]]).all()


def test_fp8_quantizes_in_row_chunks_exactly_as_in_one(monkeypatch):
    x = residual_like(37, 3, 16)
    whole = fp8_quantize(x, layers=3)
    monkeypatch.setattr(codecs, "_QUANTIZE_BYTES", 5 * 4 * x.shape[1])  # 5 rows' float32 quotients a chunk
    chunked = fp8_quantize(x, layers=3)
    assert torch.equal(whole[0].view(torch.uint8), chunked[0].view(torch.uint8))
    assert torch.equal(whole[1], chunked[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_leaves_the_states_it_quantizes_as_they_were(dtype):
    """The states are the batch's own (bin/extract.py's staging, a caller's tensor): float32 ones are not
    divided in place."""
    x = residual_like(9, 2, 16).to(dtype)
    before = x.clone()
    fp8_quantize(x, layers=2)
    assert torch.equal(x, before)


def test_fp8_refuses_a_width_that_does_not_split_into_layers():
    with pytest.raises(ValueError, match="width 10 do not split into 3 layers"):
        fp8_quantize(torch.zeros(2, 10), layers=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int32, torch.uint8])
@pytest.mark.parametrize("rows", [0, 1, 77])
def test_zstd_frame_round_trips_bit_exactly(dtype, rows):
    x = (torch.randn(rows, 24) * 50).to(dtype)
    frame = compress_frame(x, compressor())
    back = decompress_frame(frame, dtype, rows, decompressor())
    assert back.dtype == dtype
    # An empty frame has no bytes to tell its width by.
    assert torch.equal(back.view(torch.uint8), x.view(torch.uint8)) if rows else back.numel() == 0


def test_zstd_byte_planes_compress_bf16_states_better_than_their_bytes_as_they_lie():
    # Large enough for whole zstd blocks (128 KiB) of one plane: each block gets its own entropy table.
    x = residual_like(2048, 2, 256)
    planes = len(compress_frame(x, compressor()))
    as_they_lie = len(compressor().compress(x.view(torch.uint8).numpy()))
    assert planes < 0.95 * as_they_lie


def test_zstd_frame_of_the_wrong_size_is_refused():
    frame = compress_frame(torch.zeros(10, 4, dtype=torch.bfloat16), compressor())
    with pytest.raises(ValueError, match="frame of 80 bytes does not hold 3 rows of torch.bfloat16"):
        decompress_frame(frame, torch.bfloat16, 3, decompressor())


@pytest.mark.parametrize("name", [c for c in choices("compress") if c != "none"])
def test_each_compress_choice_is_a_codec_whose_frames_state_their_size(name):
    # The writer, the reader and inspect --verify use a codec only through CODECS: one missing there, or
    # whose header does not give the size, would fail only on a user's run.
    codec = CODECS[name]
    x = torch.randn(7, 24).to(torch.bfloat16)
    frame = codec.encoder()(x)
    assert torch.equal(codec.decoder()(frame, torch.bfloat16, 7), x)
    assert codec.content_size(frame[: codec.header_bytes]) == x.numel() * x.element_size()
    assert codec.content_size(b"\0" * codec.header_bytes) == -1
    assert Encoding("bf16", name).codec is codec and Encoding("bf16", "none").codec is None


E2M1_GRID = [m * sign for m in codecs.E2M1_MAGNITUDES for sign in (1, -1)]


def _nearest_e2m1(q: float) -> float:
    """e2m1's value nearest q, a tie to the one whose mantissa bit is 0, past +-6 saturated: by search."""
    q = max(-6.0, min(6.0, q))
    best = min(abs(q - g) for g in E2M1_GRID)
    ties = sorted({g for g in E2M1_GRID if abs(q - g) == best})
    return ties[0] if len(ties) == 1 else next(g for g in ties if codecs.E2M1_MAGNITUDES.index(abs(g)) % 2 == 0)


def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates():
    grid = sorted(set(E2M1_GRID))
    midpoints = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    near = [m + d for m in midpoints for d in (-1e-6, 1e-6)]
    q = torch.tensor([*grid, *midpoints, *near, 7.0, -100.0, 6.5, 1e30, -0.0, 0.1, 0.3], dtype=torch.float32)
    packed = codecs.pack_nibbles(codecs.e2m1_codes(q))
    assert packed.dtype == torch.uint8 and packed.shape == (len(q) // 2,)
    assert codecs.e2m1_values(packed).tolist() == [_nearest_e2m1(v) for v in q.tolist()]


def test_e2m1_codes_are_the_formats_bit_patterns_packed_first_in_the_low_nibble():
    # Sign, 2 exponent bits, 1 mantissa bit: 0.5 is 0b0001, -6 is 0b1111, 1.5 is 0b0011, -0 never comes out.
    codes = codecs.e2m1_codes(torch.tensor([0.5, -6.0, 1.5, -0.1]))
    assert codes.tolist() == [0b0001, 0b1111, 0b0011, 0]
    assert codecs.pack_nibbles(codes).tolist() == [0xF1, 0x03]


def _blocks(t: torch.Tensor, rows: int, layers: int) -> torch.Tensor:
    return t.float().reshape(rows, layers, -1, NVFP4_BLOCK)


@pytest.mark.parametrize("make", [residual_like, lambda r, k, h: activation_like(r, k, h).reshape(r, -1)])
def test_nvfp4_round_trip_stays_within_one_step_per_block_and_keeps_every_tokens_direction(make):
    """Per element, within one step of its block's e2m1 grid (the block scale times the token's: e2m1's gaps
    are at most 2 steps), or, where the block's largest element saturated at 6 steps, within that element's
    excess; a block scale in e4m3's normal range leaves at most 6.4 steps (round to nearest, 3 mantissa bits).
    Per token, the cosine to the bf16 state."""
    rows, layers, hidden = 300, 4, 256
    x = make(rows, layers, hidden)
    packed, blocks, scales = nvfp4_quantize(x, layers=layers)
    assert (packed.dtype, blocks.dtype, scales.dtype) == (torch.uint8, torch.float8_e4m3fn, torch.float32)
    assert (packed.shape, blocks.shape, scales.shape) == ((rows, 512), (rows, 64), (rows, 4))
    decoded = nvfp4_dequantize(packed, blocks, scales)
    assert decoded.dtype == torch.bfloat16 and decoded.shape == x.shape
    step = blocks.float().reshape(rows, layers, -1, 1) * scales.reshape(rows, layers, 1, 1)
    original, back = _blocks(x, rows, layers), _blocks(decoded, rows, layers)
    block_max = original.abs().amax(-1, keepdim=True)
    bound = torch.maximum(step, block_max - 6 * step) + back.abs() * 2**-8  # and bf16's rounding of the result
    assert ((original - back).abs() <= bound).all()
    normal = blocks.float().reshape(rows, layers, -1, 1) >= 2**-6
    assert (block_max[normal.expand_as(block_max)] <= 6.4 * step[normal.expand_as(step)]).all()
    assert normal.float().mean() > 0.9
    cosine = torch.nn.functional.cosine_similarity(
        original.reshape(rows, layers, -1), back.reshape(rows, layers, -1), dim=-1
    )
    assert cosine.min() >= 0.985, cosine.min()


def test_nvfp4_token_scale_puts_each_tokens_largest_block_at_e4m3s_top():
    x = residual_like(50, 3, 64)
    _, blocks, scales = nvfp4_quantize(x, layers=3)
    exact = x.float().reshape(50, 3, 64).abs().amax(-1) / (6 * 448)
    assert torch.equal(scales.bfloat16().float(), scales)
    assert (scales >= exact).all() and (scales < exact * (1 + 2**-7)).all()
    assert torch.equal(blocks.float().reshape(50, 3, -1).amax(-1), torch.full((50, 3), FP8_MAX))


def test_nvfp4_decodes_exactly_before_its_one_rounding():
    """e2m1 x e4m3 x a bf16 scale is a product of 2, 4 and 8 significant bits, exact in float32: a reader
    multiplying in any order, in float32 or wider, gets our values."""
    x = residual_like(64, 2, 128)
    packed, blocks, scales = nvfp4_quantize(x, layers=2)
    ours = nvfp4_dequantize(packed, blocks, scales, dtype=torch.float32)
    wide = codecs.e2m1_values(packed).double().reshape(64, 2, -1, NVFP4_BLOCK) * (
        blocks.double().reshape(64, 2, -1, 1) * scales.double().reshape(64, 2, 1, 1)
    )
    assert torch.equal(ours.double(), wide.reshape(64, -1))


def test_nvfp4_zero_token_and_far_small_block_decode_to_zeros_and_nan_shows_in_its_scale():
    x = residual_like(4, 2, 32)
    x[1] = 0
    x[3, :16] = 1e-3  # block 0 of layer 0, 2^-10 of the largest element below e4m3's smallest block scale
    x[3, 16:32] = 1e6
    x[2, 3] = float("nan")  # layer 0 of token 2
    packed, blocks, scales = nvfp4_quantize(x, layers=2)
    decoded = nvfp4_dequantize(packed, blocks, scales)
    assert scales[1].tolist() == [1.0, 1.0] and torch.equal(decoded[1], torch.zeros(64, dtype=torch.bfloat16))
    assert blocks[3, 0].float() == 0 and packed[3, :8].eq(0).all() and decoded[3, :16].eq(0).all()
    assert scales[2, 0].isnan() and scales[2, 1].isfinite() and torch.isfinite(scales[[0, 1, 3]]).all()


def test_nvfp4_quantizes_in_row_chunks_exactly_as_in_one(monkeypatch):
    x = residual_like(37, 3, 32)
    whole = nvfp4_quantize(x, layers=3)
    monkeypatch.setattr(codecs, "_QUANTIZE_BYTES", 5 * 4 * x.shape[1])
    chunked = nvfp4_quantize(x, layers=3)
    for a, b in zip(whole, chunked):  # bit for bit
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_nvfp4_leaves_its_states_as_they_were_and_refuses_layers_of_partial_blocks():
    x = residual_like(9, 2, 32).float()
    before = x.clone()
    nvfp4_quantize(x, layers=2)
    assert torch.equal(x, before)
    with pytest.raises(ValueError, match="width 48 do not split into 2 layers of whole 16-element blocks"):
        nvfp4_quantize(torch.zeros(2, 48), layers=2)
