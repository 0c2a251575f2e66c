#!/usr/bin/env bash
# The MoE part of the GPU suite on one H200, SGLang 0.5.17 (+ FA3):
#   bash benchmarks/gpu_moe.sh RESULTS_DIR [SECONDS] [PART ...]
# Every MoE family against HF on the experts the engine chose, and against HF in fp32 (the bf16 floor), on
# triton, flashinfer and fa3: six lanes side by side on the one GPU, two a backend, each on half the families
# (each engine's KV pool is capped at a few thousand tokens, so they share its memory; a family's engine run
# is mostly imports, on the CPU); each family's tests run right after its engine run
# (tests/gpu/conftest.py), so a lane cut by the time limit leaves whole verdicts. Then --verify as users run
# GPT-OSS and Qwen3-Next (default backend), GPT-OSS's MXFP4 checkpoint, and HF's own bf16-vs-fp32 floor on
# the GPU (benchmarks/bf16_floor.py). PARTs, if given, name what to run instead: families by their test id
# (qwen3_moe glm4_moe gpt_oss qwen3_next minimax_m2 qwen2_moe deepseek_v3 kimi_k25; one lane a backend) and
# the later steps by name (verify mxfp4 floor). Each
# family's parity JSON goes to RESULTS_DIR/parity/<architecture>-<backend>.json with its command; every step's
# command, exit status and seconds into RESULTS_DIR/steps.jsonl, its output into RESULTS_DIR/<step>.log.
source "$(dirname "$0")/steps.sh"
begin_gpu_suite "$1" "${2:-560}"
shift $(( $# < 2 ? $# : 2 ))
parts=" $* " families=()
for part in "$@"; do
  case $part in verify|mxfp4|floor) ;; *) families+=("$part") ;; esac
done
wanted() { [[ $parts == "  " || $parts == *" $1 "* ]]; }

if [[ $parts == "  " ]]; then
  # The test file's MoE families in its order, in two halves: six lanes, two a backend.
  mapfile -t groups < <(python -c 'import sys; sys.path[:0] = ["tests", "tests/gpu"]
from test_gpu_architectures import GPU_MODELS, MOE_ARCHS
moe = [a for a in GPU_MODELS if a in MOE_ARCHS]; half = (len(moe) + 1) // 2
print(" ".join(moe[:half])); print(" ".join(moe[half:]))')
else
  groups=("${families[*]}")
fi
suite="$pytest -m 'gpu and moe' tests/gpu/test_gpu_architectures.py"
for i in "${!groups[@]}"; do
  [[ -z ${groups[i]} ]] && continue
  only=$(sed 's/ / or /g' <<<"${groups[i]}")
  for backend in triton flashinfer fa3; do
    step "moe_${backend}_$((i + 1))" 420 "$suite -k '$backend and ($only)'" &
  done
done
wait
wanted verify && step verify_default_backend 150 "$pytest -m gpu tests/gpu/test_gpu.py -k verify_passes_on_the_families" &
wanted mxfp4 && step mxfp4 150 "$pytest -m gpu tests/gpu/test_gpu_mxfp4.py" &
wanted floor && step bf16_floor 150 "python benchmarks/bf16_floor.py --device cuda --out $results/bf16_floor_h200.json" &
wait
