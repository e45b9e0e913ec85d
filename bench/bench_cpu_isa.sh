#!/bin/sh
# Issue #39: the attention kernels on each ISA of the portable build, against the same-run oneDNN
# f32 GEMM (bench_attention's ratio), rounds interleaved so that a noisy host hits every
# configuration alike; medians per configuration printed by bench/plot_cpu_isa.py.
#   avx512: DIFFCP_CPU_ISA=avx512 (where the CPU has it)
#   avx2:   DIFFCP_CPU_ISA=avx2 and oneDNN capped at AVX2 (DNNL_MAX_CPU_ISA=AVX2): an AVX2-only
#           CPU as far as the software goes (the core stays the host's)
#   old:    $OLD (another build's bench_attention, e.g. a worktree of the previous commit), native
#           and, under oneDNN capped at AVX2, old-avx2 (give OLD_AVX2=<a -mavx2 -mfma build>).
# Workload: issue #39's (2 samples x 4k context, 64 anchors, n_q 8 / n_kv 2), d_h 64 and 128, 2
# threads (OMP_NUM_THREADS unset), in DTYPE (default f32; bf16: the bf16 kernels, their GFLOP/s
# still over the same run's f32 GEMM, which is what a CPU without a bf16 matmul converts to).
# With OLD, even rounds run it before the new build (a host that slows the second run of a pair
# hits both alike).
# Usage: [DTYPE=bf16] bench/bench_cpu_isa.sh [OUT_CSV=bench/cpu_isa.csv] [ROUNDS=5]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/cpu_isa.csv}
rounds=${2:-5}
bench=${BENCH:-$here/../build/release/bench/bench_attention}
dtype=${DTYPE:-f32}
case $dtype in f32|bf16) ;; *) echo "bench_cpu_isa: DTYPE=$dtype, expected f32 or bf16" >&2; exit 2 ;; esac
args="--samples 2 --context 4096 --anchors 64 --n-q 8 --n-kv 2 --reps 5 --dtype $dtype --json"
echo "round,build,isa,d_h,fwd_ms,bwd_ms,gemm_f32_gflops,fwd_over_f32_gemm,bwd_over_f32_gemm,kernels,dtype" > "$out"
row() {  # round build isa d_h json
  printf '%s\n' "$5" | python3 -c "import json,sys; j=json.load(sys.stdin); p='' if '$dtype'=='f32' else 'bf16_'; g=j['gemm_f32_gflops']
print(','.join(str(x) for x in
    ['$1','$2','$3','$4',round(j[p+'fwd_ms'],2),round(j[p+'bwd_ms'],2),round(g,1),
     round(j[p+'fwd_gflops']/g,4),round(j[p+'bwd_gflops']/g,4),'\"'+j.get('kernels','native build')+'\"','$dtype']))" >> "$out"
}
r=1
while [ $r -le "$rounds" ]; do
  for dh in 64 128; do
    if [ -n "${OLD:-}" ] && [ $((r % 2)) = 0 ]; then
      row $r old native $dh "$("$OLD" $args --d-h $dh)"
    fi
    if grep -q avx512f /proc/cpuinfo; then
      row $r new avx512 $dh "$(DIFFCP_CPU_ISA=avx512 "$bench" $args --d-h $dh)"
    fi
    row $r new avx2 $dh "$(DIFFCP_CPU_ISA=avx2 DNNL_MAX_CPU_ISA=AVX2 "$bench" $args --d-h $dh)"
    if [ -n "${OLD:-}" ] && [ $((r % 2)) = 1 ]; then
      row $r old native $dh "$("$OLD" $args --d-h $dh)"
    fi
    if [ -n "${OLD_AVX2:-}" ]; then
      row $r old avx2 $dh "$(DNNL_MAX_CPU_ISA=AVX2 "$OLD_AVX2" $args --d-h $dh)"
    fi
  done
  echo "round $r of $rounds done" >&2
  r=$((r + 1))
done
python3 "$here/plot_cpu_isa.py" "$out"
