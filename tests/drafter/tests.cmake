# tests/drafter: the DFlash drafter: its step, trainer, sharded state, format, drafting.
# Included by tests/CMakeLists.txt (one directory scope: its variables, functions and the
# label pass at its end apply); ${CMAKE_CURRENT_SOURCE_DIR} is tests/.
add_executable(test_drafter drafter/test_drafter.cpp)
target_link_libraries(test_drafter PRIVATE diffcp diffcp_testing GTest::gtest_main)
gtest_discover_tests(test_drafter DISCOVERY_TIMEOUT 60 TEST_PREFIX "test_drafter." PROPERTIES LABELS unit)

diffcp_add_mpi_test(test_trainer drafter/test_trainer.cpp)
# drafter/sharded_state.hpp and drafter/lm_head.hpp on P ranks.
diffcp_add_mpi_test(test_sharded_state drafter/test_sharded_state.cpp)
diffcp_add_mpi_test(test_dflash drafter/test_dflash.cpp)

# The whole drafter step's gradients against finite differences of an fp64 reference (issue #37),
# the drafter with Split-KV over 1, 2 and 3 ranks.
add_executable(test_drafter_step_reference drafter/test_drafter_step_reference.cpp)
target_link_libraries(test_drafter_step_reference PRIVATE diffcp_mpi_test_main)
foreach(np 1 2 3)
  add_test(NAME test_drafter_step_reference_np${np} COMMAND ${MPIRUN} ${np} $<TARGET_FILE:test_drafter_step_reference>)
  set_tests_properties(test_drafter_step_reference_np${np} PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 300 LABELS mpi)
endforeach()

# ---- the DFlash drafter format: export, draft, train --init; an independent numpy forward ----
add_test(NAME dflash_numpy_check COMMAND ${RUN_OK} ${CMAKE_CURRENT_SOURCE_DIR}/drafter/dflash_numpy_check.sh $<TARGET_FILE:diffcp_cli>)
set_tests_properties(dflash_numpy_check PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 240
                     PASS_REGULAR_EXPRESSION "dflash_numpy_check: passed")
set(DFLASH_DIR ${CMAKE_CURRENT_BINARY_DIR}/dflash_cli)
add_test(NAME cli_train_export_init COMMAND ${RUN_OK} ${CMAKE_COMMAND} -E env bash -c
  "set -e; rm -rf ${DFLASH_DIR}; ${MPIEXEC_EXECUTABLE} -np 2 $<TARGET_FILE:diffcp_cli> train --steps 20 --out ${DFLASH_DIR}/a --no-progress; \
   $<TARGET_FILE:diffcp_cli> export --checkpoint ${DFLASH_DIR}/a/checkpoint.bin --out ${DFLASH_DIR}/d --dtype bf16; \
   ${MPIEXEC_EXECUTABLE} -np 2 $<TARGET_FILE:diffcp_cli> train --init ${DFLASH_DIR}/d --steps 20 --out ${DFLASH_DIR}/b --no-progress")
set_tests_properties(cli_train_export_init PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 180
                     PASS_REGULAR_EXPRESSION "diffcp train: 20 steps on 2 ranks.*checkpoint ${DFLASH_DIR}/b/checkpoint.bin")
# DFlash2: trained with Split-KV at P = 2, exported in the released layout, trained on from it.
add_test(NAME cli_train_export_init_dflash2 COMMAND ${RUN_OK} ${CMAKE_COMMAND} -E env bash -c
  "set -e; rm -rf ${DFLASH_DIR}2; ${MPIEXEC_EXECUTABLE} -np 2 $<TARGET_FILE:diffcp_cli> train --arch dflash2 --steps 10 --out ${DFLASH_DIR}2/a --no-progress; \
   $<TARGET_FILE:diffcp_cli> export --checkpoint ${DFLASH_DIR}2/a/checkpoint.bin --out ${DFLASH_DIR}2/d; \
   grep -q DFlash2DraftModel ${DFLASH_DIR}2/d/config.json; \
   ${MPIEXEC_EXECUTABLE} -np 2 $<TARGET_FILE:diffcp_cli> train --init ${DFLASH_DIR}2/d --steps 10 --out ${DFLASH_DIR}2/b --no-progress --log ${DFLASH_DIR}2/b.jsonl; \
   grep -q candidate_recall ${DFLASH_DIR}2/b.jsonl")
set_tests_properties(cli_train_export_init_dflash2 PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 180
                     PASS_REGULAR_EXPRESSION "diffcp train: 10 steps on 2 ranks.*checkpoint ${DFLASH_DIR}2/b/checkpoint.bin")
# --dtype bf16 where the CPU has no bf16 arithmetic (oneDNN capped at AVX2: GEMMs converted to f32)
# says so when the run starts and in its summary.
add_test(NAME cli_train_bf16_converted_note COMMAND ${RUN_OK} ${MPIRUN} 1 $<TARGET_FILE:diffcp_cli> train --dtype bf16
         --steps 2 --eval-every 0 --no-progress)
set_tests_properties(cli_train_bf16_converted_note PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV};DNNL_MAX_CPU_ISA=AVX2" TIMEOUT 120
                     LABELS cli PASS_REGULAR_EXPRESSION
                     "--dtype bf16 \\(bf16 converted to f32 for every GEMM.*bf16 mixed-precision compute \\(bf16 converted to f32 for every GEMM")
diffcp_add_fail_test(cli_export_missing_checkpoint "checkpoint '/nonexistent/checkpoint.bin'"
                     $<TARGET_FILE:diffcp_cli> export --checkpoint /nonexistent/checkpoint.bin --out ${DFLASH_DIR}/x)
diffcp_add_fail_test(cli_train_init_not_a_drafter "--init '/nonexistent': not a directory"
                     ${MPIRUN} 2 $<TARGET_FILE:diffcp_cli> train --init /nonexistent)
diffcp_add_fail_test(cli_train_bad_arch "--arch 'dflash3', expected dflash or dflash2"
                     ${MPIRUN} 2 $<TARGET_FILE:diffcp_cli> train --arch dflash3)
diffcp_add_fail_test(cli_train_bad_selector_weight "--selector-weight -1, expected finite and >= 0"
                     ${MPIRUN} 2 $<TARGET_FILE:diffcp_cli> train --arch dflash2 --selector-weight -1)
diffcp_add_fail_test(cli_draft_bad_hidden "--target-hidden .*shape \\[5,7\\], expected \\[ctx, n_t\\*H\\] with n_t\\*H = 2 \\* 64"
                     ${CMAKE_CURRENT_SOURCE_DIR}/drafter/dflash_bad_hidden.sh $<TARGET_FILE:diffcp_cli> ${DFLASH_DIR}/d ${DFLASH_DIR}/bad)
set_tests_properties(cli_train_export_init PROPERTIES FIXTURES_SETUP dflash_dir)
set_tests_properties(cli_draft_bad_hidden PROPERTIES FIXTURES_REQUIRED dflash_dir)

diffcp_add_mpi_test(test_drafter_guard drafter/test_drafter_guard.cpp)
diffcp_add_guard_async_test(test_drafter_guard 3)
