#!/usr/bin/env bash
# scripts/gpu_check.sh prepare | run OUT [checks|bench|all] | rehearse OUT   (issue #55: diffcp on a lent GPU)
#
#   prepare   (here, on a build machine with nvcc): builds everything (scripts/build.sh all turns
#             DIFFCP_CUDA on where nvcc is found) and packs gpu_check/bundle.tar.gz (ignored by
#             git; carry `gpu_check`): the programs below, and the Debian runtime packages a bare
#             CUDA image lacks (Open MPI 4.1, oneDNN 2.6 and what they load), unpacked with
#             `dpkg -x` into a prefix. cuBLASLt and NCCL are not packed: the device's PyTorch venv
#             brings them (the build links against the toolkit's, no newer than the venv's).
#   run OUT [checks|bench|all]  (on the device machine, from the repository root; checks (steps
#             1-5) in about 5 minutes, bench (step 6) in about 8; all: both): unpacks the bundle,
#             points Open MPI at its prefix (OPAL_PREFIX, no ssh), then, each step bounded and
#             logged into OUT (a failed step fails the run, the rest still run):
#               1. the machine: GPU, driver, what the programs load (ldd), mpirun;
#               2. the op harness on "cuda" against the CPU (test_backend_ops, and
#                  bench_backend_ops --perf for its table; again with DIFFCP_CUDA_ATTENTION=simt);
#               3. compute-sanitizer memcheck over the op harness's kernels (once);
#               4. every CP method forward + backward (test_cp_guard) at P = 1-4, the DiT
#                  (test_dit_guard: the exchanges, each family's tiny config, every mode) at P = 1, 2,
#                  4, and the drafter (test_drafter_guard: train steps in every shard mode, draft,
#                  the draft cache) at P = 1, 2 with DIFFCP_TEST_DEVICE=cuda: each rank on the one
#                  GPU, the MPI communicator staging through the host; f32 against the fp64
#                  reference, everything within its bound of the CPU's run (tests/support/device_under_test.hpp);
#                  Then test_cp_guard at P = 3 on the rendezvous communicator (NCCL's grouping);
#               5. the NCCL communicator at P = 1 (test_nccl_comm), and where the device has
#                  several GPUs (one per rank) at P = 2, 3, 4: test_nccl_comm and every CP method's
#                  `diffcp attn --check --comm nccl`;
#               6. benchmarks (JSON lines in OUT/bench.jsonl): the block-sparse attention on the
#                  DFlash workload (bench_device_attention: 2 x 32k context, 64 anchors x 16, 32 x
#                  128 heads, GQA 8, bf16) against PyTorch's FlexAttention and SDPA on the same mask
#                  (bench/bench_gpu_peers.py); one DiT step at FLUX.1's width, bf16, against diffusers'
#                  FluxTransformer2DModel eager and compiled (bench/bench_gpu_dit.py; diffusers from
#                  carried wheels); one Split-KV layer step and `diffcp train` steps on cuda vs cpu;
#                  `diffcp dit` over NCCL at P = 1.
#             Exit status: non-zero if a check failed.
#   rehearse OUT  (here): `run` in a mount namespace where this machine's own Open MPI and oneDNN
#             are hidden, so the bundle must bring them; the GPU steps skip, saying why.
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=gpu_check
programs=(tests/test_backend_ops bench/bench_backend_ops tests/test_cp_guard tests/test_dit_guard tests/test_drafter_guard
          tests/test_nccl_comm bench/bench_device_attention src/diffcp)
# Debian 12 runtime packages (the closure of libopenmpi3, openmpi-bin and libdnnl2 past what any
# glibc-based image has): unpacked, not installed.
debs=(libopenmpi3 openmpi-bin openmpi-common libdnnl2 libgomp1 ocl-icd-libopencl1 libevent-core-2.1-7
      libevent-pthreads-2.1-7 libhwloc15 libpmix2 libfabric1 libucx0 libibverbs1 ibverbs-providers librdmacm1
      libnl-3-200 libnl-route-3-200 libnuma1 libpsm-infinipath1 libpsm2-2 libmunge2 libpciaccess0 libatomic1)

case "${1:-}" in
  prepare)
    set -e
    scripts/build.sh all >/dev/null
    grep -q '^DIFFCP_CUDA:BOOL=ON' build/release/CMakeCache.txt ||
      { echo "gpu_check: build/release has no CUDA backend (no nvcc found?)" >&2; exit 1; }
    stage=$(mktemp -d)
    trap 'rm -rf "$stage"' EXIT
    mkdir -p "$stage/bin" "$stage/debs" "$stage/prefix"
    for p in "${programs[@]}"; do cp "build/release/$p" "$stage/bin/"; done
    (cd "$stage/debs" && apt-get download "${debs[@]}" >/dev/null 2>&1) ||
      { echo "gpu_check: apt-get download failed (${debs[*]})" >&2; exit 1; }
    for d in "$stage"/debs/*.deb; do dpkg -x "$d" "$stage/prefix"; done
    rm -rf "$stage/debs" "$stage/prefix/usr/share/doc" "$stage/prefix/usr/share/man"
    ln -sf orterun "$stage/prefix/usr/bin/mpirun"  # the alternatives link dpkg -x does not make
    # diffusers for the DiT comparison (the device image has PyTorch, not diffusers), and the
    # versions of its pins the image may lack (pip download: wheels, no dependencies).
    mkdir -p "$stage/wheels"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$stage/wheels" diffusers importlib_metadata huggingface_hub safetensors ||
      { echo "gpu_check: pip download of the diffusers wheels failed" >&2; exit 1; }
    rm -rf "$bundle" && mkdir -p "$bundle"
    tar -C "$stage" -czf "$bundle/bundle.tar.gz" bin prefix wheels
    grep -qx '/gpu_check/' .gitignore || echo '/gpu_check/' >> .gitignore
    du -sh "$bundle" | awk '{print "gpu_check: prepared " $1 " in gpu_check/ (carry it)"}'
    ;;
  rehearse)
    out=${2:?usage: gpu_check.sh rehearse OUT}
    # Hide the system's Open MPI and oneDNN (bind /dev/null over their files, tmpfs over their
    # directories) in a private mount namespace; the bundle must bring its own.
    exec unshare -m bash -c '
      for d in /usr/lib/x86_64-linux-gnu/openmpi /usr/share/openmpi /etc/openmpi; do [ -d "$d" ] && mount -t tmpfs none "$d"; done
      for f in /usr/lib/x86_64-linux-gnu/libmpi.so.40* /usr/lib/x86_64-linux-gnu/libopen-rte.so.40* \
               /usr/lib/x86_64-linux-gnu/libopen-pal.so.40* /usr/lib/x86_64-linux-gnu/libdnnl.so.2* \
               /usr/bin/orterun /usr/bin/orted; do [ -e "$f" ] && mount --bind /dev/null "$f"; done
      exec "$0" run "$1"' "$0" "$out"
    ;;
  run)
    out=${2:?usage: gpu_check.sh run OUT [checks|bench|all]}
    what=${3:-all}
    case "$what" in checks | bench | all) ;; *) echo "gpu_check: run OUT [checks|bench|all], not '$what'" >&2; exit 2 ;; esac
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
    SECONDS=0
    [ -f "$bundle/bundle.tar.gz" ] ||
      { echo "gpu_check: no $bundle/bundle.tar.gz: run 'scripts/gpu_check.sh prepare' first, and carry $bundle" >&2; exit 1; }
    root=$(mktemp -d /tmp/diffcp_gpu.XXXX)
    tar -C "$root" -xzf "$bundle/bundle.tar.gz"
    bin=$root/bin pre=$root/prefix/usr
    log=$out/gpu_check.log
    : >"$log"
    say() { echo "gpu_check: $*" | tee -a "$log"; }
    # A wheel's library (nvidia/<pkg>/lib/<name>) from the device's python3, else a toolkit's lib64.
    find_lib() {
      local f="" py
      for py in python3 /opt/torch/.venv/bin/python3; do
        command -v "$py" >/dev/null 2>&1 || continue
        f=$("$py" -c 'import glob, os, sys, nvidia
c = sorted(f for p in nvidia.__path__ for f in glob.glob(os.path.join(p, "*", "lib", sys.argv[1])))
print(c[0] if c else "")' "$1" 2>/dev/null || true)
        [ -n "$f" ] && break
      done
      [ -n "$f" ] || f=$(ls /usr/local/cuda/lib64/"$1" /usr/local/cuda*/lib64/"$1" 2>/dev/null | head -1 || true)
      echo "$f"
    }
    lt=$(find_lib libcublasLt.so.13) nccl=$(find_lib libnccl.so.2)
    libs="$pre/lib/x86_64-linux-gnu:$pre/lib/x86_64-linux-gnu/openmpi/lib"
    for f in "$lt" "$nccl"; do [ -n "$f" ] && libs="$libs:$(dirname "$f")"; done
    export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PATH="$pre/bin:$PATH" OPAL_PREFIX="$pre"
    # Open MPI on one machine with no ssh, as root, in a sandbox: shared memory without
    # cross-process copies, no InfiniBand probing, no binding.
    export OMPI_MCA_plm_rsh_agent=false OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_osc=^ucx \
      OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
    mpi=(mpirun --bind-to none -np)  # + the rank count, the program
    failed=()
    # step NAME SECONDS CMD...: runs CMD bounded, output into OUT/NAME.log and the log's tail.
    # The whole run stays inside GPU_CHECK_BUDGET_S (default 540 s: a device call's 600 s less the
    # unpacking and the copy back): a step gets at most what is left, and none starts with < 15 s.
    budget=${GPU_CHECK_BUDGET_S:-540}
    step() {
      local name=$1 secs=$2; shift 2
      local t0=$SECONDS rc left=$((budget - SECONDS))
      if [ $left -lt 15 ]; then say "$name: skipped (the run's budget of $budget s is spent)"; failed+=("$name"); return; fi
      [ "$secs" -gt $left ] && secs=$left
      timeout -k 10 "$secs" "$@" >"$out/$name.log" 2>&1
      rc=$?
      say "$name: exit $rc in $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (timed out)')"
      tail -n 4 "$out/$name.log" | sed 's/^/    /' | tee -a "$log" >/dev/null
      [ $rc = 0 ] || failed+=("$name")
    }
    {
      echo "cuBLASLt: ${lt:-not found}"; echo "NCCL: ${nccl:-not found}"
      command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
      uname -a; ldd --version 2>&1 | head -1
      for p in "$bin"/*; do ldd "$p" | grep -F '=> not found' | sed "s|^|$(basename "$p"): |"; done
      mpirun --version 2>&1 | head -1
    } >"$out/machine.log" 2>&1
    say "machine: $(head -3 "$out/machine.log" | tr '\n' ' ')"
    grep -qF '=> not found' "$out/machine.log" && { say "missing libraries:"; grep -F '=> not found' "$out/machine.log" | tee -a "$log"; }
    gpu=1
    command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1 || { gpu=0; say "no GPU here (nvidia-smi failed): the GPU steps skip, saying why"; }
    if [ "$what" != bench ]; then
      step mpi_cpu_np2 60 "${mpi[@]}" 2 "$bin/diffcp" attn --check --json --reps 1  # Open MPI from the bundle, on the CPU
      step op_harness 120 "$bin/test_backend_ops" --gtest_output="xml:$out/test_backend_ops.xml"
      if [ $gpu = 1 ]; then
        step op_harness_perf 120 "$bin/bench_backend_ops" --backend cuda --perf --reps 10
        # the other attention forward (the warp-per-row kernel) against the CPU too
        step op_harness_simt 60 env DIFFCP_CUDA_ATTENTION=simt "$bin/bench_backend_ops" --backend cuda
      fi
      if [ $gpu = 1 ] && command -v compute-sanitizer >/dev/null 2>&1; then
        step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 3 "$bin/bench_backend_ops" --backend cuda
      else
        say "memcheck: skipped (no GPU or no compute-sanitizer)"
      fi
      export DIFFCP_TEST_DEVICE=cuda
      for np in 1 2 3 4; do step "cp_methods_np$np" 60 "${mpi[@]}" "$np" "$bin/test_cp_guard" --gtest_brief=1; done
      for np in 1 2 4; do step "dit_np$np" 60 "${mpi[@]}" "$np" "$bin/test_dit_guard" --gtest_brief=1; done
      for np in 1 2; do step "drafter_np$np" 90 "${mpi[@]}" "$np" "$bin/test_drafter_guard" --gtest_brief=1; done
      # the grouping the rendezvous communicator proved on the CPU, on the GPU's memory (staged)
      step cp_methods_rendezvous_np3 60 env DIFFCP_COMM=rendezvous "${mpi[@]}" 3 "$bin/test_cp_guard" --gtest_brief=1
      unset DIFFCP_TEST_DEVICE
      step nccl_np1 60 "${mpi[@]}" 1 "$bin/test_nccl_comm" --gtest_brief=1
      # NCCL across GPUs, one per rank (the library picks it by the node-local rank:
      # comm/mpi_runtime.hpp node_local; no CUDA_VISIBLE_DEVICES), where the device has them:
      # the communicator's tests and every CP method forward + backward against fp64 at P = 2-4
      ngpu=0
      [ $gpu = 1 ] && ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
      for np in 2 3 4; do
        if [ "$ngpu" -lt "$np" ]; then say "nccl at P = $np: skipped ($ngpu GPUs)"; continue; fi
        step "nccl_np$np" 60 "${mpi[@]}" "$np" "$bin/test_nccl_comm" --gtest_brief=1
        for m in splitkv ring ringx lvxattn; do
          step "nccl_${m}_np$np" 60 "${mpi[@]}" "$np" "$bin/diffcp" --backend cuda --comm nccl attn \
            --method "$m" --check --reps 1 --warmup 0
        done
      done
    fi
    if [ $gpu = 1 ] && [ "$what" != checks ]; then  # benchmarks: JSON lines, the issue's goals first
      wl=(--samples 2 --anchors 64 --block 16 --n-q 32 --n-kv 8 --d-h 128 --dtype bf16 --json)
      layer=(--samples 2 --context 4k --queries 512 --hidden 1024 --n-q 16 --n-kv 4 --d-h 64 --dtype bf16 --reps 3 --check --json)
      peers() { step "attention_peers_$1" 150 python3 bench/bench_gpu_peers.py --mask "$out/mask_$1.json" --n-q 32 --n-kv 8 --d-h 128 --reps 10; }
      # 1. the DFlash workload (2 x 32k), forward + backward on the GEMM path, and PyTorch on its mask
      step attention_32k 150 "$bin/bench_device_attention" --backend cuda "${wl[@]}" --context 32768 --reps 3 \
        --dump-mask "$out/mask_32k.json"
      peers 32k
      # 2. the DiT step at FLUX.1's width (1 double + 2 single blocks, 1024^2, bf16) vs diffusers'
      if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$root/site" "$root"/wheels/*.whl \
          >"$out/wheels.log" 2>&1; then
        step dit_flux_width 300 env PYTHONPATH="$root/site${PYTHONPATH:+:$PYTHONPATH}" python3 bench/bench_gpu_dit.py \
          --diffcp "$bin/diffcp" --reps 5 --compile
      else
        say "dit_flux_width: the diffusers wheels did not install (wheels.log)"; failed+=(wheels)
      fi
      # 3. the drafter's train step, GPU and CPU; 4k context on both attention paths; the SIMT
      #    forward at 32k; `diffcp dit` over NCCL
      for b in cuda cpu; do  # one Split-KV layer step (forward + backward, P = 1), checked against fp64
        step "splitkv_$b" 90 "${mpi[@]}" 1 "$bin/diffcp" --backend "$b" attn --method splitkv "${layer[@]}"
      done
      for b in cuda cpu; do
        step "train_$b" 120 "${mpi[@]}" 1 "$bin/diffcp" --backend "$b" train --steps 6 --context 2048 --eval-every 0 \
          --log "$out/train_$b.jsonl" --no-progress
      done
      step attention_4k 90 "$bin/bench_device_attention" --backend cuda "${wl[@]}" --context 4096 --reps 3 \
        --dump-mask "$out/mask_4k.json"
      peers 4k
      step attention_4k_simt 90 env DIFFCP_CUDA_ATTENTION=simt "$bin/bench_device_attention" --backend cuda "${wl[@]}" \
        --context 4096 --reps 2
      step attention_fwd_32k_simt 90 env DIFFCP_CUDA_ATTENTION=simt "$bin/bench_device_attention" --backend cuda "${wl[@]}" \
        --context 32768 --no-backward --reps 2
      step dit_nccl_np1 60 "${mpi[@]}" 1 "$bin/diffcp" --backend cuda --comm nccl dit --steps 3 --resolution 256 --json --out ""
      grep -h '^{' "$out"/attention_*.log "$out"/dit_flux_width.log "$out"/splitkv_*.log >"$out/bench.jsonl" 2>/dev/null || true
    fi
    rm -rf "$root"
    if [ ${#failed[@]} = 0 ]; then say "passed"; else say "FAILED: ${failed[*]}"; fi
    [ ${#failed[@]} = 0 ]
    ;;
  *) sed -n '2,40p' "$0"; exit 2 ;;
esac
