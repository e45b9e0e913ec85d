# tests/kernels: the CPU kernels per ISA, the compute backends (the seam, the guard device, the op harness), `diffcp backends`.
# Included by tests/CMakeLists.txt (one directory scope: its variables, functions and the
# label pass at its end apply); ${CMAKE_CURRENT_SOURCE_DIR} is tests/.
# ---- single-process ----
# The CUDA attention's plans (src/cuda/plan.hpp) against the mask, on the host: no GPU needed.
add_executable(test_cuda_plan kernels/test_cuda_plan.cpp)
target_link_libraries(test_cuda_plan PRIVATE diffcp GTest::gtest_main)
gtest_discover_tests(test_cuda_plan DISCOVERY_TIMEOUT 60 TEST_PREFIX "test_cuda_plan." PROPERTIES LABELS cuda)
add_executable(test_attention kernels/test_attention.cpp support/cpu_isa_env.cpp)
target_link_libraries(test_attention PRIVATE diffcp diffcp_testing GTest::gtest_main)
gtest_discover_tests(test_attention DISCOVERY_TIMEOUT 60 TEST_PREFIX "test_attention." PROPERTIES LABELS unit ENVIRONMENT "OMP_NUM_THREADS=2")
# bf16 where oneDNN has no bf16 matmul (capped at AVX2): the conversion path runs, says so, and
# passes the same gates.
add_test(NAME attention_bf16_converted COMMAND test_attention --gtest_filter=*Bf16*)
set_tests_properties(attention_bf16_converted PROPERTIES
  ENVIRONMENT "OMP_NUM_THREADS=2;DNNL_MAX_CPU_ISA=AVX2;DIFFCP_EXPECT_BF16_PATH=converted")
# The block-sparse bf16 attention with AMX turned off: the tile path over oneDNN (what runs on a
# CPU without AMX) passes the same gates where the AMX kernels would otherwise take every bf16 case.
add_test(NAME attention_bf16_no_amx COMMAND test_attention --gtest_filter=*Bf16*:*Dflash*)
set_tests_properties(attention_bf16_no_amx PROPERTIES ENVIRONMENT "OMP_NUM_THREADS=2;DIFFCP_CPU_AMX=0")
# The DiT's dense attention with AMX turned off (bf16 on the AVX-512 kernel where the CPU has
# avx512_bf16) and with every fused kernel turned off (the tile path, f32 and bf16) passes the same
# gates, and the path test expects what the knobs say; a bad DIFFCP_CPU_AMX or DIFFCP_CPU_FUSED
# value is an error, not a silent default.
add_test(NAME attention_dense_no_amx COMMAND test_attention --gtest_filter=*Dense*)
set_tests_properties(attention_dense_no_amx PROPERTIES ENVIRONMENT "OMP_NUM_THREADS=2;DIFFCP_CPU_AMX=0")
add_test(NAME attention_dense_unfused COMMAND test_attention --gtest_filter=*Dense*)
set_tests_properties(attention_dense_unfused PROPERTIES
  ENVIRONMENT "OMP_NUM_THREADS=2;DIFFCP_CPU_AMX=0;DIFFCP_CPU_FUSED=0")
add_test(NAME gemm_bf16_converted COMMAND test_backend --gtest_filter=*Bf16Gemm*)
set_tests_properties(gemm_bf16_converted PROPERTIES ENVIRONMENT "OMP_NUM_THREADS=2;DNNL_MAX_CPU_ISA=AVX2")
# Every ISA's CPU kernels (src/cpu/isa.hpp) against the fp64 references: the kernel tests again
# with the kernels forced by DIFFCP_CPU_ISA (support/cpu_isa_env.cpp skips, saying why, where this CPU or
# build lacks them). The default run above tests the ISA this CPU picks; these the others.
if(NOT DIFFCP_NATIVE)
  foreach(isa IN LISTS DIFFCP_CPU_ISAS)
    add_test(NAME cpu_isa_${isa}_attention COMMAND test_attention --gtest_brief=1)
    add_test(NAME cpu_isa_${isa}_ops COMMAND test_backend --gtest_brief=1)
    add_test(NAME cpu_isa_${isa}_cp_methods COMMAND ${MPIRUN} 2 $<TARGET_FILE:test_cp_methods> --gtest_brief=1)
    add_test(NAME cpu_isa_${isa}_drafter_step COMMAND ${MPIRUN} 2 $<TARGET_FILE:test_drafter_step_reference> --gtest_brief=1)
    add_test(NAME cpu_isa_${isa}_dit COMMAND ${MPIRUN} 2 $<TARGET_FILE:test_dit> --gtest_brief=1
             --gtest_filter=DitOps.*:DitModel.FlatEqualsSingleProcess:DitModel.Bf16ComputeImageWithin40dBOfF32AndParallelLikeOneRank:DitExchange.FusedDenseBlocksEqualDenseReferencePerImage)
    foreach(t attention ops cp_methods drafter_step dit)
      set_tests_properties(cpu_isa_${isa}_${t} PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV};DIFFCP_CPU_ISA=${isa}"
                           SKIP_REGULAR_EXPRESSION "kernels: skipped" LABELS cpu_isa)
    endforeach()
  endforeach()
endif()
diffcp_add_fail_test(cpu_isa_unknown_is_refused "DIFFCP_CPU_ISA=sse9: CPU kernels 'sse9' are not compiled in; compiled in: "
  ${CMAKE_COMMAND} -E env DIFFCP_CPU_ISA=sse9 $<TARGET_FILE:diffcp_cli> attn --reps 1 --queries 64 --context 300)
diffcp_add_fail_test(cpu_amx_bad_value_is_refused "DIFFCP_CPU_AMX=yes: expected 0 \\(off\\) or 1"
  ${CMAKE_COMMAND} -E env DIFFCP_CPU_AMX=yes $<TARGET_FILE:diffcp_cli> backends)
diffcp_add_fail_test(cpu_fused_bad_value_is_refused "DIFFCP_CPU_FUSED=on: expected 0 \\(off\\) or 1"
  ${CMAKE_COMMAND} -E env DIFFCP_CPU_FUSED=on $<TARGET_FILE:diffcp_cli> backends)
add_test(NAME cpu_isa_include_last COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/kernels/cpu_isa_check.sh ${PROJECT_SOURCE_DIR}/src/cpu)
if(NOT DIFFCP_NATIVE AND CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  add_test(NAME cpu_isa_portable_binary COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/kernels/cpu_isa_portable.sh
           $<TARGET_FILE:diffcp_cli> $<TARGET_FILE:test_attention>)
endif()

# The compute seam (ops/backend.hpp): a toy second backend that declines attention.
add_executable(test_backend kernels/test_backend.cpp support/cpu_isa_env.cpp)
target_link_libraries(test_backend PRIVATE diffcp diffcp_testing GTest::gtest_main)
gtest_discover_tests(test_backend DISCOVERY_TIMEOUT 60 TEST_PREFIX "test_backend." PROPERTIES LABELS unit)
# The guard device (testing/guard_backend.hpp): faults on host touches, computes what the CPU computes.
add_executable(test_guard kernels/test_guard.cpp)
target_link_libraries(test_guard PRIVATE diffcp diffcp_testing GTest::gtest_main)
gtest_discover_tests(test_guard DISCOVERY_TIMEOUT 60 TEST_PREFIX "test_guard." PROPERTIES LABELS device)
add_executable(test_backend_ops kernels/test_backend_ops.cpp)
# test_backend_ops [-o OP] [-b BACKEND]: one ctest per target (tests/test_backend_ops.cpp).
target_link_libraries(test_backend_ops PRIVATE diffcp diffcp_testing GTest::gtest)
gtest_discover_tests(test_backend_ops DISCOVERY_TIMEOUT 60 TEST_PREFIX "test_backend_ops." NO_PRETTY_VALUES PROPERTIES LABELS device)
add_test(NAME test_backend_ops_filtered COMMAND test_backend_ops -o rmsnorm -b guard)
set_tests_properties(test_backend_ops_filtered PROPERTIES LABELS device
                     PASS_REGULAR_EXPRESSION "OpHarness/OpHarnessTargets.EveryCaseWithinItsBoundOfTheReference/guard")
diffcp_add_fail_test(test_backend_ops_unknown_target "-b tpu: no such target here; targets: guard"
  $<TARGET_FILE:test_backend_ops> -b tpu)
# The harness's command on the guard device, with --perf (its table and summary line).
add_test(NAME bench_backend_ops_guard COMMAND ${RUN_OK} $<TARGET_FILE:bench_backend_ops> --backend guard --perf --reps 2)
set_tests_properties(bench_backend_ops_guard PROPERTIES ENVIRONMENT "OMP_NUM_THREADS=1" TIMEOUT 120
                     PASS_REGULAR_EXPRESSION "backend guard: [0-9]+ cases, [0-9]+ within their bounds, 0 failed, 0 skipped"
                     FAIL_REGULAR_EXPRESSION "run_ok: FAILED")

# ---- backends: the list, the selector (--backend / DIFFCP_BACKEND), refusals on every rank ----
add_test(NAME cli_backends COMMAND ${RUN_OK} $<TARGET_FILE:diffcp_cli> backends)
set_tests_properties(cli_backends PROPERTIES PASS_REGULAR_EXPRESSION "cpu +device host.*f32: cpu .*guard +device guard"
                     FAIL_REGULAR_EXPRESSION "run_ok: FAILED")
diffcp_add_fail_test(cli_backend_unknown "unknown backend 'nope'; registered backends: cpu, guard"
                     ${MPIRUN} 2 $<TARGET_FILE:diffcp_cli> --backend nope train --steps 2)
diffcp_add_fail_test(cli_backend_unknown_env "unknown backend 'gpu'; registered backends: cpu, guard"
                     ${CMAKE_COMMAND} -E env DIFFCP_BACKEND=gpu $<TARGET_FILE:diffcp_cli> backends)
diffcp_add_fail_test(cli_backend_guard_sim_refused "--backend guard: `diffcp sim` runs on host-memory backends only \\(cpu\\); a device backend runs `diffcp train`"
                     $<TARGET_FILE:diffcp_cli> --backend guard sim cp)
# `diffcp attn` and `bench cp` on both guard devices (testing/layer_run.hpp's buffers; --oproj auto
# measures its GEMM there too): every method passes the fp64 check with the CPU run's errors.
add_test(NAME cli_attn_backend_guard COMMAND ${RUN_OK} ${CMAKE_COMMAND} -E env bash -c
  "set -e; for b in cpu guard guard-async; do ${MPIEXEC_EXECUTABLE} -np 2 $<TARGET_FILE:diffcp_cli> --backend $b bench cp --methods all --check --json --reps 1 \
     | grep -o '\"max_abs_err\":[^,]*' > /tmp/diffcp_attn_$b.$$; \
     ${MPIEXEC_EXECUTABLE} -np 2 $<TARGET_FILE:diffcp_cli> --backend $b attn --oproj auto --dtype bf16 --window 300 --check --json --reps 1 \
     | grep -o '\"max_abs_err\":[^,]*' >> /tmp/diffcp_attn_$b.$$; done; \
   test $(wc -l < /tmp/diffcp_attn_cpu.$$) -eq 6; cmp /tmp/diffcp_attn_cpu.$$ /tmp/diffcp_attn_guard.$$; \
   cmp /tmp/diffcp_attn_cpu.$$ /tmp/diffcp_attn_guard-async.$$ && echo 'errors equal'; \
   rm -f /tmp/diffcp_attn_cpu.$$ /tmp/diffcp_attn_guard.$$ /tmp/diffcp_attn_guard-async.$$")
set_tests_properties(cli_attn_backend_guard PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 180
                     PASS_REGULAR_EXPRESSION "errors equal" FAIL_REGULAR_EXPRESSION "run_ok: FAILED|check_passed\":false")
# `diffcp dit` on both guard devices from the CLI (CoCoDiff, bf16 weights sharded over the ranks, the
# PNG written from device memory): the final latent equals the CPU run's byte for byte.
add_test(NAME cli_dit_backend_guard COMMAND ${RUN_OK} ${CMAKE_COMMAND} -E env bash -c
  "set -e; d=$(mktemp -d); trap 'rm -rf $d' EXIT; \
   for b in cpu guard guard-async; do ${MPIEXEC_EXECUTABLE} -np 2 $<TARGET_FILE:diffcp_cli> --backend $b dit --steps 3 --resolution 256 \
     --mode cocodiff --weights-dtype bf16 --shard-weights --out $d/$b.png --save-latent $d/$b.npy; done; \
   cmp $d/cpu.npy $d/guard.npy && cmp $d/cpu.png $d/guard.png; \
   cmp $d/cpu.npy $d/guard-async.npy && cmp $d/cpu.png $d/guard-async.png && echo 'latents equal'")
set_tests_properties(cli_dit_backend_guard PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 180
                     PASS_REGULAR_EXPRESSION "latents equal" FAIL_REGULAR_EXPRESSION "run_ok: FAILED")
# The trainer on the guard device from the CLI: every step's loss equals the CPU run's.
add_test(NAME cli_train_backend_guard COMMAND ${RUN_OK} ${CMAKE_COMMAND} -E env bash -c
  "set -e; d=$(mktemp -d); trap 'rm -rf $d' EXIT; \
   for b in cpu guard; do ${MPIEXEC_EXECUTABLE} -np 2 $<TARGET_FILE:diffcp_cli> --backend $b train --steps 4 --context 128 --log $d/$b.jsonl --no-progress; done; \
   grep -o '\"loss\":[^,]*' $d/cpu.jsonl > $d/cpu.loss; grep -o '\"loss\":[^,]*' $d/guard.jsonl > $d/guard.loss; \
   test $(wc -l < $d/cpu.loss) -eq 4; cmp $d/cpu.loss $d/guard.loss && echo 'losses equal'")
set_tests_properties(cli_train_backend_guard PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 180
                     PASS_REGULAR_EXPRESSION "losses equal" FAIL_REGULAR_EXPRESSION "run_ok: FAILED")
# Issue #65's check: at P = 3 on the stream-ordered guard device over the rendezvous communicator
# (NCCL's matching and grouping, CUDA's stream order), every step's loss equals the CPU run's over MPI.
add_test(NAME cli_train_backend_guard_async COMMAND ${RUN_OK} ${CMAKE_COMMAND} -E env bash -c
  "set -e; d=$(mktemp -d); trap 'rm -rf $d' EXIT; \
   ${MPIEXEC_EXECUTABLE} --oversubscribe -np 3 $<TARGET_FILE:diffcp_cli> train --steps 4 --context 128 --log $d/cpu.jsonl --no-progress; \
   ${MPIEXEC_EXECUTABLE} --oversubscribe -np 3 $<TARGET_FILE:diffcp_cli> --backend guard-async train --comm rendezvous --steps 4 --context 128 \
     --log $d/async.jsonl --no-progress; \
   grep -o '\"loss\":[^,]*' $d/cpu.jsonl > $d/cpu.loss; grep -o '\"loss\":[^,]*' $d/async.jsonl > $d/async.loss; \
   test $(wc -l < $d/cpu.loss) -eq 4; cmp $d/cpu.loss $d/async.loss && echo 'losses equal'")
set_tests_properties(cli_train_backend_guard_async PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 180
                     PASS_REGULAR_EXPRESSION "guard-async device: [0-9]+ host syncs.*losses equal"
                     FAIL_REGULAR_EXPRESSION "run_ok: FAILED")

# The README's tour, command by command, as a newcomer runs it (issue #37: the front door is tested).
add_test(NAME readme_tour COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/project/readme_tour.sh $<TARGET_FILE:diffcp_cli>)
set_tests_properties(readme_tour PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 600 PASS_REGULAR_EXPRESSION "readme_tour: passed")
