import pytest
import torch

from offline_extract.testing.models import build_model


@pytest.fixture(scope="module")
def llama3_8b(tmp_path_factory):
    # Generated on the GPU in bf16: ~16 GB written once, shared by the tests of a module (test_gpu.py, test_gpu_writer.py).
    return build_model("llama3_8b", tmp_path_factory.mktemp("llama3_8b"), dtype=torch.bfloat16, device="cuda",
                       overrides={"max_position_embeddings": 131072})
