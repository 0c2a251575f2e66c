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
    fp8_dequantize,
    fp8_quantize,
)
from offline_extract.store.schema import Encoding
from offline_extract.testing.states import residual_like


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
