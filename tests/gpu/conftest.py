import pytest
import torch

from offline_extract.testing.models import build_model


@pytest.fixture(scope="module")
def llama3_8b(tmp_path_factory):
    # Generated on the GPU in bf16: ~16 GB written once, shared by the tests of a module (test_gpu.py, test_gpu_writer.py).
    return build_model(
        "llama3_8b",
        tmp_path_factory.mktemp("llama3_8b"),
        dtype=torch.bfloat16,
        device="cuda",
        overrides={"max_position_embeddings": 131072},
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """test_gpu_architectures.py's tests one engine run at a time: every test of an (architecture, backend)
    right after its run, so that a run its time limit cuts leaves whole verdicts for the
    families it reached. pytest groups a module-scoped parameter's tests by fixture, which put every MoE
    family's forced-routing test after all the other tests, where a time limit cut them before any ran.
    trylast: after pytest's own grouping, which would undo this."""
    slots = [i for i, item in enumerate(items) if item.path.name == "test_gpu_architectures.py"]
    runs: dict = {}
    for i in slots:
        item = items[i]
        runs.setdefault(item.callspec.id if hasattr(item, "callspec") else item.nodeid, []).append(item)
    for i, item in zip(slots, [item for run in runs.values() for item in run]):
        items[i] = item
