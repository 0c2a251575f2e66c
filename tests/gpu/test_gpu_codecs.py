"""The store's codecs on the GPU, where extraction runs them before the copy to host (run with `-m gpu`)."""

import pytest
import torch

from offline_extract.store.codecs import fp8_quantize, nvfp4_dequantize, nvfp4_quantize, nvfp4_quantize_ops
from offline_extract.testing.states import residual_like

pytestmark = pytest.mark.gpu


def test_fp8_on_the_gpu_matches_the_cpu():
    x = residual_like(3000, 4, 1024)
    cpu = fp8_quantize(x, layers=4)
    gpu = fp8_quantize(x.cuda(), layers=4)
    assert torch.equal(gpu[1].cpu(), cpu[1])
    # Division may round differently on the two devices only where a quotient sits on a rounding tie.
    assert (gpu[0].cpu().view(torch.uint8) != cpu[0].view(torch.uint8)).float().mean() < 1e-4


def test_nvfp4_on_the_gpu_matches_the_cpu():
    x = residual_like(3000, 4, 1024)
    cpu = nvfp4_quantize(x, layers=4)
    gpu = [t.cpu() for t in nvfp4_quantize(x.cuda(), layers=4)]
    assert torch.equal(gpu[2], cpu[2])
    # As fp8's values: the block scales and the codes may differ only where a quotient sits on a rounding tie.
    for g, c in zip(gpu[:2], cpu[:2]):
        assert (g.view(torch.uint8) != c.view(torch.uint8)).float().mean() < 1e-4
    # Decoding multiplies exactly and rounds once, alike on both.
    assert torch.equal(nvfp4_dequantize(*(t.cuda() for t in cpu)).cpu(), nvfp4_dequantize(*cpu))


def test_the_nvfp4_kernel_gives_the_torch_ops_bytes_on_the_gpu():
    x = residual_like(3000, 4, 576).cuda()
    kernel = nvfp4_quantize(x, layers=4)
    ops = [torch.empty_like(t) for t in kernel]
    nvfp4_quantize_ops(x, 4, *ops)
    for k, o in zip(kernel, ops):
        assert torch.equal(k.view(torch.uint8), o.view(torch.uint8))
