#!/usr/bin/env bash
# Builds .sglang-bundle-RELEASE/1..N/ at the root of the current git checkout: a supported SGLang release and all
# that a GPU machine without network needs beyond its own Python 3.12 and torch, in parts of at most 56 MiB, for a
# way in that takes a file or a call of at most 64 MiB at a time (the rest is room for a checkout beside it).
#
#   benchmarks/make_sglang_bundle.sh [RELEASE] [--with-cudnn]
#
# RELEASE: one of engine/sglang_releases.py's SUPPORTED, default the newest. Its wheels are pinned in
# benchmarks/sglang-RELEASE-bundle.txt (SGLang, torch and transformers are read from sglang_releases.py); the list
# says what the machine is taken to have and why each entry travels. Only 0.5.23 has one so far: a bundle for a
# machine whose torch is the one SGLang pins needs no torch, CUDA libraries or triton, and a list of its own.
#
# What travels for 0.5.23, on a machine with torch 2.11.0+cu130 (CUDA 13 libraries as its wheel pins them):
# - torch 2.14.1 (PyPI's Linux x86_64 wheel is the cu130 build) and the triton 3.8 it pins;
# - NCCL 2.30.7: torch 2.14.1 links eleven NCCL functions that 2.28.9 lacks, so it does not import there
#   ("undefined symbol: ncclCommResume", seen on CPU with 2.28.9 preloaded);
# - torchvision 0.29.1, built for torch 2.14.1;
# - SGLang 0.5.23, sglang-kernel 0.4.10 (FlashAttention-3, its default attention on Hopper, included),
#   flashinfer, the CUTLASS DSL and what SGLang's imports load, as the list gives them;
# - with --with-cudnn, cuDNN 9.24 (about 9 more parts). Without it the machine's cuDNN 9.19 serves: torch imports, and
#   refuses the first cuDNN call ("compiled against (9, 24, 0) but found runtime version (9, 19, 0)"). Text
#   models' forwards make none; a vision encoder's convolution does.
# The machine serves the rest of torch 2.14.1's pins: cuda-toolkit 13.0.2 for 13.0.3, cuSPARSELt 0.8.0 for 0.8.1
# (it exports every function torch calls), NVSHMEM 3.4.5, cuda-bindings. torch finds them on sys.path after
# the bundle's own (its libraries' RPATH points into the bundle's site, where only NCCL and cuDNN are).
#
# Wheels over one part are repacked uncompressed and zstd-compressed, then split: that saves 16% on torch's
# wheel, 30% on triton's and half of sglang-kernel's (its FlashAttention-3 library is 1.07 GB), where zstd on
# the wheels as they are saves 8% and 1%: 23 parts, 1237 MiB, in 2 minutes on 2 cores with the downloads cached.
# The contents stay byte-identical (checked here, member by member against the original's CRCs), and each part
# lists the SHA-256 of every wheel as installed, which the machine checks after joining them. Downloads (about
# 1.8 GB) are cached in $SGLANG_BUNDLE_CACHE, default ~/.cache/sglang-bundle/RELEASE.
#
# On the machine, each part's stage.sh keeps the part; the one that finds all N installs them with pip --target
# into /tmp/sglang-RELEASE-site ($SGLANG_BUNDLE_SITE), leaving the machine's own torch as it is, writes env.sh
# there (PYTHONPATH with the site first) and prints the SGLang and torch it imports. benchmarks/README.md gives
# the commands.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git rev-parse --show-toplevel)
release= with_cudnn=
for arg in "$@"; do
  case $arg in
    --with-cudnn) with_cudnn=1 ;;
    -*) echo "unknown option $arg; usage: $0 [RELEASE] [--with-cudnn]" >&2; exit 2 ;;
    *) release=$arg ;;
  esac
done
versions=$(python3 - "$root/offline_extract/engine/sglang_releases.py" "$release" <<'PY'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("sglang_releases", sys.argv[1])
releases = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = releases
spec.loader.exec_module(releases)
version = sys.argv[2] or releases.SUPPORTED[-1]
if version not in releases.SUPPORTED:
    sys.exit(f"SGLang {version} is not supported; give one of {' '.join(releases.SUPPORTED)}")
print(version, releases.RELEASES[version].torch, releases.RELEASES[version].transformers)
PY
)
read -r release torch transformers <<<"$versions"
list=$here/sglang-$release-bundle.txt
[[ -f $list ]] || { echo "no wheel list for SGLang $release: write $list (see sglang-0.5.23-bundle.txt)" >&2; exit 1; }
out=$root/.sglang-bundle-$release
cache=${SGLANG_BUNDLE_CACHE:-$HOME/.cache/sglang-bundle/$release}
python=3.12
mkdir -p "$cache/wheels" "$cache/packed"

# Entries tagged --with-cudnn travel only with that option.
specs=("sglang==$release" "torch==$torch" "transformers==$transformers")
while read -r spec tag; do
  [[ -z $tag || -n $with_cudnn ]] && specs+=("$spec")
done < <(grep -vE '^\s*(#|$)' "$list")
platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 --platform any)
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
wheel_of() {  # the cached wheel of NAME==VERSION, if any
  local name=${1%%==*} version=${1##*==}
  ls "$cache/wheels" | grep -i "^$(echo "$name" | tr 'A-Z-' 'a-z_')-${version}-" || true
}
missing=()
for spec in "${specs[@]}"; do [[ -n $(wheel_of "$spec") ]] || missing+=("$spec"); done
if ((${#missing[@]})); then
  echo "downloading ${#missing[@]} wheels"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
    "${platforms[@]}" -d "$cache/wheels" "${missing[@]}"
fi

# A wheel over one chunk travels as its members stored uncompressed, zstd-compressed, in chunks. --long=27: the
# largest window that a decoder takes without being told.
chunk=$((55 * 1024 * 1024)) limit=$((56 * 1024 * 1024 - 64 * 1024))
rm -rf "$out"; mkdir -p "$out"
items=() sums=()
for spec in "${specs[@]}"; do
  wheel=$(wheel_of "$spec")
  if (($(stat -c %s "$cache/wheels/$wheel") <= chunk)); then
    items+=("$cache/wheels/$wheel"); sums+=("$(cd "$cache/wheels" && sha256sum "$wheel")"); continue
  fi
  packed=$cache/packed/$wheel
  if [[ ! -s $packed.zst ]]; then
    echo "repacking $wheel"
    python3 - "$cache/wheels/$wheel" "$packed" <<'PY'
import sys, zipfile
source, target = sys.argv[1:]
with zipfile.ZipFile(source) as whl, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as stored:
    for info in whl.infolist():
        member = zipfile.ZipInfo(info.filename, info.date_time)
        member.external_attr = info.external_attr
        stored.writestr(member, whl.read(info))  # read() checks the original's CRC
with zipfile.ZipFile(source) as whl, zipfile.ZipFile(target) as stored:
    assert [(i.filename, i.CRC, i.file_size) for i in whl.infolist()] == [
        (i.filename, i.CRC, i.file_size) for i in stored.infolist()
    ], f"{target} does not hold what {source} holds"
PY
    zstd -q -9 --long=27 -T0 --rm -o "$packed.zst.part" "$packed" && mv "$packed.zst.part" "$packed.zst"
  fi
  sums+=("$(zstd -dc --long=27 "$packed.zst" | sha256sum | sed "s/-\$/$wheel/")")
  rm -f "$packed.zst".[0-9]*
  split -b "$chunk" -d -a 2 "$packed.zst" "$packed.zst."
  items+=("$packed.zst".[0-9]*)
done

source "$here/pack_parts.sh"
pack_parts "$out" "$limit" < <(stat -c '%s %n' "${items[@]}")
for ((i = 1; i <= parts; i++)); do
  printf '%s\n' "${sums[@]}" >"$out/$i/SHA256SUMS"
  cat >"$out/$i/stage.sh" <<STAGE
#!/usr/bin/env bash
# SGLang $release bundle, part $i of $parts: keeps this part on the machine; the part that finds all $parts
# joins and checks the wheels and installs them into the site, beside the machine's own packages.
set -euo pipefail
stage=\${SGLANG_BUNDLE_STAGE:-/tmp/sglang-$release-stage} site=\${SGLANG_BUNDLE_SITE:-/tmp/sglang-$release-site}
mkdir -p "\$stage"; cp "\$(dirname "\$0")"/* "\$stage"/; touch "\$stage/.part-$i"
have=\$(ls "\$stage"/.part-* | wc -l)
if ((have < $parts)); then echo "SGLang $release bundle: part $i of $parts staged (\$have here)"; exit 0; fi
if [[ ! -f \$site/.ready ]]; then
  cd "\$stage"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target zstd zstandard-*.whl
  for first in *.zst.00; do
    cat "\${first%.00}".[0-9]* | PYTHONPATH=zstd python3 -c "import sys, zstandard
zstandard.ZstdDecompressor().copy_stream(sys.stdin.buffer, sys.stdout.buffer)" >"\${first%.zst.00}"
  done
  sha256sum -c --quiet SHA256SUMS
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "\$site" \
    \$(awk '{print \$2}' SHA256SUMS)
  # PYTHONPATH reads no .pth file (the CUTLASS DSL's adds its packages' folder): env.sh adds what they add.
  added=\$(python3 -c "import site, sys
before = set(sys.path); site.addsitedir(sys.argv[1])
print(':'.join(p for p in sys.path if p not in before and p != sys.argv[1]))" "\$site")
  printf 'export PYTHONPATH=%s\${PYTHONPATH:+:\$PYTHONPATH}\n' "\$site\${added:+:\$added}" >"\$site/env.sh"
  touch "\$site/.ready"
fi
source "\$site/env.sh"
python3 -c "import sglang, torch
print('sglang', sglang.__version__, 'torch', torch.__version__, 'ready: source \$site/env.sh')"
STAGE
  chmod +x "$out/$i/stage.sh"
done

# Each wheel as the machine will join it, from the parts: the SHA-256 it will check.
for line in "${sums[@]}"; do
  wheel=${line##* }
  if compgen -G "$out/*/$wheel.zst.00" >/dev/null; then
    got=$(for f in "$out"/*/"$wheel".zst.[0-9]*; do echo "${f##*.} $f"; done | sort | cut -d' ' -f2 |
      xargs cat | zstd -dc --long=27 | sha256sum)
  else
    got=$(cat "$out"/*/"$wheel" | sha256sum)
  fi
  [[ ${got%% *} == "${line%% *}" ]] || { echo "$wheel: the parts do not join back to it" >&2; exit 1; }
done
du -sh "$out"/* | sed "s#$root/##"
echo "$parts parts, $(du -sm "$out" | cut -f1) MiB; there: bash .sglang-bundle-$release/N/stage.sh, N = 1 to $parts"
