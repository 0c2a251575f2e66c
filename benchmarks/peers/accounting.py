"""How every peer row is measured: the process tree's peak host memory, and per-layer agreement with ours.

Layers are keyed by our layer id (`"1"`, `"15"`, ...) and `"final"` (the state after the final norm).
A peer's state is compared token by token with ours for the same token ids: the cosine says whether it
is the same vector, the norm ratio (peer / ours) tells a missing or extra final norm (the residual
stream before the norm is many times larger than after it) from bf16 noise.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, field

import psutil
import torch


@dataclass
class PeerRow:
    """One entry of the bench JSON's `peers` list."""

    name: str
    version: str
    command: str
    tok_s: float | None
    bytes_per_token: float | None  # on disk (or, for a peer that writes nothing, as noted in `notes`)
    host_peak_rss_bytes: int | None
    cosine_vs_ours: dict[str, dict] | None  # LayerTally.summary(); None where no comparable states exist
    notes: dict = field(default_factory=dict)
    error: str | None = None  # the peer did not complete: why, verbatim

    def to_json(self) -> dict:
        return asdict(self)


def _tree_rss(root: psutil.Process) -> int:
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass  # exited between listing and reading: it holds nothing any more
    return total


class TreePeakRss:
    """Peak of the summed RSS of a process and all its descendants, sampled on a background thread.

    Peers spread over processes (SGLang's scheduler and detokenizer, torchrun's workers, data-loader
    workers), so one process's high-water mark would under-count them. Sampling misses peaks shorter
    than `interval`; shared pages (CUDA libraries mapped by every process) count once per process.
    """

    def __init__(self, pid: int, interval: float = 0.2):
        self._root = psutil.Process(pid)
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-peak-rss", daemon=True)
        self.peak = 0

    def _run(self) -> None:
        while True:
            try:
                self.peak = max(self.peak, _tree_rss(self._root))
            except psutil.NoSuchProcess:
                return
            if self._stop.wait(self._interval):
                return

    def __enter__(self) -> "TreePeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class _LayerStats:
    tokens: int = 0
    samples: int = 0
    cos_sum: float = 0.0
    cos_min: float = math.inf
    ratio_sum: float = 0.0


class LayerTally:
    """Per-layer cosine and norm ratio of a peer's states against ours, folded one sample at a time."""

    def __init__(self):
        self._layers: dict[str, _LayerStats] = {}

    def add(self, sample_id: str, ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
        """`ours` and `theirs` map a layer key to [T, H] states of the same T tokens."""
        for key, mine in ours.items():
            if key not in theirs:
                continue
            other = theirs[key]
            if mine.shape != other.shape:
                raise ValueError(
                    f"sample {sample_id}, layer {key}: ours {tuple(mine.shape)} vs peer {tuple(other.shape)}"
                )
            a, b = mine.float(), other.float()
            cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
            ratio = b.norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-30)
            st = self._layers.setdefault(key, _LayerStats())
            st.tokens += a.shape[0]
            st.samples += 1
            st.cos_sum += cos.double().sum().item()
            st.cos_min = min(st.cos_min, cos.min().item())
            st.ratio_sum += ratio.double().sum().item()

    def summary(self) -> dict[str, dict]:
        return {
            key: {
                "cosine_mean": st.cos_sum / st.tokens,
                "cosine_min": st.cos_min,
                "norm_ratio_mean": st.ratio_sum / st.tokens,
                "samples": st.samples,
                "tokens": st.tokens,
            }
            for key, st in self._layers.items()
        }


def split_layers(aux: torch.Tensor, last: torch.Tensor | None, layer_ids) -> dict[str, torch.Tensor]:
    """[T, k*H] aux states (layers in ascending order, as ours and SpecForge store them) and the final
    state as one [T, H] tensor per layer key."""
    layer_ids = list(layer_ids)
    if aux.shape[-1] % len(layer_ids):
        raise ValueError(f"aux width {aux.shape[-1]} is not a multiple of {len(layer_ids)} layers")
    out = dict(zip((str(k) for k in layer_ids), aux.chunk(len(layer_ids), dim=-1)))
    if last is not None:
        out["final"] = last
    return out
