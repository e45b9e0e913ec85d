#!/bin/sh
# Every per-ISA kernel file of src/cpu/ (all but dispatch.cpp, compiled once) includes
# isa.hpp, and as its last include: its `#pragma GCC target` must not apply to library or std
# headers, whose inline functions every ISA's copy would then define differently (isa.hpp).
# Usage: cpu_isa_check.sh SRC_CPU_DIR
set -eu
dir=$1
bad=0
for f in "$dir"/*.cpp; do
  case $(basename "$f") in dispatch.cpp) continue ;; esac
  if ! grep -q '^#include "isa.hpp"' "$f"; then
    echo "FAIL: $f does not include isa.hpp (every kernel file is compiled once per ISA)"
    bad=1
    continue
  fi
  after=$(awk '/^#include "isa.hpp"/ {seen = 1; next} seen && /^[ \t]*#[ \t]*include/ {print FILENAME ":" FNR ": " $0}' "$f")
  if [ -n "$after" ]; then
    echo "FAIL: an include after isa.hpp (it must be the last): $after"
    bad=1
  fi
done
[ $bad -eq 0 ] && echo "PASS: every kernel file of $dir includes isa.hpp last"
exit $bad
