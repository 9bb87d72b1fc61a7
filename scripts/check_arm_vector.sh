#!/usr/bin/env bash
# Checks that the ARM64 kernels compiled into a test executable are vector code: disassembles
# it (aarch64-linux-gnu-objdump, or $OBJDUMP) and, for each kernel below, counts in the
# functions that hold its loops the vector multiply-adds (FMLA on .4s registers, or for the
# dot-product kernels SDOT or BFDOT into .4s) and, for the narrow caches, the NEON instructions
# that widen them to float. Fails when a kernel's functions are missing or one of its counts is
# 0: a scalar loop (e.g. a type that xsimd or the compiler stopped vectorising) would have none.
# Scalar FMADDs (the kernels' tails) are shown.
# Usage: check_arm_vector.sh <ARM64 test executable holding the kernels, e.g. tests/test_ops>
#   float prefill       flash_step<float>, scores_rows<float, R> and values_rows<float, R>
#   float decode        decode_chunk<float, float> and group_values<float, R, float>
#   bf16/fp16 decode    the same for caches of bf16 (widened by SHLL) and fp16 (by FCVTL)
#   int8 decode         group_values<float, R, int8> (codes widened by SXTL and SCVTF)
#   int8 SDOT logits    decode_sdot::logits<R, …> (ARMv8.2 dot product, chosen at run time)
#   bf16 BFDOT decode   decode_bfdot::logits<R> and values<R> (BF16, chosen at run time)
#   bf16 BFDOT prefill  bf16::scores_tile<R, …> and values_tile<R> (BF16, chosen at run time)
#   bf16 BFDOT linear   PackedLinear's linear_tile<R> and linear_pair<…> (BF16, chosen at run time)
#   float SVE decode    decode_sve::logits<R> and values<R> (SVE, chosen at run time; FMLA on
#                       z registers)
# Functions are matched by name, demangled or (where binutils cannot demangle one) mangled.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 <ARM64 test executable>" >&2; exit 2; }
binary="$1"
objdump="${OBJDUMP:-aarch64-linux-gnu-objdump}"
command -v "$objdump" >/dev/null || { echo "$objdump not found (Debian: binutils-aarch64-linux-gnu)" >&2; exit 2; }

# name | function pattern (extended regular expression) | widening instructions ("" for none)
# [| vector instruction counted on .4s registers, default fmla; "<op>@z" counts it on SVE .s
# registers]
kernels=(
  "float prefill|kernel::(flash_step<float>|scores_rows<float, [0-9]+|values_rows<float, [0-9]+)|"
  "float decode|kernel::decode_chunk<float, float,|group_values(<float, [0-9]+, float>|IfLi[0-9]+EfE)|"
  "bf16 cache decode|kernel::decode_chunk<float, Eigen::bfloat16,|group_values(<float, [0-9]+, Eigen::bfloat16>|IfLi[0-9]+EN5Eigen8bfloat16E)|shll"
  "fp16 cache decode|kernel::decode_chunk<float, Eigen::half,|group_values(<float, [0-9]+, Eigen::half>|IfLi[0-9]+EN5Eigen4halfE)|fcvtl"
  "int8 cache decode|group_values(<float, [0-9]+, signed char>|IfLi[0-9]+EaE)|sxtl scvtf"
  "int8 SDOT logits|decode_sdot::logits<[0-9]+,|11decode_sdot6logitsILi[0-9]+E||sdot"
  "bf16 BFDOT decode|decode_bfdot::(logits|values)<[0-9]+>|12decode_bfdot(6logits|6values)ILi[0-9]+E||bfdot"
  "bf16 BFDOT prefill|bf16::(scores_tile<[0-9]+,|values_tile<[0-9]+>)|4bf16(11scores_tile|11values_tile)ILi[0-9]+E||bfdot"
  "bf16 BFDOT linear|detail::(linear_tile|linear_pair)<[0-9]+|6detail(11linear_tile|11linear_pair)ILi[0-9]+||bfdot"
  "float SVE decode|decode_sve::(logits|values)<[0-9]+>|10decode_sve(6logits|6values)ILi[0-9]+E||fmla@z"
)

listing=$(mktemp)
trap 'rm -f "$listing"' EXIT
"$objdump" -d -C --no-show-raw-insn "$binary" >"$listing"

status=0
printf '%-18s %9s %12s %12s  %s\n' kernel functions "vector op" "scalar FMADD" widening
for entry in "${kernels[@]}"; do
  IFS='|' read -r name _ <<<"$entry"
  op=fmla
  # An entry whose pattern ends in "||<op>" counts <op> instead of FMLA.
  if [[ "$entry" =~ \|\|([a-z@]+)$ ]]; then
    op="${BASH_REMATCH[1]}"
    entry="${entry%|*}"
  fi
  registers='\.4s'
  if [[ "$op" == *@z ]]; then
    op="${op%@z}"
    registers='^z[0-9]+\.s'
  fi
  widen="${entry##*|}"
  pattern="${entry#*|}"
  pattern="${pattern%|*}"
  # Per function whose label matches: FMLA on .4s, scalar FMADD, and each widening mnemonic.
  read -r functions fmla fmadd widen_counts < <(
    awk -v pat="$pattern" -v widen="$widen" -v op="$op" -v regs="$registers" '
      BEGIN { nw = split(widen, w, " "); for (i = 1; i <= nw; ++i) cw[i] = 0 }
      /^[0-9a-f]+ <.*>:$/ { inside = ($0 ~ pat); if (inside) ++functions; next }
      inside && $2 == op && $3 ~ regs { ++fmla }
      inside && $2 == "fmadd" && $3 ~ /^s[0-9]/ { ++fmadd }
      inside { for (i = 1; i <= nw; ++i) if ($2 == w[i] || $2 == w[i] "2") ++cw[i] }
      END {
        s = ""; for (i = 1; i <= nw; ++i) s = s (i > 1 ? "," : "") w[i] "=" cw[i]
        printf "%d %d %d %s\n", functions, fmla, fmadd, (nw ? s : "-")
      }' "$listing")
  printf '%-18s %9d %12s %12d  %s\n' "$name" "$functions" "$op=$fmla" "$fmadd" "$widen_counts"
  if [ "$functions" -eq 0 ]; then
    echo "  no function matches: $pattern" >&2
    status=1
  elif [ "$fmla" -eq 0 ] || [[ "$widen_counts" == *=0* ]]; then
    echo "  $name: no vector code in its functions" >&2
    status=1
  fi
done
[ $status -eq 0 ] && echo "every kernel above is vector code"
exit $status
