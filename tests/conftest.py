import pytest

from offline_extract.default_model import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    """The embedded model in SGLang's engine on CPU, fp32, once per test process: SGLang keeps its
    parallel groups in process globals, so a second engine in the same process cannot start."""
    from offline_extract.engine.distributed import free_port
    from offline_extract.engine.sglang_adapter import Engine, EngineConfig

    return Engine(
        EngineConfig(
            model_path=str(tiny_model_dir), device="cpu", dtype="float32", max_tokens_per_batch=2048,
            max_seqs_per_batch=16, context_length=4096, nccl_port=free_port(),
        )
    )
