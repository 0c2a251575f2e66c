#!/usr/bin/env bash
# Builds the peer bundle at the root of the current git checkout, for `bin/bench.py --baseline specforge`:
#   .peer-bundle/1..N/   SGLang 0.5.14, SpecForge 0.2.0 and what they pin differently from SGLang 0.5.17
#                        (specforge-0.2.0-bundle.txt), in parts of at most 56 MiB, to carry one at a time;
#   .peer-bundle/specforge/  SpecForge's scripts/prepare_hidden_states.py and a draft config, taken from its
#                        repository mirror (fetched code: git-ignored, never committed; carried by the run).
# On the GPU machine the last part installs into /tmp/peer-site, layered over the SGLang 0.5.17 site at
# /tmp/sglang-site, which must be installed first (FlashAttention-3's kernel library is taken from it, see
# below). How to run the peers then: benchmarks/peers/README.md.
#
#   benchmarks/peers/make_peer_bundle.sh [SPECFORGE_GIT_DIR [COMMIT]]
#
# SPECFORGE_GIT_DIR: a clone or mirror of sgl-project/SpecForge (default: the fetch tool's mirror).
# COMMIT: default a6b6b02, the last commit of its main branch before the 0.2.0 wheel was built; its
# specforge/offline_capture/ is byte-identical to the wheel's (version.txt reads 0.2.0 from 73e6f80 on).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git rev-parse --show-toplevel)
mirror=${1:-/work/.mirror/sgl-project+SpecForge/repo}
commit=${2:-a6b6b0230009d15ec2a97a57384e6f53f0f96946}
out=$root/.peer-bundle
cache=${PEER_BUNDLE_CACHE:-$HOME/.cache/peer-bundle}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" "$cache/wheels"
grep -qx '/.peer-bundle/' "$exclude" 2>/dev/null || echo '/.peer-bundle/' >>"$exclude"

platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 --platform any)
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$1" "${@:2}"
}
wanted=$(grep -vE '^\s*(#|$)' "$here/specforge-0.2.0-bundle.txt")
missing=()
for spec in $wanted; do
  name=${spec%%==*}; ver=${spec##*==}; stem=$(echo "$name" | tr 'A-Z-' 'a-z_')
  ls "$cache/wheels" | tr 'A-Z' 'a-z' | grep -q "^${stem}-${ver}-" || missing+=("$spec")
done
((${#missing[@]} == 0)) || { echo "downloading ${missing[*]}"; download "$cache/wheels" "${missing[@]}"; }

# sglang-kernel 0.4.4, as SGLang 0.5.14 pins it, for Hopper (sm90) only and without its FlashAttention-3
# library (1.7 GB, too large to carry). The last part links in the 0.5.17 site's FA3 library
# (sglang-kernel 0.4.5): the Python wrapper that calls it, sgl_kernel/flash_attn.py, is byte-identical in
# 0.4.4 and 0.4.5. That library is the one piece of SpecForge's stack not at its pinned version.
kernel=$cache/sgl_kernel_0.4.4_sm90_no_fa3.tar.xz
if [[ ! -s $kernel ]]; then
  tmp=$(mktemp -d)
  download "$tmp" sglang-kernel==0.4.4
  (cd "$tmp" && python3 -m zipfile -e sglang_kernel-*.whl x && cd x &&
    tar -cJf "$kernel.part" --exclude='sgl_kernel/flash_ops.abi3.so' --exclude='sgl_kernel/sm100' \
      --exclude='sgl_kernel/infllm_ops*' sgl_kernel triton_kernels sglang_kernel-*.dist-info)
  mv "$kernel.part" "$kernel"; rm -rf "$tmp"
fi

# SpecForge's generator and the draft config it needs, from its repository at $commit.
rm -rf "$out"; mkdir -p "$out/specforge/scripts" "$out/specforge/configs"
git --git-dir="$mirror" cat-file -e "$commit^{commit}"
git --git-dir="$mirror" show "$commit:scripts/prepare_hidden_states.py" >"$out/specforge/scripts/prepare_hidden_states.py"
git --git-dir="$mirror" show "$commit:configs/llama3-8B-eagle3.json" >"$out/specforge/configs/llama3-8B-eagle3.json"
echo "sgl-project/SpecForge $commit ($(git --git-dir="$mirror" show -s --format=%ci "$commit")), version.txt $(git --git-dir="$mirror" show "$commit:version.txt")" >"$out/specforge/SOURCE"

# Parts of at most 56 MiB, largest files first.
files=$( (for spec in $wanted; do
  name=${spec%%==*}; ver=${spec##*==}; stem=$(echo "$name" | tr 'A-Z-' 'a-z_')
  ls "$cache"/wheels/*.whl | grep -i "/${stem}-${ver}-"
done; echo "$kernel") | xargs -I{} stat -c '%s {}' {})
source "$here/../pack_parts.sh"
pack_parts "$out" $((56 * 1024 * 1024)) <<<"$files"
for ((i = 1; i <= parts; i++)); do
  cat >"$out/$i/stage.sh" <<STAGE
#!/usr/bin/env bash
# Peer bundle part $i of $parts: keeps this part on the GPU machine; the last one to arrive installs them all
# into /tmp/peer-site (SGLang 0.5.14 + SpecForge 0.2.0), over the SGLang 0.5.17 site that must be there.
set -euo pipefail
stage=/tmp/peer-stage; site=/tmp/peer-site; base=/tmp/sglang-site
mkdir -p "\$stage"; cp "\$(dirname "\$0")"/*.whl "\$(dirname "\$0")"/*.tar.xz "\$stage"/ 2>/dev/null || true
touch "\$stage/part-$i"
have=\$(ls "\$stage"/part-* | wc -l)
if ((have < $parts)); then echo "peer bundle: part $i of $parts staged (\$have here); send the next part within 30 s"; exit 0; fi
[[ -f \$base/.ready ]] || { echo "peer bundle: install the SGLang 0.5.17 bundle into \$base first" >&2; exit 1; }
if [[ ! -f \$site/.ready ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "\$site" "\$stage"/*.whl
  tar -xJf "\$stage"/sgl_kernel_0.4.4_sm90_no_fa3.tar.xz -C "\$site"
  ln -sf "\$base/sgl_kernel/flash_ops.abi3.so" "\$site/sgl_kernel/flash_ops.abi3.so"
  printf 'export PYTHONPATH=%s:%s\${PYTHONPATH:+:\$PYTHONPATH}\n' "\$site" "\$base" >"\$site/env.sh"
  touch "\$site/.ready"
fi
PYTHONPATH=\$site:\$base python3 -c "
import importlib.metadata as m, sglang, sgl_kernel, specforge.offline_capture.sglang_backend.capture
print('sglang', sglang.__version__, '+ specforge', m.version('specforge'), '+ sglang-kernel', m.version('sglang-kernel'), 'ready in \$site')"
STAGE
  chmod +x "$out/$i/stage.sh"
done
du -sh "$out"/* | sed "s#$root/##"
echo "$parts parts; after the 0.5.17 bundle, send bash .peer-bundle/1/stage.sh with carry [\".peer-bundle/1\"], then 2, ..."
