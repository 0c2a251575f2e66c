# Sourced by the bundle scripts (make_sglang_bundle.sh, peers/make_peer_bundle.sh).

# pack_parts OUT LIMIT: reads "BYTES PATH" lines and copies each file, largest first, into the first of OUT/1,
# OUT/2, ... with room for it under LIMIT bytes; sets `parts` to how many it filled.
pack_parts() {
  local out=$1 limit=$2 bytes path placed i
  local -a size=()
  while read -r bytes path; do
    placed=
    for ((i = 1; i <= ${#size[@]}; i++)); do
      if ((size[i - 1] + bytes <= limit)); then size[i - 1]=$((size[i - 1] + bytes)); placed=$i; break; fi
    done
    [[ -n $placed ]] || { size+=("$bytes"); placed=${#size[@]}; }
    mkdir -p "$out/$placed"; cp "$path" "$out/$placed/"
  done < <(sort -rn)
  parts=${#size[@]}
}
