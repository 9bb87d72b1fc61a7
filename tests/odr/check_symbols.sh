#!/usr/bin/env bash
# Checks with `nm -C` that test_odr holds gattn's SIMD code twice, once per instruction set:
# symbols in gattn::isa_sse2:: (baseline unit) and gattn::isa_avx2_fma:: (-mavx2 -mfma unit),
# including scaled_dot_product_attention<float> in both. Then lists, for information, the
# functions that the two units define under the same name but compiled differently: the linker
# keeps one copy of each for both units (the ODR hazard that gattn's namespace does not cover).
# Usage: check_symbols.sh <test_odr binary> <baseline object> <avx2 object>
set -euo pipefail
binary="$1"
# CMake passes $<TARGET_OBJECTS:...> lists; accept them space- or semicolon-separated.
objects=$(echo "${*:2}" | tr ';' ' ')
read -r obj_base obj_avx2 _ <<<"$objects"

symbols=$(nm -C "$binary")
fail=0
for ns in isa_sse2 isa_avx2_fma; do
  count=$(grep -c "gattn::$ns::" <<<"$symbols" || true)
  sdpa=$(grep -c "gattn::$ns::scaled_dot_product_attention<float>" <<<"$symbols" || true)
  echo "gattn::$ns:: symbols: $count (scaled_dot_product_attention<float>: $sdpa)"
  if [ "$count" -eq 0 ] || [ "$sdpa" -eq 0 ]; then
    echo "FAIL: no gattn::$ns:: copy of the SIMD code in $binary" >&2
    fail=1
  fi
done
[ "$fail" -eq 0 ] || exit 1

# Functions defined (weak or global) in both units, compared by their instruction sequence
# (each object is disassembled once: one line "<mangled name> <mnemonics...>" per function).
[ -n "${obj_base:-}" ] && [ -n "${obj_avx2:-}" ] || exit 0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for obj in "$obj_base" "$obj_avx2"; do
  key=$([ "$obj" = "$obj_base" ] && echo base || echo avx2)
  nm "$obj" | awk '$2 ~ /^[TW]$/ {print $3}' | sort -u >"$work/$key.defined"
  objdump -d --no-show-raw-insn "$obj" | awk '
    /^[0-9a-f]+ <.*>:$/ { if (name != "") print name seq; name = substr($2, 2, length($2) - 3); seq = ""; next }
    /^ +[0-9a-f]+:\t/ { split($0, f, "\t"); split(f[2], w, " "); seq = seq " " w[1] }
    END { if (name != "") print name seq }' | sort -k1,1 >"$work/$key.code"
done
comm -12 "$work/base.defined" "$work/avx2.defined" >"$work/shared"
join "$work/shared" "$work/base.code" >"$work/shared.base" || true
join "$work/shared" "$work/avx2.code" >"$work/shared.avx2" || true
# Lines: "<tag> <mangled name>" for each shared function whose code differs.
join -j1 <(awk '{n = $1; $1 = ""; print n "\t" $0}' "$work/shared.base" | sort -t$'\t' -k1,1) \
         <(awk '{n = $1; $1 = ""; print n "\t" $0}' "$work/shared.avx2" | sort -t$'\t' -k1,1) -t$'\t' |
  awk -F'\t' '$2 != $3 { print ($3 ~ / v[a-z]/ ? "AVX" : "different"), $1 }' >"$work/differ"
shared=$(wc -l <"$work/shared")
differ=$(wc -l <"$work/differ")
vex=$(grep -c '^AVX ' "$work/differ" || true)
echo "functions defined in both units under one name: $shared; compiled differently: $differ" \
     "(with AVX instructions in the avx2 unit: $vex); the linker keeps one copy of each:"
while read -r tag sym; do
  label=$([ "$tag" = AVX ] && echo "AVX code in the avx2 unit" || echo "different code")
  echo "  [$label] $(c++filt "$sym" | cut -c1-160)"
done <"$work/differ"
