#!/usr/bin/env bash
# Checks that the C++ lines changed by the commits being checked follow .clang-format: runs
# git-clang-format (Debian's clang-format-14) on the lines that differ between a base commit
# and HEAD, in the files ending in .h, .hpp, .cpp or .cc, and nothing else (the existing code is
# not reformatted in bulk). Prints clang-format's diff and exits 1 when a changed line is not
# formatted, with the command that formats them; exits 0 otherwise (2 for an unknown base).
# Uncommitted changes are not checked.
# Fix what it reports with: git clang-format-14 --binary clang-format-14 --extensions h,hpp,cpp,cc
# <base> (it formats the lines changed since <base> in the working tree), then commit.
# Environment: FORMAT_BASE (default HEAD~1, the previous commit: only the last commit is
# checked; e.g. FORMAT_BASE=main checks every commit of a branch since it left main, as the
# check starts from the commit HEAD and FORMAT_BASE have in common). Without a parent commit
# (and no FORMAT_BASE) there is nothing to check.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh format

base="${FORMAT_BASE:-}"
if [ -z "$base" ]; then
  if ! git rev-parse -q --verify 'HEAD~1^{commit}' >/dev/null; then
    echo "format check: HEAD has no parent commit, nothing to check (set FORMAT_BASE to check from a commit)"
    exit 0
  fi
  base=HEAD~1
fi
git rev-parse -q --verify "$base^{commit}" >/dev/null || { echo "format check: unknown base commit '$base'" >&2; exit 2; }
# From the fork point, so that a base on another branch checks only this branch's commits.
fork=$(git merge-base "$base" HEAD) || { echo "format check: '$base' and HEAD have no common commit" >&2; exit 2; }
commits=$(git rev-list --count "$fork..HEAD")
echo "format check: C++ lines changed by $commits commit(s) since $base ($(git rev-parse --short "$fork"))"
[ "$commits" -eq 0 ] && { echo "format check: no commit to check"; exit 0; }

# git-clang-format prints a diff when changed lines need formatting (version 14's exit code
# does not tell; newer releases exit 1), else nothing or a line saying there was nothing to do.
status=0
out=$(git clang-format-14 --binary clang-format-14 --style file --extensions h,hpp,cpp,cc \
        --diff "$fork" HEAD) || status=$?
[ "$status" -le 1 ] || { printf '%s\n' "$out" >&2; echo "format check: git clang-format-14 failed" >&2; exit 2; }
if grep -q '^diff --git' <<<"$out"; then
  printf '%s\n' "$out"
  echo "format check: FAILED, the changed lines above are not formatted as .clang-format says;" \
       "fix them with: git clang-format-14 --binary clang-format-14 --extensions h,hpp,cpp,cc $base (then commit)" >&2
  exit 1
fi
echo "format check: passed"
