"""The GPU's nvfp4 kernel (store/nvfp4_kernel.py) against `codecs.nvfp4_quantize`'s torch ops, byte for byte, run on
the CPU by Triton's interpreter (TRITON_INTERPRET=1, which Triton reads when the kernel is defined: so in a process
of its own)."""

import os
import subprocess
import sys

import torch

from offline_extract.store.codecs import nvfp4_dequantize, nvfp4_quantize
from offline_extract.testing.states import residual_like

KERNEL = """
import sys, torch
from offline_extract.store import codecs
from offline_extract.store.nvfp4_kernel import nvfp4_quantize_rows
out = []
for states, layers in torch.load(sys.argv[1]):
    rows, width = states.shape
    packed = torch.empty(rows, width // 2, dtype=torch.uint8)
    blocks = torch.empty(rows, width // codecs.NVFP4_BLOCK, dtype=torch.uint8)
    scales = torch.empty(rows, layers, dtype=torch.float32)
    nvfp4_quantize_rows(
        states, layers, packed, blocks, scales, codecs.e2m1_positive_boundaries(torch.device('cpu')), codecs.NVFP4_BLOCK,
        codecs.FP8_MAX, codecs.E2M1_MAX,
    )
    out.append((packed, blocks.view(codecs.FP8_DTYPE), scales))
torch.save(out, sys.argv[2])
"""


def _ties() -> torch.Tensor:
    """One token of one layer of 64 whose blocks' quotients land on every e2m1 midpoint, each sign: a token
    maximum of 2.625 makes its scale 2**-10 exactly, so block scales 448 and 56 make steps of 0.4375 and
    0.0546875 (exact in bf16 with the midpoints); a block whose scale is e4m3's subnormal 3 * 2**-9; one under
    e4m3's smallest step, which codes as zeros; and two whose scales fall on e4m3 midpoints, 8.5 and 2.5 * 2**-9
    (to the even neighbours 8 and 2 * 2**-9)."""
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    block = torch.tensor([6.0, *mids, *(-m for m in mids), 0.0])
    rows = [block * 0.4375, block * 0.0546875, block * (3 * 2**-9 * 2**-10), block * 2**-24]
    for scale_tie in (8.5, 2.5 * 2**-9):
        rows.append(torch.nn.functional.pad(torch.tensor([scale_tie * 6 * 2**-10]), (0, 15)))
    return torch.cat(rows).to(torch.bfloat16).reshape(1, 96)


def test_the_kernel_gives_the_torch_ops_bytes(tmp_path):
    damaged = residual_like(4, 2, 64, seed=3)
    damaged[0, :64] = 0  # an all-zero token's layer: scale 1
    damaged[1, 70] = float("nan")
    damaged[2, 7] = float("inf")
    # 65 blocks a layer: two passes of the kernel's 64, the second nearly empty.
    cases = [(_ties(), 1), (damaged, 2), (residual_like(6, 3, 1040, seed=1), 3), (residual_like(8, 4, 576), 4)]
    torch.save(cases, tmp_path / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", KERNEL, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for (states, layers), kernel in zip(cases, torch.load(tmp_path / "out.pt"), strict=True):
        ops = nvfp4_quantize(states, layers)
        k_packed, k_blocks, k_scales = kernel
        assert torch.equal(k_packed, ops[0]), (states.shape, (k_packed != ops[0]).nonzero()[:8].tolist())
        assert torch.equal(k_scales.view(torch.int32), ops[2].view(torch.int32))
        # Bytes alike but a NaN's sign, which x86's division gives and the GPU's does not.
        nan = k_blocks.float().isnan()
        assert torch.equal(nan, ops[1].float().isnan())
        assert torch.equal(k_blocks.view(torch.uint8)[~nan], ops[1].view(torch.uint8)[~nan])
    ties = nvfp4_dequantize(*nvfp4_quantize(_ties(), 1)).float().reshape(6, 16)
    # To nearest, ties to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    even = torch.tensor([6.0, 0, 1, 1, 2, 2, 4, 4, 0, -1, -1, -2, -2, -4, -4, 0])
    assert torch.equal(ties[0], even * 0.4375) and torch.equal(ties[1], even * 0.0546875)
    assert ties[2].abs().max() > 0 and not ties[3].any()
    # Each of those blocks' one element, 6.375 and 7.5 steps of the even scale, saturates at e2m1's 6.
    assert (ties[4][0].item(), ties[5][0].item()) == (6 * 8 * 2**-10, 6 * 2 * 2**-9 * 2**-10)


def test_the_kernel_compiles_for_hopper_with_ieee_divisions_only(monkeypatch):
    # Compiled here, without a GPU, by Triton's own ptxas: what the interpreter cannot show is how it lowers.
    # PTX's approximate division (div.full, div.approx) would round quotients otherwise than the torch ops.
    from triton import compile, knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from offline_extract.store import codecs
    from offline_extract.store.nvfp4_kernel import _nvfp4_rows, launch_constants

    pointers = {"states": "*bf16", "packed": "*u8", "blocks": "*u8", "scales": "*fp32"}
    ints = {name: "i32" for name in ("width", "layers", "hidden")}
    constexprs = launch_constants(7, codecs.NVFP4_BLOCK, codecs.FP8_MAX, codecs.E2M1_MAX)
    signature = {**pointers, **ints, "boundaries": "*fp32", **dict.fromkeys(constexprs, "constexpr")}
    # Unheard by the engines earlier tests made (`kernels.TritonCompiles`): no engine of theirs compiled it.
    monkeypatch.setattr(knobs.compilation, "listener", None)
    kernel = compile(
        ASTSource(fn=_nvfp4_rows, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32)
    )
    ptx = kernel.asm["ptx"]
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert kernel.asm["cubin"], "ptxas made no binary"
