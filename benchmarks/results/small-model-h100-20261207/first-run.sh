#!/usr/bin/env bash
# The small model's first run on a fresh machine, against the next (issue 57, item 4):
#   SMOL=MODEL_DIR [SMOL_LOAD_FORMAT=dummy] [OLD=CHECKOUT] BUDGET=SECONDS bash first-run.sh RESULTS_DIR RUN...
# RUN first: bin/extract.py on 1,500 records of real English, on an empty --jit-cache, every thread's stack
#     dumped each second (benchmarks/main_job.py stacks);
#     next: the same, on the cache the first run filled;
#     old: OLD's bin/extract.py (the code before the RMSNorms' prebuild) as the first run, on an empty
#     --jit-cache of its own, after the compilers' default caches outside --jit-cache are emptied.
# Each run's manifest goes to RESULTS_DIR/manifest_RUN.json, its stacks to stacks_RUN.txt; the caches' sizes
# after each run to caches.txt, the environment to env.txt, the path FlashInfer's RMSNorm took to norm-path.txt;
# each step's command, exit status and seconds to steps.jsonl.
source "$(dirname "$0")/../../steps.sh"
begin "${1:?RESULTS_DIR}" "${BUDGET:-300}"
shift
work=/dev/shm/offline_extract_classes
mkdir -p "$work"
user=${USER:-$(id -un)}
# The compilers' caches are the runs' own (--jit-cache), not whatever the environment names.
unset TVM_FFI_CACHE_DIR TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR FLASHINFER_WORKSPACE_BASE SGLANG_DG_CACHE_DIR CUTE_DSL_CACHE_DIR
env | sort >"$results/env.txt"
outside=("$HOME/.nv" "$HOME/.triton" "$HOME/.cache/flashinfer" "$HOME/.cache/tvm-ffi" "/tmp/torchinductor_$user"
  "/tmp/$user/cutlass_python_cache")
sizes() { { echo "== after $1"; du -s "${outside[@]}" "$work"/jit_* 2>/dev/null; } >>"$results/caches.txt"; }
[[ -f $work/english_first.jsonl ]] || python3 benchmarks/main_job.py docstrings "$work/english_first.jsonl" --records 1500
sizes start

extract() {  # extract RUN CODE_ROOT JIT_CACHE
  step "extract_$1" 200 "OE_STACKS=$results/stacks_$1.txt OE_STACKS_EVERY=1 python3 benchmarks/main_job.py stacks \
    $2/bin/extract.py --model $SMOL --load-format ${SMOL_LOAD_FORMAT:-auto} --data $work/english_first.jsonl --out /dev/shm/offline_extract_first_$1 \
    --jit-cache $3 --no-progress --progress-every 2 && \
    $keep_run /dev/shm/offline_extract_first_$1/manifest.json $results/manifest_$1.json; rc=\$?; \
    rm -rf /dev/shm/offline_extract_first_$1; exit \$rc"
  sizes "$1"
}

norm_path() {  # which of its two RMSNorm paths FlashInfer took: the first run's cache folders
  python3 -c 'import importlib.util, flashinfer
print("flashinfer", flashinfer.__version__, "| nvidia-cutlass-dsl installed:", importlib.util.find_spec("cutlass") is not None)'
  find "$work/jit_first" -maxdepth 1
  find "$work/jit_first/cute-dsl" "$work/jit_first/flashinfer" 2>/dev/null | head -60
}

for run in "$@"; do
  case $run in
    first) rm -rf "$work/jit_first"; extract first . "$work/jit_first"; norm_path >"$results/norm-path.txt" 2>&1 ;;
    next) extract next . "$work/jit_first" ;;
    old) rm -rf "${outside[@]}" "$work/jit_old"; extract old "${OLD:?the checkout of the old code}" "$work/jit_old" ;;
    *) echo "unknown run $run: first, next or old" >&2; exit 2 ;;
  esac
done

