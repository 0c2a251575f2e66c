#!/usr/bin/env bash
# The performance record of issues 24 and 26 in one device call on a machine of two H200s, SGLang 0.5.17 (+ FA3) on
# the path:
#   bash benchmarks/gpu_perf.sh RESULTS_DIR [SECONDS]
# bin/bench.py on the 8B-shaped dummy model, each run a process of its own that writes its JSON (with its command)
# to RESULTS_DIR, each step under its own time limit (benchmarks/steps.sh). GPU 0: storage (bf16 and fp8, each
# without and with zstd, 400k lognormal tokens, 12 writer threads) and 250k tokens to local disk; GPU 1 beside it:
# 250k tokens to /dev/shm on an empty JIT cache, then one and three 131,072-token samples (one warm-up sample
# first); then, both GPUs free, TP=2 on 250k tokens. The two lanes share the host's cores: compare ratios taken
# within one run, as each JSON gives them. On a machine of one GPU the lanes run one after the other on it (lane 1
# first: its steps re-check issue 26's targets; the storage steps get what time is left) and TP=2 is skipped.
source "$(dirname "$0")/steps.sh"
begin "$1" "${2:-560}"
bench="python bin/bench.py --disk-probe-gb 1 --results-dir $results"
lane0() {
  export CUDA_VISIBLE_DEVICES=0
  step disk_250k 75 "$bench --num-tokens 250000 --out /tmp/oe_disk"
  for store in bf16 fp8; do
    for compress in none zstd; do
      step "${store}_$compress" 75 "$bench --num-tokens 400000 --store $store --compress $compress --writers 12 --out /dev/shm/oe_storage"
    done
  done
}
lane1() {
  export CUDA_VISIBLE_DEVICES=$1
  step cold_250k 90 "$bench --cold --num-tokens 250000 --out /dev/shm/oe_cold"
  step one_131k 130 "$bench --lengths fixed --mean-length 131072 --num-tokens 262144 --warmup-batches 1 --out /dev/shm/oe_long"
  step three_131k 150 "$bench --lengths fixed --mean-length 131072 --num-tokens 524288 --warmup-batches 1 --out /dev/shm/oe_long"
}
if (( $(nvidia-smi -L | wc -l) < 2 )); then
  lane1 0; lane0
  echo '{"step": "tp2_250k", "rc": null, "seconds": 0, "note": "skipped: TP=2 needs two GPUs"}' >>"$results/steps.jsonl"
  exit
fi
lane0 & lane1 1 & wait
step tp2_250k 120 "python -m torch.distributed.run --nproc-per-node 2 bin/bench.py --tp 2 --num-tokens 250000 --disk-probe-gb 1 --results-dir $results --out /dev/shm/oe_tp2"
