#!/usr/bin/env bash
# The two-GPU record (issue 12) on a machine with two GPUs of one host, SGLang 0.5.17 on the path:
#   bash benchmarks/two_gpus.sh tests RESULTS_DIR    the two-GPU test suite (pytest -m gpu tests/gpu/test_gpu_two.py)
#   bash benchmarks/two_gpus.sh bench RESULTS_DIR    one GPU, DP=2 and TP=2; 1M tokens a GPU; /dev/shm and disk
# Each bench JSON records its own command; this script is the sequence.
set -euo pipefail
cd "$(dirname "$0")/.."
what=$1 results=$2
mkdir -p "$results"
case $what in
tests)
  # Each test's body under 170 s (pytest-timeout; its fixtures' runs have their own limits), so that one that
  # hangs costs that and the others still run; the two-node test's nodes write their logs into RESULTS_DIR/two_nodes.
  # A SIGINT from the device call's limit stops pytest, which then prints what it has seen: tee -i ignores
  # the SIGINT, so that it goes on writing the log. --durations: what each test took, to fit the call.
  OFFLINE_EXTRACT_RESULTS=$results python -m pytest -m gpu tests/gpu/test_gpu_two.py -v -rA -p no:cacheprovider \
    --timeout 170 -o timeout_func_only=true --durations=0 2>&1 | tee -i "$results/two_gpu_tests.log"
  ;;
bench)
  disk=/tmp/offline_extract_bench_disk
  outs=(--out /dev/shm/offline_extract_bench --out "$disk" --results-dir "$results")
  CUDA_VISIBLE_DEVICES=0 python bin/bench.py --num-tokens 1000000 "${outs[@]}"
  singles=()
  for f in "$results"/bench_*_w1_tp1_*.json; do singles+=(--single-gpu-result "$f"); done
  python -m torch.distributed.run --nproc-per-node 2 bin/bench.py --num-tokens 2000000 "${outs[@]}" "${singles[@]}"
  python -m torch.distributed.run --nproc-per-node 2 bin/bench.py --tp 2 --num-tokens 2000000 "${outs[@]}"
  ;;
*) echo "usage: $0 tests|bench RESULTS_DIR" >&2; exit 2 ;;
esac
