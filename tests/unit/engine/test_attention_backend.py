"""Which attention backend a run gets when --attention-backend is not given: FA3 exactly where SGLang's
FA3 kernels are installed and the GPU is a Hopper, else triton on CUDA and torch_native on CPU."""

import importlib

import pytest
import torch

from offline_extract.engine import sglang_adapter
from offline_extract.engine.sglang_adapter import default_attention_backend
from offline_extract.engine.sglang_releases import installed


@pytest.fixture
def gpu(monkeypatch):
    """Sets the GPU's compute capability and whether sgl_kernel.flash_ops imports."""
    real_import = importlib.import_module

    def set_gpu(major: int, fa3_installed: bool) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (major, 0))

        def import_module(name, *args):
            if name == "sgl_kernel.flash_ops" and not fa3_installed:
                raise ImportError("no flash_ops")
            if name == "sgl_kernel.flash_ops":
                return object()
            return real_import(name, *args)

        monkeypatch.setattr(sglang_adapter.importlib, "import_module", import_module)

    return set_gpu


@pytest.mark.parametrize(
    "major, fa3_installed, expected",
    [(9, True, "fa3"), (9, False, "triton"), (8, True, "triton"), (10, True, "triton"), (8, False, "triton")],
)
def test_fa3_only_on_a_hopper_with_its_kernels_installed(gpu, major, fa3_installed, expected):
    gpu(major, fa3_installed)
    assert default_attention_backend("cuda") == expected


def test_cpu_gets_torch_native_whatever_is_installed(gpu):
    gpu(9, True)
    assert default_attention_backend("cpu") == "torch_native"


def test_a_driver_that_cannot_answer_means_triton(monkeypatch):
    def no_driver(*a):
        raise RuntimeError("no CUDA driver")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_driver)
    assert default_attention_backend("cuda") == "triton"


def test_the_values_refused_before_the_model_loads_are_sglangs_own():
    sglang_adapter.import_sglang("cpu")
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, LOAD_FORMAT_CHOICES

    assert installed().attention_backends == tuple(ATTENTION_BACKEND_CHOICES)
    assert installed().load_formats == tuple(LOAD_FORMAT_CHOICES)
