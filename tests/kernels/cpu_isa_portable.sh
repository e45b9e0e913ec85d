#!/bin/sh
# The portable build runs on any x86-64 CPU: outside the per-ISA kernels (namespaces
# diffcp::cpu::<isa> but generic, src/cpu/isa.hpp) no function of the given binaries
# has a VEX or EVEX instruction (AVX and later: a mnemonic starting with 'v'). This is also what
# shows that no inline function or template got an AVX copy the linker could pick for baseline code.
# Usage: cpu_isa_portable.sh BINARY...
set -eu
status=0
for bin in "$@"; do
  bad=$(objdump -d --no-show-raw-insn -C "$bin" | awk '
    /^[0-9a-f]+ <.*>:$/ { name = $0; ok = (name ~ /diffcp::cpu::[a-z0-9_]+::/ && name !~ /diffcp::cpu::generic::/); next }
    !ok && name != "" && $2 ~ /^v[a-z0-9]+$/ { bad[name]++ }
    END { for (n in bad) print "  " bad[n] " AVX instructions in " n }')
  kernels=$(objdump -d --no-show-raw-insn -C "$bin" | grep -c '^[0-9a-f]* <.*diffcp::cpu::avx2::' || true)
  if [ -n "$bad" ]; then
    echo "FAIL: $bin has AVX code outside the per-ISA kernels:"
    echo "$bad" | head -20
    status=1
  elif [ "$kernels" -eq 0 ]; then
    echo "FAIL: $bin has no AVX2 kernels (diffcp::cpu::avx2::): not a portable build?"
    status=1
  else
    echo "PASS: $bin: AVX only inside the per-ISA kernels ($kernels AVX2 kernel functions)"
  fi
done
exit $status
