import fcntl
import os
import pty
import select
import signal
import struct
import termios
import warnings

import pytest
from extract_runs import kill_left_behind

from offline_extract.default_model import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="session")
def qwen_vl_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Qwen2.5-VL of testing/models.py, its config and HF processor files alone (no weights): for the
    tests of image chats that need its processor (AutoProcessor) and no forward."""
    from offline_extract.testing.models import build_model

    return build_model(
        "qwen2_5_vl", tmp_path_factory.mktemp("qwen_vl") / "m", weights=False, tokenizer_dir=tiny_model_dir
    )


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    """The embedded model in SGLang's engine on CPU, fp32, once per test process: SGLang keeps its
    parallel groups in process globals, so a second engine in the same process cannot start."""
    from offline_extract.engine.distributed import free_port
    from offline_extract.engine.sglang_adapter import Engine, EngineConfig

    return Engine(
        EngineConfig(
            model_path=str(tiny_model_dir),
            device="cpu",
            dtype="float32",
            max_tokens_per_batch=2048,
            max_seqs_per_batch=16,
            context_length=4096,
            nccl_port=free_port(),
        )
    )


@pytest.fixture(scope="session")
def real_model_dir():
    """SmolLM2-135M-Instruct in bf16, converted once into the cache (offline_extract.testing.real_model); the
    test is skipped, saying how to provide the model, where neither PyPI nor a local GGUF can give it."""
    from offline_extract.testing.real_model import (
        RealModelUnavailable,
        ensure_real_model,
    )

    try:
        return ensure_real_model()
    except RealModelUnavailable as e:
        pytest.skip(f"the real model is unavailable: {e}")


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty, offline huggingface_hub cache; returns its HF_HOME (the cache is its `hub` folder)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hf"


@pytest.fixture
def processes_end_with_the_test():
    """For tests that start extractions: whatever of them still runs when the test ends (a time limit cut
    it, or a failure left it) is killed, so that it holds no GPU or rendezvous port of the next test."""
    yield
    left = kill_left_behind()
    if left:
        warnings.warn(f"killed {len(left)} processes the test left running: {left}")


@pytest.fixture
def signals_kept():
    """For tests that run a command in-process: it installs its own SIGINT and SIGTERM handlers (cli._Command,
    the extract command), which would otherwise stay for every later test; the test process gets its own back."""
    kept = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    yield
    for number, handler in kept.items():
        signal.signal(number, handler)


@pytest.fixture
def terminal():
    """`terminal(columns)`: a pseudo-terminal that wide, as (the descriptor a process writes to as its terminal,
    a function giving the rows written to it so far); the caller closes the descriptor once written."""
    controllers = []

    def make(columns: int):
        controller, fd = pty.openpty()
        controllers.append(controller)
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))

        def shown() -> list[str]:
            written = b""
            while select.select([controller], [], [], 0.5)[0]:
                try:
                    written += os.read(controller, 1 << 16)
                except OSError:  # EIO: every writer's end is closed and everything is read
                    break
            return written.decode().replace("\r\n", "\n").splitlines()

        return fd, shown

    yield make
    for controller in controllers:
        os.close(controller)
