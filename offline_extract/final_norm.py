"""The model's final norm, recorded with a run so that an export can turn one final state into the other.

SpecForge trains on the post-norm state and speculators on the pre-norm one. A run records the final
RMSNorm the engine ran (weight as loaded, epsilon, and whether the gain is `w` or Gemma's `1 + w`) as
the run fact `final_norm` (store/schema.py `RunInfo`), so either run feeds either trainer:

- pre -> post is exact: the norm is applied in float32, as SGLang's own RMSNorm computes it.
- post -> pre cannot be exact. RMSNorm divides each token by its own root mean square, and the post-norm
  state no longer holds that scale: every positive multiple of a token's pre-norm state has the same
  post-norm state (up to epsilon). What can be recovered is the pre-norm state divided by its own root
  mean square, post / gain: its direction (cosine 1 up to rounding), which the norm maps back onto the
  post-norm state within a relative eps / 2 (5e-6 at eps 1e-5, far below a bf16 step). Solving for the
  lost scale instead would divide by 1 - mean((post / gain)^2), a difference of about eps / mean square
  that rounding in the stored state swamps. That is all speculators' EAGLE-3
  training uses: it reads the final state only through the verifier's norm (`verifier_norm`, then the
  LM head, for the target logits), and a norm does not see a token's scale. A trainer that fed the raw
  pre-norm magnitude to its drafter (an MTP head) would need a pre-norm run.

A gain element of exactly 0 leaves nothing of that coordinate in the post-norm state; it comes back as 0
(the norm maps it to 0 either way).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class FinalNorm:
    weight: torch.Tensor  # float32 [H], as the engine loaded it
    eps: float
    weight_offset: float  # the gain is weight + weight_offset: 0 for RMSNorm, 1 for Gemma-style norms

    def to_json(self) -> dict:
        raw = self.weight.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        return {
            "kind": "rmsnorm",
            "eps": self.eps,
            "weight_offset": self.weight_offset,
            "weight_float32_base64": base64.b64encode(raw).decode("ascii"),
        }

    @classmethod
    def from_json(cls, document: dict) -> "FinalNorm":
        if document.get("kind") != "rmsnorm":
            raise ValueError(f"unknown final norm kind {document.get('kind')!r}")
        weight = np.frombuffer(base64.b64decode(document["weight_float32_base64"]), dtype="<f4")
        return cls(torch.from_numpy(weight.copy()), float(document["eps"]), float(document["weight_offset"]))

    @property
    def gain(self) -> torch.Tensor:
        return self.weight.float() + self.weight_offset

    def apply(self, pre: torch.Tensor) -> torch.Tensor:
        """The post-norm state of [T, H] pre-norm states, float32."""
        x = pre.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.gain

    def undo(self, post: torch.Tensor) -> torch.Tensor:
        """A pre-norm state for [T, H] post-norm states, float32: the pre-norm state over its root mean
        square, which apply() maps back onto `post` (see the module docstring)."""
        gain = self.gain
        return torch.where(gain != 0, post.float() / torch.where(gain != 0, gain, 1.0), 0.0)


def recorded(document: dict | None) -> FinalNorm | None:
    """The final norm a run records (`RunInfo.final_norm`); None when it records none."""
    return FinalNorm.from_json(document) if document else None
