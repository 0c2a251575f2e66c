# Sourced by every work call of this loan (host staging, not project code).
source /tmp/sglang-site/env.sh
export PYTHONPATH=$PYTHONPATH:/tmp/site OFFLINE_EXTRACT_SMOLLM2_GGUF=/tmp/smol/smol.gguf PYTHONUNBUFFERED=1
mkdir -p /tmp/dd /tmp/bg && cp -rn .drafter/. /tmp/dd/
M=$(python3 -m offline_extract.testing.real_model --print-path 2>>/tmp/smolconv.log)
P="python3 benchmarks/drafter/pipeline.py --data /tmp/dd --model $M"
bg() { local name=$1; shift; rm -f /tmp/bg/$name.rc; setsid nohup bash -c "$*; echo \$? > /tmp/bg/$name.rc" > /tmp/bg/$name.log 2>&1 < /dev/null & echo "bg $name started"; }
waitbg() { for n in "$@"; do while [ ! -f /tmp/bg/$n.rc ]; do sleep 3; done; echo "== $n rc=$(cat /tmp/bg/$n.rc) at $(date +%T)"; tail -n 4 /tmp/bg/$n.log; done; }
mon() { nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader; free -g | sed -n 2p; df -h /tmp /dev/shm | tail -2; }
out() { $P pack $OUT >/dev/null; tar czf $OUT/bg.tgz -C /tmp bg; cp /tmp/dd/compare_*.json $OUT/ 2>/dev/null; true; }
