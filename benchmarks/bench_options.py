"""bin/bench.py's options and the peers it can run beside ours, apart from the code that runs them: its
--help shows their defaults, and should not wait seconds for torch and SGLang to import."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from offline_extract.options import default

SGLANG_ENGINE, SPECFORGE = "sglang-engine", "specforge"  # peers/sglang_engine.py, peers/specforge.py
SGLANG_AUX = "sglang-aux"  # peers/sglang_engine.py --aux-layers: SGLang 0.5.23's capture-only aux mode
OWN_PROCESS = (SGLANG_ENGINE, SGLANG_AUX, SPECFORGE)  # run by run_subprocess_peers; hf runs in the bench process
BASELINES = ("hf", *OWN_PROCESS)
REPO = Path(__file__).resolve().parents[1]
LOGNORMAL_CAP = 8192  # the synthetic lengths' cap when --max-length is not given
SYNTHETIC_TOKENS = 1_000_000  # the synthetic corpus when --num-tokens is not given


@dataclass(frozen=True)
class PeerOptions:
    workdir: str = "/dev/shm/offline_extract_peers"  # peers' inputs, outputs and logs
    cross_check_samples: int = 32
    peer_site: str = "/tmp/peer-site"  # SGLang 0.5.14 + SpecForge 0.2.0 (make_peer_bundle.sh)
    specforge_dir: str = str(REPO / ".peer-bundle" / "specforge")  # its script and draft config, fetched
    specforge_batch_size: int = 32  # its default
    # SpecForge's own default is flashinfer; fa3 is what our rows use on Hopper, so the engines compare.
    specforge_attention_backend: str = "fa3"
    # The SGLang peers' device where not the GPU, with their options there (the CPU tests' torch_native).
    device: str = "cuda"
    sglang_attention_backend: str | None = None  # None: SGLang's own choice
    sglang_mem_fraction_static: float | None = None  # None: SGLang's own


@dataclass(frozen=True)
class BenchOptions:
    model: str | None = None  # a model directory; None: generate `shape`
    shape: str = "llama3_8b"
    load_format: str = "dummy"
    dtype: str = "bfloat16"
    tp: int = 1
    attention_backend: str | None = None
    outs: tuple[str, ...] = ("/dev/shm/offline_extract_bench",)
    # Corpus files read as bin/extract.py --data reads them, instead of the synthetic samples below.
    data: tuple[str, ...] = ()
    lengths: str = "lognormal"  # "lognormal" or "fixed"
    mean_length: int = 1700
    # The lognormal lengths' cap, or with `data` extract.py's --max-length; None: LOGNORMAL_CAP, or its default.
    max_length: int | None = None
    # The synthetic corpus's size (None: SYNTHETIC_TOKENS), or with `data` the most of it taken (None: all).
    num_tokens: int | None = None
    tokens_per_batch: int | None = None  # None: bin/extract.py's default for the model
    chunk_tokens: int | None = None  # the engine's chunk for longer samples; None: tokens_per_batch
    chunk_sweep: tuple[int, ...] = ()  # also time bare chunked prefill of the first timed batch at these
    warmup_batches: int = 2
    cold: bool = False  # compile into an empty JIT cache, as a fresh machine does
    jit_cache: str | None = None  # where compiled kernels are kept (EngineConfig.jit_cache)
    baselines: tuple[str, ...] = ()  # of BASELINES
    peer_options: PeerOptions = PeerOptions()
    disk_probe_bytes: int = 4 << 30
    writers: int | None = default("writers")  # None: bin/extract.py's default for the model
    image_threads: int | None = default("image_threads")  # None: default_image_threads
    encodings: tuple[tuple[str, str], ...] = (("bf16", "none"),)  # (--store, --compress) pairs, one model load
    fp8_error_tokens: int = 131072  # tokens over which fp8's decoded states are compared with bf16's
    seed: int = 0
    results_dir: str = "benchmarks/runs"  # ad-hoc runs, git-ignored (benchmarks.RUNS)
    profile: str | None = None
    profile_batches: int = 4
    single_gpu_results: tuple[str, ...] = ()  # one-GPU result JSONs of the same session, for `scaling`
    host_threads: tuple[int, ...] = ()  # also time extraction with torch's intra-op threads at each of these
    command: str = ""

    @property
    def longest(self) -> int:
        """The longest sample the corpus can hold, which sizes the engine's KV pool."""
        if self.data:
            return self.max_length or default("max_length")
        return self.mean_length if self.lengths == "fixed" else self.max_length or LOGNORMAL_CAP

    @property
    def synthetic_tokens(self) -> int:
        return self.num_tokens or SYNTHETIC_TOKENS
