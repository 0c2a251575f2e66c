"""Non-finite (NaN or Inf) hidden states: caught per batch on the device, named per sample on the host.

The per-batch test is one reduction per tensor whose result rides to the host behind the batch's own
states, so a clean batch, the common case, costs no synchronization and no temporary the size of the
states. Only a batch that fails it is examined sample by sample and layer by layer, on its host copy.

Policies (`--nonfinite`): `fail` (the default) stops the run at the first such sample; `drop` leaves
the sample out and lists it in rejects.jsonl as "dropped"; `keep` writes it and warns. Failing is the
default because NaN or Inf in a model's states says more about the model, its dtype or a kernel than
about the one input: dropping by default could quietly discard a large part of the corpus over days,
while a stop costs only the shard in progress, since re-running resumes. `drop` is for a model known to
overflow on a few pathological inputs; `keep` for studying them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from offline_extract.options import Nonfinite, check_choice
from offline_extract.data.tokenization import Sample


class NonFiniteError(RuntimeError):
    """A sample's hidden states hold NaN or Inf and the policy is to fail."""


def batch_flag(aux: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool, True when `aux` or `last` may hold NaN or Inf, without waiting for the device.

    A float32 sum is NaN or Inf whenever a term is; it can also overflow from finite terms past 3e38,
    a false alarm the per-sample check then clears. On CUDA the result is copied to pinned host memory
    on the current stream, so it is ready once anything enqueued after it (the states' copy) is.
    """
    flag = ~torch.isfinite(aux.sum(dtype=torch.float32) + last.sum(dtype=torch.float32))
    return flag.to("cpu", non_blocking=True) if flag.is_cuda else flag


def _describe(counts: dict[str, int]) -> str:
    where = ", ".join(f"{n} in {name}" for name, n in counts.items())
    return f"{sum(counts.values())} non-finite values (NaN/Inf) in its hidden states: {where}"


class NonFiniteGuard:
    """Applies a policy to a flagged batch's samples. `on_found(sample, reason)` hears of every sample
    with non-finite states that the policy lets the run survive (dropped or kept)."""

    def __init__(
        self,
        policy: Nonfinite,
        layer_ids: Sequence[int],
        on_found: Callable[[Sample, str], None] = lambda sample, reason: None,
    ):
        check_choice("nonfinite", policy)
        self.policy = policy
        self.names = [f"layer {k}" for k in layer_ids] + ["the final state"]
        self.on_found = on_found

    def _counts(self, aux: torch.Tensor, last: torch.Tensor | None) -> dict[str, int]:
        per_layer = aux.reshape(aux.shape[0], len(self.names) - 1, -1)
        bad = (~torch.isfinite(per_layer)).sum(dim=(0, 2)).tolist()
        if last is not None:
            bad.append(int((~torch.isfinite(last)).sum()))
        return {name: n for name, n in zip(self.names, bad) if n}

    def screen(
        self, samples: Sequence[Sample], aux: torch.Tensor, last: torch.Tensor | None
    ) -> tuple[Sequence[Sample], torch.Tensor | None]:
        """The samples the policy lets through, and their rows of the packed states (None: all rows).
        `last` is None when the final state is not stored."""
        kept, rows, start = [], [], 0
        for s in samples:
            stop = start + s.num_tokens
            counts = self._counts(aux[start:stop], None if last is None else last[start:stop])
            if counts:
                reason = _describe(counts)
                if self.policy == "fail":
                    raise NonFiniteError(
                        f"sample {s.id!r} ({s.source}:{s.line}) has {reason}; --nonfinite drop would list such "
                        f"samples in rejects.jsonl and go on"
                    )
                self.on_found(s, reason)
            if not counts or self.policy == "keep":
                kept.append(s)
                rows.append(torch.arange(start, stop))
            start = stop
        if len(kept) == len(samples):
            return samples, None
        return kept, torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
