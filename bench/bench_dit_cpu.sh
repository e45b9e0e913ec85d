#!/usr/bin/env bash
# Issue #54: the DiT step on CPU next to OpenVINO and BFL's PyTorch FLUX, and what the change costs
# elsewhere. Not part of CI.
#
#   peers: bench/bench_peers_torch.py dit --openvino, interleaved rounds (medians), one thread pair
#          (--threads 2, P = 1): the default preset ("small": hidden 768, 24 x 32 heads, 2 double +
#          4 single blocks, 512^2 = 1024 image + 64 text tokens) natively with diffcp's P = 2 step,
#          the same with the AVX2 kernels forced (--isa avx2: DIFFCP_CPU_ISA=avx2, oneDNN and
#          OpenVINO's oneDNN capped at AVX2), and FLUX.1's real width ("flux": 3072, 24 x 128, MLP
#          12288, 1 double + 2 single blocks, 1024^2 = 4096 image + 512 text tokens) natively.
#          -> bench/dit_cpu_peers.csv (one row per run: step medians, ratios, per-op-family profiles)
#   ab:    the benchmarks the change could slow, same run, interleaved, against OLD (a diffcp build
#          of the commit before issue #54): bench_device_core_ab.sh (every CP method's layer step at
#          P = 2 in f32 and bf16, the drafter's training step, the DiT step) -> bench/dit_cpu_ab.csv,
#          the DiT step at the small shape in f32 and bf16 (P = 1) -> bench/dit_cpu_ab_step.csv, and
#          bench_attention (the DFlash block-sparse kernels, f32 and bf16) -> bench/dit_cpu_ab_attention.csv
#          (AB_OUT=<prefix> names the three files otherwise)
#   fused: the dense attention kernels alone (bench_dense_attention, forward, 2 threads) at both
#          shapes' heads (small: 1088 tokens, 24 x 32; FLUX width: 4608 tokens, 24 x 128), f32 and
#          bf16 (DTYPES), the fused kernel the CPU gets (AMX tiles or AVX-512 registers; ISA=avx2:
#          the AVX2 kernels forced and oneDNN capped at AVX2, f32 on AVX2 registers) against
#          the tile path (DIFFCP_CPU_AMX=0 DIFFCP_CPU_FUSED=0), interleaved REPEAT times
#          -> bench/dit_cpu_fused_attention.csv (OUT= names another; the AMX kernel's first
#          measurement, bf16 only, is bench/dit_cpu_amx_attention.csv, when this mode was `amx`);
#          then the small shape's DiT step at P = 1 and 2 both ways -> bench/dit_cpu_fused_step.csv
#          (STEP_OUT=)
#
# Usage: VENV=/work/ov-venv FLUX_SRC=/path/to/flux [ROWS="small avx2 flux"] bench/bench_dit_cpu.sh peers
#        OLD_BUILD=/path/to/old/build/release bench/bench_dit_cpu.sh ab
#        [ISA=avx2] bench/bench_dit_cpu.sh fused
# VENV: a venv with torch, numpy, einops and openvino (bench_peers_torch.py --install makes one).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
what=${1:?usage: bench/bench_dit_cpu.sh peers|ab|fused}
case "$what" in
  peers)
    venv=${VENV:?VENV=<venv with torch, numpy, einops, openvino>}
    flux=${FLUX_SRC:?FLUX_SRC=<a checkout of github.com/black-forest-labs/flux>}
    csv=${CSV:-bench/dit_cpu_peers.csv}
    run() { python3 bench/bench_peers_torch.py dit --venv "$venv" --flux-src "$flux" --openvino --csv "$csv" "$@"; }
    rows=${ROWS:-small avx2 flux}
    [[ " $rows " == *" small "* ]] && run --shape small --rounds "${ROUNDS:-3}" --steps 6 --reps 5 --p2
    [[ " $rows " == *" avx2 "* ]] && run --shape small --rounds "${ROUNDS:-3}" --steps 6 --reps 5 --isa avx2
    [[ " $rows " == *" flux "* ]] && run --shape flux --rounds "${FLUX_ROUNDS:-2}" --steps 3 --reps 2
    true
    ;;
  ab)
    old=${OLD_BUILD:?OLD_BUILD=<build/release of the commit before the change>}
    ab=${AB_OUT:-bench/dit_cpu_ab}  # the files' prefix (the AMX part of issue #54: bench/dit_cpu_ab_amx)
    # AB_ONLY=attention: the block-sparse kernels' pair alone (the last part below); AB_ONLY=dense:
    # the DiT step and the dense attention kernels (bench_dense_attention at both shapes' heads, as
    # `fused` runs them) -> ${AB_OUT}_step.csv, ${AB_OUT}_dense.csv (a change to the fused kernels only)
    [[ -n ${AB_ONLY:-} ]] || OLD="$old/src/diffcp" CSV="$ab.csv" REPEAT="${REPEAT:-3}" bench/bench_device_core_ab.sh
    # interleave CMD: runs CMD <build> <build dir> <dtype> for every round (REPEAT), build (old first) and dtype
    interleave() {
      for ((r = 1; r <= ${REPEAT:-3}; r++)); do
        for b in old new; do
          dir=build/release
          [[ $b == old ]] && dir="$old"
          for dt in f32 bf16; do "$@" "$b" "$dir" "$dt"; done
        done
      done
    }
    dit_step() {  # the small shape's step, P = 1 (2 threads)
      OMP_NUM_THREADS=2 "$2/src/diffcp" dit --resolution 512 --text-tokens 64 --steps 6 --dtype "$3" --out "" --json |
        python3 -c "import json,sys; print('$1,$3,%s' % json.load(sys.stdin)['step_ms'])"
    }
    attention() {  # the DFlash block-sparse kernels, forward and backward
      "$2/bench/bench_attention" --samples 2 --context 8192 --anchors 128 --dtype "$3" --reps 5 --json |
        python3 -c "import json,sys; j=json.load(sys.stdin); p='bf16_' if '$3' == 'bf16' else ''; print('$1,$3,%s,%s' % (j[p + 'fwd_ms'], j[p + 'bwd_ms']))"
    }
    dense() {  # the DiT's dense attention, forward, 24 heads, 2 threads: small (d_h 32), FLUX width (128)
      local name tokens dh reps
      for shape in "small 1088 32 5" "flux 4608 128 2"; do
        read -r name tokens dh reps <<<"$shape"
        OMP_NUM_THREADS=2 "$2/bench/bench_dense_attention" --dtype "$3" --tokens "$tokens" --heads 24 --d-h "$dh" \
          --reps "$reps" | python3 -c "import json,sys; print('$1,$3-$name,%s,' % json.load(sys.stdin)['median_ms'])"
      done
    }
    step=${ab}_step.csv
    [[ ${AB_ONLY:-} == attention ]] || { echo "build,dtype,step_ms"; interleave dit_step; } >"$step"
    if [[ ${AB_ONLY:-} == dense ]]; then
      out=${ab}_dense.csv
      { echo "build,dtype,fwd_ms,bwd_ms"; interleave dense; } >"$out"  # dtype: <dtype>-<shape>; no backward
    else
      out=${ab}_attention.csv
      { echo "build,dtype,fwd_ms,bwd_ms"; interleave attention; } >"$out"
    fi
    python3 - "$out" "$step" <<'PY'
import collections, csv, os, statistics, sys
d = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    for k in ("fwd_ms", "bwd_ms"):
        if r[k]:
            d[(r["dtype"], k, r["build"])].append(float(r[k]))
step = collections.defaultdict(list)
if os.path.exists(sys.argv[2]):  # absent with AB_ONLY=attention
    for r in csv.DictReader(open(sys.argv[2])):
        step[(r["dtype"], r["build"])].append(float(r["step_ms"]))
    print("| DiT step, 512^2, P = 1 | old median ms | new median ms | old / new (speed-up) |")
    print("|---|---|---|---|")
    for dt in ("f32", "bf16"):
        o, n = statistics.median(step[(dt, "old")]), statistics.median(step[(dt, "new")])
        print(f"| {dt} | {o:.1f} | {n:.1f} | {o / n:.3f} |")
print("| attention | old median ms | new median ms | new / old |")
print("|---|---|---|---|")
for dt, k in sorted({(dt, k) for dt, k, _ in d}):
    o, n = statistics.median(d[(dt, k, "old")]), statistics.median(d[(dt, k, "new")])
    print(f"| {dt} {k} | {o:.2f} | {n:.2f} | {n / o:.3f} |")
PY
    ;;
  fused)
    # Each dtype's dense kernel as the CPU picks it (bf16: AMX tiles, else AVX-512 registers where
    # the CPU has avx512_bf16; f32: AVX-512 registers; ISA=avx2: AVX2 registers) against the tile
    # path (DIFFCP_CPU_AMX=0 DIFFCP_CPU_FUSED=0).
    dtypes=${DTYPES:-f32 bf16}
    if [[ ${ISA:-} == avx2 ]]; then  # no bf16 kernel on AVX2 registers: f32 unless DTYPES says
      export DIFFCP_CPU_ISA=avx2 DNNL_MAX_CPU_ISA=AVX2
      dtypes=${DTYPES:-f32}
    fi
    bin=build/release/bench/bench_dense_attention
    out=${OUT:-bench/dit_cpu_fused_attention.csv}
    echo "shape,dtype,kernel,tokens,heads,d_h,median_ms,gflops" >"$out"
    for ((r = 1; r <= ${REPEAT:-3}; r++)); do
      for shape in "small 1088 24 32" "flux 4608 24 128"; do
        set -- $shape
        for dtype in $dtypes; do
          for on in 1 0; do
            DIFFCP_CPU_AMX=$on DIFFCP_CPU_FUSED=$on OMP_NUM_THREADS=2 "$bin" --dtype "$dtype" --tokens "$2" --heads "$3" \
              --d-h "$4" --reps 5 |
              python3 -c "import json,sys; j=json.load(sys.stdin); k=j['kernels']; k='amx' if 'AMX' in k else 'avx512' if 'AVX-512 reg' in k else 'avx2' if 'AVX2 reg' in k else 'tile'; print('$1,$dtype,%s,%d,%d,%d,%.3f,%.1f' % (k, j['tokens'], j['heads'], j['d_h'], j['median_ms'], j['gflops']))" >>"$out"
          done
        done
      done
    done
    # The DiT step (small shape, P = 1 with 2 threads and P = 2 with one each) with the fused kernels
    # and with the tile path, interleaved: what the kernels change in the step.
    step=${STEP_OUT:-bench/dit_cpu_fused_step.csv}
    echo "np,dtype,kernel,step_ms" >"$step"
    for ((r = 1; r <= ${REPEAT:-3}; r++)); do
      for np in 1 2; do
        for dtype in $dtypes; do
          for on in 1 0; do
            kernel=$([ $on = 1 ] && echo fused || echo tile)
            launch=()  # P = 1 runs directly (mpirun -np 1 would bind its two threads to one core)
            [ $np = 2 ] && launch=(mpirun -np 2 -x DIFFCP_CPU_AMX -x DIFFCP_CPU_FUSED -x OMP_NUM_THREADS ${ISA:+-x DIFFCP_CPU_ISA -x DNNL_MAX_CPU_ISA})
            env DIFFCP_CPU_AMX=$on DIFFCP_CPU_FUSED=$on OMP_NUM_THREADS=$((3 - np)) OMPI_ALLOW_RUN_AS_ROOT=1 \
              OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "${launch[@]}" \
              build/release/src/diffcp dit --resolution 512 --text-tokens 64 --steps 6 --dtype "$dtype" --out "" --json |
              python3 -c "import json,sys; print('$np,$dtype,$kernel,%s' % json.load(sys.stdin)['step_ms'])" >>"$step"
          done
        done
      done
    done
    python3 - "$out" "$step" <<'PY'
import collections, csv, statistics, sys
s = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[2])):
    s[(r["np"], r["dtype"], r["kernel"])].append(float(r["step_ms"]))
print("| DiT step, 512^2 | dtype | tile path ms | fused ms | speed-up |")
print("|---|---|---|---|---|")
for np_ in ("1", "2"):
    for dt in ("f32", "bf16"):
        if s[(np_, dt, "tile")]:
            t, f = statistics.median(s[(np_, dt, "tile")]), statistics.median(s[(np_, dt, "fused")])
            print(f"| P = {np_} | {dt} | {t:.1f} | {f:.1f} | {t / f:.3f}x |")
d = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    d[(r["shape"], r["dtype"], r["kernel"])].append(float(r["median_ms"]))
print("| shape | dtype | tile path ms | fused kernel | fused ms | speed-up |")
print("|---|---|---|---|---|---|")
for (shape, dtype, kernel), ms in sorted(d.items()):
    if kernel == "tile" or not d[(shape, dtype, "tile")]:
        continue
    t, a = statistics.median(d[(shape, dtype, "tile")]), statistics.median(ms)
    print(f"| {shape} | {dtype} | {t:.2f} | {kernel} | {a:.2f} | {t / a:.2f}x |")
PY
    ;;
  *) echo "usage: bench/bench_dit_cpu.sh peers|ab|fused" >&2; exit 2 ;;
esac
