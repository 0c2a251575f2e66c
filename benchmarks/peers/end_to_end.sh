#!/usr/bin/env bash
# Ours and SpecForge 0.2.0 end to end, start-up counted, each on its first run on a fresh machine of two GPUs
# (this project and the peer stack installed, README.md here), side by side on the same lognormal records, each on
# a GPU of its own:
#   bash benchmarks/peers/end_to_end.sh RESULTS_DIR
# GPU 0: bin/extract.py --verify 8 as users type it, then the same command again (benchmarks/main_job.sh into
# RESULTS_DIR/ours: each run's seconds from launch to exit in steps.jsonl, its start-up and token lines in its log).
# GPU 1: SpecForge through run_peers.sh into RESULTS_DIR/specforge (its row's notes: wall_s from launch to exit,
# end_to_end_tok_s), whose bench then measures ours in steady state and cross-checks the states. main_job.py draws
# the bench's records with the same generator and seed, so both read the same samples. The two share the host's
# cores and disk, as two jobs on one node would; neither has compiled anything before (run nothing of ours on the
# machine first). E2E_SECONDS (default 540) bounds both sides. On a machine of one GPU the two run one after the other,
# and ours runs once: a second run of ours there would leave SpecForge too little of E2E_SECONDS.
set -uo pipefail
cd "$(dirname "$0")/../.."
results=$(realpath -m "$1") seconds=${E2E_SECONDS:-540}
mkdir -p "$results"
model=/dev/shm/offline_extract_peers_llama3_8b
bash benchmarks/make_8b_model.sh "$model" >"$results/model.log" 2>&1 || { tail "$results/model.log"; exit 1; }
ours() {
  export CUDA_VISIBLE_DEVICES=$1 MAIN_JOB_SECONDS=$seconds MAIN_JOB_STEPS="corpus extract_cold $2"
  bash benchmarks/main_job.sh "$results/ours" 240000
}
specforge() {
  export CUDA_VISIBLE_DEVICES=$1 OUT=$results/specforge PEERS_BASELINES=specforge
  timeout -s TERM "$(( seconds - SECONDS ))" bash benchmarks/peers/run_peers.sh >"$results/specforge.out" 2>&1
}
if (( $(nvidia-smi -L | wc -l) < 2 )); then
  # One GPU: one after the other. Both stay first runs: SGLang 0.5.14 under SpecForge keeps its compiled
  # kernels in the libraries' default folders, ours in $XDG_CACHE_HOME/offline_extract.
  (ours 0); (specforge 0)
else
  (ours 0 extract_warm) & (specforge 1) & wait
fi
