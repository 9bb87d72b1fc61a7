#!/usr/bin/env bash
# Checks the ODR safety of test_odr, whose two units include gattn with different -m flags:
#  1. with `nm -C`, that the binary holds gattn's code twice, once per instruction set: symbols in
#     gattn::isa_sse2:: (baseline unit) and gattn::isa_avx2_fma:: (-mavx2 -mfma unit), including
#     scaled_dot_product_attention<float> in both;
#  2. that no function the two units define under one name (the linker keeps one copy for both)
#     and compile differently belongs to gattn: a function of namespace gattn outside the
#     instruction-set namespaces, or any function instantiated for such a gattn type (e.g.
#     std::vector<gattn::X>::push_back). Those fail the check. Eigen's and the standard library's
#     own functions compiled differently are outside gattn's control: they are listed only.
# Functions are compared by their instruction mnemonics (objdump), one object per unit.
# Usage: check_symbols.sh <test_odr binary> <baseline object> <avx2 object>
set -euo pipefail
binary="$1"
# CMake passes $<TARGET_OBJECTS:...> lists; accept them space- or semicolon-separated.
objects=$(echo "${*:2}" | tr ';' ' ')
read -r obj_base obj_avx2 _ <<<"$objects"
if [ -z "${obj_base:-}" ] || [ -z "${obj_avx2:-}" ]; then
  echo "usage: check_symbols.sh <test_odr binary> <baseline object> <avx2 object>" >&2
  exit 2
fi

symbols=$(nm -C "$binary")
fail=0
for ns in isa_sse2 isa_avx2_fma; do
  count=$(grep -c "gattn::$ns::" <<<"$symbols" || true)
  sdpa=$(grep -c "gattn::$ns::scaled_dot_product_attention<float>" <<<"$symbols" || true)
  echo "gattn::$ns:: symbols: $count (scaled_dot_product_attention<float>: $sdpa)"
  if [ "$count" -eq 0 ] || [ "$sdpa" -eq 0 ]; then
    echo "FAIL: no gattn::$ns:: copy of gattn's code in $binary" >&2
    fail=1
  fi
done

# Functions defined (weak or global) in both units, compared by their instruction sequence
# (each object is disassembled once: one line "<mangled name> <mnemonics...>" per function).
# llvm-objdump when there is one: GNU objdump takes seconds on objects with thousands of sections.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
disassembler=$(command -v llvm-objdump || echo objdump)
for key in base avx2; do
  obj=$([ "$key" = base ] && echo "$obj_base" || echo "$obj_avx2")
  nm "$obj" | awk '$2 ~ /^[TW]$/ {print $3}' | sort -u >"$work/$key.defined"
  "$disassembler" -d --no-show-raw-insn "$obj" | awk '
    /^[0-9a-f]+ <.*>:$/ { if (name != "") print name seq; name = substr($2, 2, length($2) - 3); seq = ""; next }
    /^ +[0-9a-f]+: *\t/ { split($0, f, "\t"); split(f[2], w, " "); seq = seq " " w[1] }
    END { if (name != "") print name seq }' | sort -k1,1 >"$work/$key.code" &
done
wait
comm -12 "$work/base.defined" "$work/avx2.defined" >"$work/shared"
join "$work/shared" "$work/base.code" >"$work/shared.base" || true
join "$work/shared" "$work/avx2.code" >"$work/shared.avx2" || true
# "<same|different> <mangled name>" for every shared function.
join -j1 -t$'\t' <(awk '{n = $1; $1 = ""; print n "\t" $0}' "$work/shared.base" | sort -t$'\t' -k1,1) \
                 <(awk '{n = $1; $1 = ""; print n "\t" $0}' "$work/shared.avx2" | sort -t$'\t' -k1,1) |
  awk -F'\t' '{ print ($2 == $3 ? "same" : ($3 ~ / v[a-z]/ ? "avx" : "different")), $1 }' >"$work/compared"

# Classify each shared function (one c++filt call for all names): "gattn" for a function of
# namespace gattn (also a lambda or local class inside one) outside the isa_* namespaces,
# "gattn-type" for another function whose name mentions a gattn entity, "library" otherwise.
cut -d' ' -f2 "$work/compared" | c++filt >"$work/demangled"
paste -d'\t' "$work/compared" "$work/demangled" | awk -F'\t' '
  {
    split($1, f, " "); verdict = f[1]; rest = f[2]; name = $2
    sub(/^_Z/, "", rest)
    while (rest ~ /^(N[VKRO]*|Z)/) sub(/^(N[VKRO]*|Z)/, "", rest)
    if (rest ~ /^5gattn/ && rest !~ /^5gattn[0-9]+isa_/) who = "gattn"
    else if (index(name, "gattn::") > 0) who = "gattn-type"
    else who = "library"
    print verdict "\t" who "\t" substr(name, 1, 180)
  }' >"$work/classified"

label() { [ "$1" = avx ] && echo "AVX code in the avx2 unit" || echo "different code"; }
gattn_same=$(awk -F'\t' '$2 != "library" && $1 == "same"' "$work/classified" | wc -l)
gattn_bad=()
library=()
while IFS=$'\t' read -r verdict who name; do
  [ "$verdict" = same ] && continue
  if [ "$who" = library ]; then
    library+=("[$(label "$verdict")] $name")
  else
    gattn_bad+=("[$(label "$verdict")] $name")
  fi
done <"$work/classified"

shared=$(wc -l <"$work/shared")
echo "functions defined in both units under one name (the linker keeps one copy): $shared"
echo "  of gattn or for gattn types, outside the isa_* namespaces: $((gattn_same + ${#gattn_bad[@]}))," \
     "compiled differently: ${#gattn_bad[@]}"
for f in "${gattn_bad[@]}"; do echo "    FAIL $f"; done
echo "  Eigen's and the standard library's, compiled differently (not gattn's code): ${#library[@]}"
for f in "${library[@]}"; do echo "    $f"; done
if [ "${#gattn_bad[@]}" -gt 0 ]; then
  echo "FAIL: gattn code outside the instruction-set namespaces differs between the units;" \
       "move it into GATTN_BEGIN_ISA_NAMESPACE (gattn/config.hpp)" >&2
  fail=1
fi
exit "$fail"
