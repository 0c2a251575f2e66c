# Sourced by every work call of this loan (host staging, not project code). RELEASE=0.5.23 picks that site.
site=/tmp/sglang-site; [[ ${RELEASE:-} == 0.5.23 ]] && site=/tmp/sglang-0.5.23-site
source $site/env.sh
export PYTHONPATH=$PYTHONPATH:/tmp/site OFFLINE_EXTRACT_SMOLLM2_GGUF=/tmp/smol/smol.gguf PYTHONUNBUFFERED=1
M=$(python3 -m offline_extract.testing.real_model --print-path 2>>/tmp/smolconv.log)
mkdir -p /tmp/r
pack() { tar czf $OUT/$1.tgz -C /tmp/r $1; }
