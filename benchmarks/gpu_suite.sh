#!/usr/bin/env bash
# The one-GPU files of the GPU suite (`pytest -m gpu`) in one device call on a machine of two H200s, SGLang 0.5.17 (+ FA3) on the path:
#   bash benchmarks/gpu_suite.sh RESULTS_DIR [SECONDS] [LANE...]
# Lanes side by side, each step under its own time limit (benchmarks/steps.sh): on GPU 0 the architecture suite,
# one backend a process, beside the FP8 checkpoints and the exports and codecs (tiny models, and each engine's
# KV pool is capped, so five fit one GPU); on GPU 1 the engine file, its two 8B-shaped tests (one model, built
# once; the 65k/131k test against HF alone takes minutes) beside the rest, whose models are tiny. The MoE part of the
# architecture suite and the MXFP4 file are benchmarks/gpu_moe.sh's, the two-GPU file benchmarks/two_gpus.sh's
# (a call of its own: it needs both GPUs). Each step's command, exit status and seconds go to
# RESULTS_DIR/steps.jsonl, its output to RESULTS_DIR/<step>.log, the parity JSONs to RESULTS_DIR/parity.
# On a machine of one GPU the lanes named (lane0, lane1; both if none) run one after the other on it: both
# take longer than one call there, so name one a call. The lane `writer` (tests/gpu/test_gpu_writer.py: the
# writer at a real run's scale, read back byte for byte; minutes a case) runs only when named, on GPU 0, a
# call of its own on either machine.
source "$(dirname "$0")/steps.sh"
begin_gpu_suite "$1" "${2:-560}"
lane0() {
  export CUDA_VISIBLE_DEVICES=$1
  for backend in triton flashinfer fa3; do
    step "dense_$backend" 330 "$pytest -m 'gpu and not moe' tests/gpu/test_gpu_architectures.py -k $backend" &
  done
  step fp8 330 "$pytest -m gpu tests/gpu/test_gpu_fp8.py" &
  step exports_codecs 330 "$pytest -m gpu tests/gpu/test_gpu_exports.py tests/gpu/test_gpu_codecs.py" &
  wait
}
lane1() {
  export CUDA_VISIBLE_DEVICES=$1
  step engine_8b 540 "$pytest -m gpu tests/gpu/test_gpu.py -k llama3_8b" &
  step engine 540 "$pytest -m gpu tests/gpu/test_gpu.py -k 'not llama3_8b'" &
  wait
}
writer() {
  # Side by side: one after the other, each under half a call, cut the fp8 + zstd case (2026-12-01 09:24).
  export CUDA_VISIBLE_DEVICES=$1
  step writer_bf16 530 "$pytest -m gpu tests/gpu/test_gpu_writer.py -k bf16" &
  step writer_fp8 530 "$pytest -m gpu tests/gpu/test_gpu_writer.py -k fp8" &
  wait
}
if [[ " ${*:3} " == *" writer "* ]]; then
  writer 0
  exit
fi
if (( $(nvidia-smi -L | wc -l) < 2 )); then
  for lane in "${@:3}"; do "$lane" 0; done
  (( $# > 2 )) || { lane0 0; lane1 0; }
  exit
fi
lane0 0 & lane1 1 & wait
