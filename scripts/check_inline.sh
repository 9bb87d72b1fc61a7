#!/usr/bin/env bash
# Checks that every function defined in include/ can be included by many translation units:
# each must be inline, constexpr, a template (not a full specialisation), or a member function
# defined in its class. Three steps:
#  1. self-test: the scanner (scripts/check_inline.pl) must flag each bad definition of a
#     sample header and nothing else;
#  2. scan: scripts/check_inline.pl over every header in include/, listing each offender;
#  3. link: two translation units that both include every header are compiled and linked into
#     one program, so any non-inline definition (function or variable) fails with "multiple
#     definition". Needs nlohmann_json for gattn/io/* and MPI (Open MPI) for gattn/dist/*.
# Environment: CXX (default g++), CXXFLAGS (extra flags for step 3).
set -euo pipefail
cd "$(dirname "$0")/.."

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== inline check 1/3: scanner self-test"
cat >"$work/sample.hpp" <<'SAMPLE'
#pragma once
#include <vector>
#define SAMPLE_MACRO(x) \
    void not_code_##x() {}
namespace sample {
void plain() {}                                   // BAD
inline void fine_inline() {}
template <class T> void fine_template(T) {}
template <> void fine_template<int>(int) {}       // BAD full specialisation
constexpr int fine_constexpr() { return 1; }
static void internal_linkage() {}                 // BAD
namespace { inline void unnamed() {} }            // BAD
struct S {
    S() : x(1) {}
    void fine_member() const noexcept { /* } */ }
    void declared();
    int x;
};
void S::declared() {}                             // BAD out of class
struct T { T(); T(int); int a, b; };
T::T() : a{1}, b(2) {}                            // BAD out of class
inline T::T(int x) : a{x}, b{x + 1} {}
int defaults(int a = 3,                           // BAD
             std::vector<int> v = {}) noexcept {
    return a + static_cast<int>(v.size());
}
bool operator==(const S&, const S&) { return true; }  // BAD
auto trailing() -> int { return 0; }              // BAD
inline const auto fine_lambda = [](int x) { return x + 1; };
inline void fine_braces() { const char* s = "{"; (void)s; if (true) { } }
GATTN_BEGIN_ISA_NAMESPACE
template <class T> inline T fine_isa(T t) { return t; }
void isa_plain() {}                               // BAD
GATTN_END_ISA_NAMESPACE
}  // namespace sample
SAMPLE
want=$(grep -n '// BAD' "$work/sample.hpp" | cut -d: -f1 | tr '\n' ' ')
got=$(perl scripts/check_inline.pl "$work/sample.hpp" | sed -n 's/^[^:]*:\([0-9]*\): .*/\1/p' | tr '\n' ' ' || true)
if [ "$want" != "$got" ]; then
  echo "FAIL: the scanner flagged lines [$got] of the sample header, expected [$want]" >&2
  perl scripts/check_inline.pl "$work/sample.hpp" >&2 || true
  exit 1
fi
echo "flagged the $(wc -w <<<"$want") bad definitions of the sample header and nothing else"

echo "== inline check 2/3: scan of include/"
mapfile -t headers < <(find include -name '*.hpp' -o -name '*.h' | sort)
perl scripts/check_inline.pl "${headers[@]}"

echo "== inline check 3/3: two translation units including every header, linked together"
# gattn/dist includes <mpi.h>: Open MPI's headers and library come in for it.
scripts/deps.sh library openmpi-bin libopenmpi-dev >/dev/null
cxx="${CXX:-g++}"
eigen=$(pkg-config --cflags eigen3 2>/dev/null || echo "-I/usr/include/eigen3")
mpi_compile=$(mpicxx --showme:compile | sed 's/-I/-isystem /g')  # MPI's own warnings are not gattn's
mpi_link=$(mpicxx --showme:link)
{
  for h in "${headers[@]}"; do echo "#include \"${h#include/}\""; done
  echo 'int unit_a() { return 1; }'
} >"$work/a.cpp"
{
  for h in "${headers[@]}"; do echo "#include \"${h#include/}\""; done
  echo 'int unit_a();'
  echo 'int main() { return unit_a() == 1 ? 0 : 1; }'
} >"$work/b.cpp"
flags=(-std=c++17 -O0 -Wall -Wextra -Werror -Iinclude $eigen $mpi_compile ${CXXFLAGS:-})
"$cxx" "${flags[@]}" -c "$work/a.cpp" -o "$work/a.o" &
"$cxx" "${flags[@]}" -c "$work/b.cpp" -o "$work/b.o" &
wait -n && wait -n
if ! "$cxx" "$work/a.o" "$work/b.o" -o "$work/all_headers" $mpi_link 2>"$work/link.log"; then
  grep -E "multiple definition|error" "$work/link.log" | c++filt | head -20 >&2
  echo "FAIL: a header defines something that is not inline (see the multiple definitions above)" >&2
  exit 1
fi
"$work/all_headers"
echo "${#headers[@]} headers included by two linked translation units ($cxx): no multiple definition"
