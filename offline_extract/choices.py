"""The names of a run's choices, as the command line offers them. Stated here, where importing them
costs neither torch nor SGLang, so that `--help` and a mistyped option answer at once; the modules that
implement a choice key their tables by these names."""
from __future__ import annotations

# --nonfinite: what a sample whose states hold NaN or Inf does to the run (engine/nonfinite.py).
NONFINITE_POLICIES = ("fail", "drop", "keep")

# --final-state: which final state `Captured.last` holds (engine/sglang_adapter.py). Trainers disagree, and
# a drafter fed the other one is silently wrong (GPT-OSS drafters broke exactly so, sglang#32334).
FINAL_STATES = {
    "post-norm": "the last decoder layer's output after the model's final norm (SGLang's EAGLE-3 and SpecForge)",
    "pre-norm": "the last decoder layer's output before the model's final norm (vLLM and speculators, which "
    "apply the verifier's norm at training time)",
}

# --store and --compress: how states are stored (store/schema.py gives each store its dtype).
STORES = ("bf16", "fp8")
COMPRESSIONS = ("none", "zstd")
