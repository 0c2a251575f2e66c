#!/usr/bin/env bash
# The main job as users type it, on one GPU of a fresh machine, the project installed (SGLang with it):
#   bash benchmarks/main_job.sh RESULTS_DIR [NUM_TOKENS]
# 1. bin/extract.py on the 8B-shaped model with its generated weights (benchmarks/make_8b_model.sh), a
#    lognormal chat corpus of NUM_TOKENS (default: what fits 70% of the free disk, at most 1.5M), --verify 8,
#    written to local disk (/tmp); with MAIN_JOB_STACKS=1 every thread's stack is sampled every 5 s
#    (stacks_cold.txt: where the cold minute goes);
# 2. bin/inspect.py --verify on that output;
# 3. the same command again into a fresh folder, now that SGLang's JIT kernels are in their cache;
# 4. bin/bench.py on the same model and lengths, for bare prefill's rate (the ratio's denominator).
# Each step runs under its own time limit within MAIN_JOB_SECONDS (default 590); its command, exit status and
# seconds go to RESULTS_DIR/steps.jsonl, its output to <step>.log in RESULTS_DIR/logs.tar.gz, and what SGLang's
# JIT caches hold before and after the first run to caches.txt.
# A job too big for one sitting runs as several, one after another on the same machine:
#   MAIN_JOB_STEPS         the steps this invocation runs, in this order, of: model corpus extract_cold
#                          inspect_verify extract_warm bench. Unset: all six, in a work folder made afresh and
#                          removed at the end. Set: the work folder (corpus, outputs) stays for the next one,
#                          and each step may take what is left of MAIN_JOB_SECONDS;
#   MAIN_JOB_EXTRACT_ARGS  options added to both extractions (e.g. --store fp8 --compress zstd);
#   MAIN_JOB_BENCH_ARGS    options added to the bench's (e.g. the same encoding, --num-tokens 1000000).
source "$(dirname "$0")/steps.sh"
begin "$1" "${MAIN_JOB_SECONDS:-590}"
model=/dev/shm/offline_extract_peers_llama3_8b
work=/tmp/offline_extract_main_job
logs=$work/logs
all="model corpus extract_cold inspect_verify extract_warm bench"
steps=${MAIN_JOB_STEPS:-$all}
for name in $steps; do [[ " $all " == *" $name "* ]] || { echo "MAIN_JOB_STEPS: no step $name (of: $all)" >&2; exit 2; }; done
[[ -v MAIN_JOB_STEPS ]] || rm -rf "$work"
rm -rf "$logs"; mkdir -p "$logs"
free=$(df --output=avail -B1 "$work" | tail -1)
tokens=${2:-$(python3 -c "print(min(1_500_000, int($free * 0.7 / 32773) // 1000 * 1000))")}
corpus=""; [[ " $steps " == *" corpus "* ]] && corpus="; corpus of $tokens tokens"
echo "free disk under $work: $free bytes; steps: $steps$corpus" | tee "$results/plan.txt"

logged() {  # a step, then the logs archived, so that a job cut short keeps them
  step "$@"
  tar -czf "$results/logs.tar.gz" -C "$logs" .
}
limit() { [[ -v MAIN_JOB_STEPS ]] && echo "$budget" || echo "$1"; }
caches() {  # bin/extract.py --jit-cache's default folder first, then the libraries' own defaults
  jit=${XDG_CACHE_HOME:-$HOME/.cache}/offline_extract
  for d in $jit/tvm-ffi $jit/triton $jit/torchinductor $jit/flashinfer \
           ~/.cache/tvm-ffi ~/.triton/cache ~/.cache/flashinfer ~/.cache/torch/inductor /tmp/torchinductor_$(whoami); do
    echo "$1 $d: $(find "$d" -type f 2>/dev/null | wc -l) files, $(du -sb "$d" 2>/dev/null | cut -f1) bytes"
  done >>"$results/caches.txt"
  ls $jit/tvm-ffi ~/.cache/tvm-ffi 2>/dev/null | sed "s/^/$1 tvm-ffi: /" >>"$results/caches.txt"
}

extract="bin/extract.py --model $model --data $work/corpus.jsonl --verify 8 --no-progress --progress-every 5 ${MAIN_JOB_EXTRACT_ARGS:-}"
for name in $steps; do
  case $name in
    model) logged model "$(limit 120)" "bash benchmarks/make_8b_model.sh $model" ;;
    corpus) logged corpus "$(limit 120)" "python benchmarks/main_job.py corpus $model $work/corpus.jsonl --num-tokens $tokens" ;;
    extract_cold)
      caches before
      if [[ ${MAIN_JOB_STACKS:-0} == 1 ]]; then
        logged extract_cold "$(limit 300)" "OE_STACKS=$results/stacks_cold.txt python benchmarks/main_job.py stacks $extract --out $work/out"
      else
        logged extract_cold "$(limit 300)" "python $extract --out $work/out"
      fi
      caches after ;;
    inspect_verify) logged inspect_verify "$(limit 120)" "python bin/inspect.py $work/out --verify" ;;
    extract_warm)  # into a fresh folder, the first output gone to make room
      rm -rf "$work/out"
      logged extract_warm "$(limit 240)" "python $extract --out $work/out_warm"
      rm -rf "$work/out_warm" ;;
    bench)
      logged bench "$(limit 240)" "python bin/bench.py --model $model --load-format auto --num-tokens 300000 --out $work/bench --disk-probe-gb 1 --results-dir $results ${MAIN_JOB_BENCH_ARGS:-}"
      rm -rf "$work/bench" ;;
  esac
done
[[ -v MAIN_JOB_STEPS ]] || rm -rf "$work"
