#!/usr/bin/env bash
# The peer comparison of issue 14 on one GPU: generate the Llama-3-8B-shaped model with its
# weights (bf16, on the GPU, into /dev/shm), then one bench run of ours, SGLang's own return_hidden_states,
# SpecForge 0.2.0 and the HF loop on the same lognormal corpus (mean 1,700 tokens, 240k tokens: about 210k
# timed), each peer's states cross-checked against ours. The result JSON (with `peers`) and the logs go to $OUT.
#
# Needs the SGLang 0.5.17 bundle installed (/tmp/sglang-site), the peer bundle staged or installed
# (/tmp/peer-site, make_peer_bundle.sh) and .peer-bundle/specforge carried. Run from the repository root:
#   bash benchmarks/peers/run_peers.sh [more bin/bench.py options]
# PEERS_BASELINES (default "sglang-engine specforge hf") picks the peers, to split the run over two calls.
set -uo pipefail
out=${OUT:?set OUT to the folder that receives the results}
model=${PEERS_MODEL:-/dev/shm/offline_extract_peers_llama3_8b}
work=${PEERS_WORKDIR:-/dev/shm/offline_extract_peers}
source /tmp/sglang-site/env.sh
export PYTHONUNBUFFERED=1
start=$SECONDS
if [[ ! -f $model/.complete ]]; then
  python - "$model" <<'PY' || exit 1
import sys

import torch

from offline_extract.testing.models import build_model

# Room past the 8,192-token cap: SGLang's engine refuses a prompt as long as the context, and a capped
# sample plus the one token it generates needs 8,193.
build_model("llama3_8b", sys.argv[1], dtype=torch.bfloat16, device="cuda", overrides={"max_position_embeddings": 16384})
PY
  touch "$model/.complete"
  echo "model written to $model in $((SECONDS - start)) s"
fi
baselines=()
for b in ${PEERS_BASELINES:-sglang-engine specforge hf}; do baselines+=(--baseline "$b"); done
python bin/bench.py --model "$model" --load-format auto --num-tokens 240000 --peer-workdir "$work" \
  "${baselines[@]}" --results-dir "$out" "$@" 2>&1 | tee "$out/bench.log"
status=${PIPESTATUS[0]}
# What the peers left for a look afterwards (their states stay in $work on the machine).
[[ -f $work/specforge.log ]] && tail -c 4000000 "$work/specforge.log" >"$out/specforge.log"
[[ -f $work/sglang_engine.json ]] && cp "$work/sglang_engine.json" "$out/"
echo "run_peers: exit $status after $((SECONDS - start)) s"
exit "$status"
