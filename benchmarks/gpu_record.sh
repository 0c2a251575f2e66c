#!/usr/bin/env bash
# One device call's worth of GPU record on a two-GPU machine, SGLang 0.5.17 (+ FA3) on the path:
#   bash benchmarks/gpu_record.sh RESULTS_DIR SECONDS
# Two lanes run side by side, one a GPU, each step under its own time limit so that a slow step leaves
# the others their time; then the two-GPU steps. Every step's command goes into RESULTS_DIR/steps.jsonl
# with its exit status and seconds, and its output into RESULTS_DIR/<step>.log (benchmarks/steps.sh).
source "$(dirname "$0")/steps.sh"
begin "$1" "$2"

bench="python bin/bench.py --results-dir $results/bench --disk-probe-gb 1"
lane0() {
  CUDA_VISIBLE_DEVICES=0 step moe_forced_routing 130 "OFFLINE_EXTRACT_RESULTS=$results/moe python -m pytest -m gpu tests/gpu/test_gpu_architectures.py -v -rA -k 'test_moe_matches_every_token_with_the_engines_routing and triton and (qwen3_moe or deepseek_v3)'"
  CUDA_VISIBLE_DEVICES=0 step fp8_checkpoints 130 "OFFLINE_EXTRACT_RESULTS=$results/fp8 python -m pytest -m gpu tests/gpu/test_gpu_fp8.py -v -rA"
}
lane1() {
  CUDA_VISIBLE_DEVICES=1 step long_131k 170 "$bench --out /dev/shm/oe_long --lengths fixed --mean-length 131072 --num-tokens 262144 --warmup-batches 1 --chunk-sweep 65536 --profile $results/profile_131k --profile-batches 1"
  CUDA_VISIBLE_DEVICES=1 step bench_300k 110 "$bench --out /dev/shm/oe_300k --num-tokens 300000"
}
lane0 & lane1 & wait
CUDA_VISIBLE_DEVICES=0,1 step two_gpu_tests 90 "python -m pytest -m gpu tests/gpu/test_gpu_two.py -v -rA -k 'two_one_gpu_nodes or float32'"
