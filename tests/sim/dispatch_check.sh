#!/usr/bin/env bash
# dispatch_check.sh CXX SRCDIR FLAGS...: every dispatch over the CP methods is exhaustive (issue #41).
# Each source under SRCDIR/src that switches over CpMethodId must compile as it is (the control)
# and must NOT compile once cp/cp_methods.hpp grows one more id (DIFFCP_TEST_UNHANDLED_CP_METHOD):
# the compiler names the unhandled enumerator (-Werror=switch), so a new method cannot be
# simulated as another by a fallthrough.
set -uo pipefail
export LC_ALL=C
cxx=${1:?usage: dispatch_check.sh CXX SRCDIR FLAGS...}
src=${2:?}
shift 2
flags=(-std=c++20 -fsyntax-only -Wall -Werror=switch -fopenmp "$@")
mapfile -t files < <(grep -rl --include='*.cpp' 'switch (.*id)' "$src/src" | xargs grep -l 'CpMethodId::' | sort)
[ "${#files[@]}" -gt 0 ] || { echo "dispatch_check: FAILED: no switch over CpMethodId found under $src/src"; exit 1; }
for f in "${files[@]}"; do
  if ! out=$("$cxx" "${flags[@]}" "$f" 2>&1); then
    printf '%s\n' "$out" | head -20
    echo "dispatch_check: FAILED: $f does not compile as it is (the control)"; exit 1
  fi
  if out=$("$cxx" "${flags[@]}" -DDIFFCP_TEST_UNHANDLED_CP_METHOD "$f" 2>&1); then
    echo "dispatch_check: FAILED: $f compiles with an unhandled CpMethodId (a switch with a default, or an if chain?)"; exit 1
  fi
  # Every switch over a CpMethodId must name it (one error each): a switch with a default would not.
  switches=$(grep -cE 'switch \((desc\.)?id\)' "$f")
  errors=$(printf '%s\n' "$out" | grep -cE "enumeration value .unhandled_for_test. not handled in switch")
  if [ "$errors" -eq 0 ] || [ "$errors" -ne "$switches" ]; then
    printf '%s\n' "$out" | head -20
    echo "dispatch_check: FAILED: $f has $switches switches over CpMethodId, $errors name the unhandled method"; exit 1
  fi
  echo "dispatch_check: $f: all $switches switches name the extra method as unhandled"
done
echo "dispatch_check: passed (${#files[@]} file(s))"
