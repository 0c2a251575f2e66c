#!/usr/bin/env bash
# The peer comparison on one GPU: generate the Llama-3-8B-shaped model with its
# weights (bf16, on the GPU, into /dev/shm), then one bench run of ours, SGLang's own return_hidden_states,
# SpecForge 0.2.0 and the HF loop on the same lognormal corpus (mean 1,700 tokens, 240k tokens: about 210k
# timed), each peer's states cross-checked against ours. The result JSON (with `peers`, rewritten as each
# part finishes, so a run stopped by `timeout` keeps what it measured) and the logs go to $OUT.
#
# Needs this project installed (SGLang 0.5.17 with it), the peer stack installed (/tmp/peer-site,
# make_peer_bundle.sh) and .peer-bundle/specforge. Run from the repository root:
#   bash benchmarks/peers/run_peers.sh [more bin/bench.py options]
# PEERS_BASELINES (default "sglang-engine specforge hf") picks the peers, to split the run in two.
set -uo pipefail
out=${OUT:?set OUT to the folder that receives the results}
mkdir -p "$out"
model=${PEERS_MODEL:-/dev/shm/offline_extract_peers_llama3_8b}
work=${PEERS_WORKDIR:-/dev/shm/offline_extract_peers}
export PYTHONUNBUFFERED=1
start=$SECONDS
status=1
# What the peers left for a look afterwards (their states stay in $work on the machine), however the run
# ends: a `timeout` that stops it (SIGTERM) still lets this copy run. The bench's own result JSON in $OUT
# already holds each peer's row from the moment that peer finished.
keep_peer_files() {
  [[ -f $work/specforge.log ]] && tail -c 4000000 "$work/specforge.log" >"$out/specforge.log"
  for f in sglang_engine.json sglang_aux.json; do [[ -f $work/$f ]] && cp "$work/$f" "$out/"; done
  echo "run_peers: exit $status after $((SECONDS - start)) s"
}
trap keep_peer_files EXIT
trap 'status=143; exit 143' TERM
trap 'status=130; exit 130' INT
# An earlier run's files on the same machine must not pass for this run's.
rm -f "$work/specforge.log" "$work/sglang_engine.json" "$work/sglang_aux.json"
bash benchmarks/make_8b_model.sh "$model" || exit 1
baselines=()
for b in ${PEERS_BASELINES:-sglang-engine specforge hf}; do baselines+=(--baseline "$b"); done
python bin/bench.py --model "$model" --load-format auto --num-tokens 240000 --peer-workdir "$work" \
  "${baselines[@]}" --results-dir "$out" "$@" 2>&1 | tee "$out/bench.log"
status=${PIPESTATUS[0]}
exit "$status"
