#!/usr/bin/env python3
"""Medians per (build, isa, d_h) of bench/bench_cpu_isa.sh's CSV, as the table in
bench/history/2026-12-03-issue-39-avx2-portable-build.md (bench/RESULTS.md's `kernels` table is
bench/results_tables.py's)."""
import csv
import statistics
import sys
from collections import defaultdict

rows = list(csv.DictReader(open(sys.argv[1] if len(sys.argv) > 1 else "bench/cpu_isa.csv")))
groups = defaultdict(list)
for r in rows:
    groups[(r["build"], r["isa"], int(r["d_h"]))].append(r)
print("| build | kernels | d_h | runs | fwd ms | bwd ms | f32 GEMM GFLOP/s | fwd / GEMM | bwd / GEMM |")
print("|---|---|---|---|---|---|---|---|---|")
for (build, isa, dh), g in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][0] != "new", kv[0][1])):
    med = lambda k: statistics.median(float(x[k]) for x in g)
    print(f"| {build} | {isa} | {dh} | {len(g)} | {med('fwd_ms'):.1f} | {med('bwd_ms'):.1f} | {med('gemm_f32_gflops'):.1f} "
          f"| **{100 * med('fwd_over_f32_gemm'):.1f} %** | **{100 * med('bwd_over_f32_gemm'):.1f} %** |")
