# Sourced first by the scripts that run a sequence of steps on a GPU machine (main_job.sh, model_classes.sh) as
# `source "$(dirname "$0")/steps.sh"`: it sets -uo pipefail and moves to the checkout's root, which each of them
# needs for its relative paths, and gives them
#   step NAME LIMIT_SECONDS COMMAND...
# which runs COMMAND under `timeout`, cut to what is left of the script's budget so that a slow step leaves the
# others their time, its output into $logs/NAME.log (a step out of time gets SIGINT first, so that pytest still
# prints the failures it has seen and a bench its partial result, then SIGKILL 15 s later), and appends its
# command, exit status and seconds to $results/steps.jsonl. The caller sets results, budget and start with
# `begin RESULTS_DIR SECONDS`, and logs (default: results); an environment assignment in front of `step` reaches
# the command; CUDA_VISIBLE_DEVICES is recorded too; the command sees its own text as STEP_COMMAND, to keep
# beside what it writes, as `$keep_run MANIFEST RESULT_JSON` in a step's command keeps a run's manifest.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# A run's manifest kept as a result, with the command of the step that made it.
keep_run="python3 -c 'import json, os, sys; m = json.load(open(sys.argv[1])); \
json.dump({\"command\": os.environ[\"STEP_COMMAND\"], **m}, open(sys.argv[2], \"w\"), indent=1)'"

step() {
  local name=$1 limit=$2; shift 2
  local left=$(( budget - ($(date +%s) - start) - 25 ))
  (( limit > left )) && limit=$left
  if (( limit < 30 )); then
    python3 -c 'import json,sys; print(json.dumps({"step": sys.argv[1], "command": sys.argv[2], "rc": None, "seconds": 0, "note": "no time left"}))' \
      "$name" "$*" >>"$results/steps.jsonl"
    return
  fi
  local t0=$(date +%s)
  STEP_COMMAND="$*" PYTHONUNBUFFERED=1 timeout -s INT -k 15 "$limit" bash -c "$*" >"${logs:-$results}/$name.log" 2>&1
  local rc=$?
  python3 -c 'import json,sys; print(json.dumps({"step": sys.argv[1], "command": sys.argv[2], "env": sys.argv[3], "rc": int(sys.argv[4]), "seconds": int(sys.argv[5])}))' \
    "$name" "$*" "${CUDA_VISIBLE_DEVICES:+CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES}" "$rc" "$(( $(date +%s) - t0 ))" >>"$results/steps.jsonl"
}

begin() {  # begin RESULTS_DIR SECONDS: the results folder (made), the script's budget, and its clock started
  results=$(realpath -m "$1") budget=$2 start=$(date +%s)
  mkdir -p "$results"
}
