#!/usr/bin/env bash
# The MoE part of the GPU suite on one H200 in one device call (about 6 minutes), SGLang 0.5.17 (+ FA3):
#   bash benchmarks/gpu_moe.sh RESULTS_DIR [SECONDS]
# Every MoE family against HF on the experts the engine chose, and against HF in fp32 (the bf16 floor), on
# triton, flashinfer and fa3: three lanes side by side on the one GPU, one a backend (each engine's KV pool
# is capped at a few thousand tokens, so they share its memory). Then --verify as users run GPT-OSS and
# Qwen3-Next (default backend), GPT-OSS's MXFP4 checkpoint, and HF's own bf16-vs-fp32 floor on the GPU
# (benchmarks/bf16_floor.py). Each family's parity JSON goes to
# RESULTS_DIR/parity/<architecture>-<backend>.json with its command; every step's command, exit status and
# seconds into RESULTS_DIR/steps.jsonl, its output into RESULTS_DIR/<step>.log.
source "$(dirname "$0")/steps.sh"
begin_gpu_suite "$1" "${2:-560}"

suite="$pytest -m 'gpu and moe' tests/gpu/test_gpu_architectures.py"
step moe_triton 420 "$suite -k triton" &
step moe_flashinfer 420 "$suite -k flashinfer" &
step moe_fa3 420 "$suite -k fa3" &
wait
step verify_default_backend 150 "$pytest -m gpu tests/gpu/test_gpu.py -k verify_passes_on_the_families" &
step mxfp4 150 "$pytest -m gpu tests/gpu/test_gpu_mxfp4.py" &
step bf16_floor 150 "python benchmarks/bf16_floor.py --device cuda --out $results/bf16_floor_h200.json" &
wait
