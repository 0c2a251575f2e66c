#!/usr/bin/env bash
# The Llama-3-8B-shaped model with generated bf16 weights (drawn on the GPU), written once a machine:
#   bash benchmarks/make_8b_model.sh DIR
# Shared by the peer comparison and the main job, which both need weights on disk (the SGLang-based peers
# and --verify's HF reference read them). Context 16,384: room past the 8,192-token cap of the lognormal
# lengths, since SGLang's engine refuses a prompt as long as the context and a capped sample plus the one
# token it generates needs 8,193.
set -euo pipefail
model=$1
[[ -f $model/.complete ]] && exit 0
start=$SECONDS
python - "$model" <<'PY'
import sys

import torch

from offline_extract.testing.models import build_model

build_model("llama3_8b", sys.argv[1], dtype=torch.bfloat16, device="cuda", overrides={"max_position_embeddings": 16384})
PY
touch "$model/.complete"
echo "model written to $model in $((SECONDS - start)) s"
