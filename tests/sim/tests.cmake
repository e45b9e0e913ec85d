# tests/sim: the simulator (`diffcp sim`) and the cost model.
# Included by tests/CMakeLists.txt (one directory scope: its variables, functions and the
# label pass at its end apply); ${CMAKE_CURRENT_SOURCE_DIR} is tests/.
# `diffcp sim dit` / `sim train` (sim/dit.hpp, sim/train.hpp): pure computation, one process.
add_executable(test_sim_dit_train sim/test_sim_dit_train.cpp)
target_link_libraries(test_sim_dit_train PRIVATE diffcp diffcp_testing GTest::gtest_main)
gtest_discover_tests(test_sim_dit_train DISCOVERY_TIMEOUT 60 TEST_PREFIX "test_sim_dit_train." PROPERTIES LABELS unit)
add_executable(test_sim sim/test_sim.cpp)
target_link_libraries(test_sim PRIVATE diffcp diffcp_testing GTest::gtest_main)
gtest_discover_tests(test_sim DISCOVERY_TIMEOUT 60 TEST_PREFIX "test_sim." PROPERTIES LABELS unit)

# ---- `diffcp sim` (issue #12): predictions without MPI, calibrate under mpirun, bad input ----
set(SIM $<TARGET_FILE:diffcp_cli> sim)
# P = 1024 on h100-ib (8 per node: 128 nodes, Split-KV's hierarchical collectives): Split-KV's bytes
# equal the across-nodes closed form of docs/attn.md, written out here (Q = 64 x 512, n = Q n_q,
# f32), every supported row adds up (step = compute + exposed), Ulysses is refused with its
# reason (1024 does not divide n_kv = 2), and Split-KV moves the fewest bytes and is the fastest.
add_test(NAME cli_sim_cp_p1024 COMMAND ${JSON_CHECK}
         "[r['method'] for r in j] == ['splitkv', 'ulysses', 'ring', 'ringx', 'lvxattn']" "all(r['P'] == 1024 for r in j)"
         "j[0]['collectives'] == 'hierarchical'"
         "j[0]['bytes_per_layer'] == 4 * (1023 * 2 * 32768 * 512 + 2 * (2 * 262144 * 127 + 3 * 262144 * 896)) / 1024"
         "j[1]['supported'] is False and 'P | n_kv' in j[1]['reason']"
         "all(abs(r['step_ms'] - r['compute_ms'] - r['exposed_comm_ms']) < 1e-9 * r['step_ms'] for r in j if r['supported'])"
         "all(0 < r['exposed_comm_ms'] <= r['comm_ms'] * (1 + 1e-12) for r in j if r['supported'])"
         "min((r for r in j if r['supported']), key=lambda r: r['bytes_per_layer'])['method'] == 'splitkv'"
         "min((r for r in j if r['supported']), key=lambda r: r['step_ms'])['method'] == 'splitkv'"
         -- ${SIM} cp --profile h100-ib --P 1024 --samples 64 --context 16k --queries 512 --json)
set_tests_properties(cli_sim_cp_p1024 PROPERTIES TIMEOUT 60 PASS_REGULAR_EXPRESSION "json_check: passed")
# Two ranks on one node: every rate measured, positive and finite; the intra link measured, the
# inter one copied from it (measured false), the kernel rates' shape recorded.
add_test(NAME cli_sim_calibrate COMMAND ${JSON_CHECK} --file ${CMAKE_CURRENT_BINARY_DIR}/calibrated.json
         "all(math.isfinite(j[k]) and j[k] > 0 for k in ['rank_tflops', 'gemm_tflops', 'attn_bwd_tflops', 'elementwise_gbs', 'kernel_us', 'intra_gbit', 'inter_gbit', 'intra_latency_us'])"
         "j['ranks_per_node'] == 2" "0 <= j['comm_overlap'] <= 1" "0 <= j['sync_loss'] < 10" "j['gemm_n_half'] >= 0"
         "j['inter_gbit'] == j['intra_gbit']"
         "j['measured'] == {'compute': True, 'intra_link': True, 'inter_link': False, 'comm_overlap': True, 'sync_loss': True}"
         "j['attention_shape'] == {'n_q': 8, 'n_kv': 2, 'd_h': 128}"
         -- ${MPIRUN} 2 $<TARGET_FILE:diffcp_cli> sim calibrate --reps 2 --out ${CMAKE_CURRENT_BINARY_DIR}/calibrated.json)
set_tests_properties(cli_sim_calibrate PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120 FIXTURES_SETUP calibrated_profile
  PASS_REGULAR_EXPRESSION "json_check: passed")
add_test(NAME cli_sim_cp_calibrated COMMAND ${RUN_OK} ${SIM} cp --profile ${CMAKE_CURRENT_BINARY_DIR}/calibrated.json --P 2 --json)
set_tests_properties(cli_sim_cp_calibrated PROPERTIES TIMEOUT 60 FIXTURES_REQUIRED calibrated_profile
  PASS_REGULAR_EXPRESSION "\"profile\":\"calibrated-")
# A one-process calibration says on stderr and in the file that its links are defaults; sim warns
# when a prediction leans on them or on another head shape (issue #41).
add_test(NAME cli_sim_profile_measured COMMAND ${RUN_OK} ${CMAKE_CURRENT_SOURCE_DIR}/sim/sim_profile_check.sh $<TARGET_FILE:diffcp_cli>)
set_tests_properties(cli_sim_profile_measured PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120
                     PASS_REGULAR_EXPRESSION "sim_profile_check: passed")
# Every dispatch over the CP methods is a switch without a default (issue #41): one more CpMethodId
# does not compile until it is handled (tests/dispatch_check.sh).
add_test(NAME cp_method_dispatch_exhaustive
         COMMAND ${RUN_OK} ${CMAKE_CURRENT_SOURCE_DIR}/sim/dispatch_check.sh ${CMAKE_CXX_COMPILER} ${PROJECT_SOURCE_DIR}
                 "-I$<JOIN:$<TARGET_PROPERTY:diffcp,INCLUDE_DIRECTORIES>,;-I>" -I${PROJECT_SOURCE_DIR}/src
                 "$<$<BOOL:${MPI_CXX_INCLUDE_DIRS}>:-I$<JOIN:${MPI_CXX_INCLUDE_DIRS},;-I>>"
         COMMAND_EXPAND_LISTS)
set_tests_properties(cp_method_dispatch_exhaustive PROPERTIES TIMEOUT 180 PASS_REGULAR_EXPRESSION "dispatch_check: passed")
diffcp_add_fail_test(cli_sim_unknown_profile "profile 'nope': no such file" ${SIM} cp --profile nope)
diffcp_add_fail_test(cli_sim_bad_profile_field "unknown field 'bogus'" ${SIM} cp --profile ${CMAKE_CURRENT_SOURCE_DIR}/data/bad_profile.json)
diffcp_add_fail_test(cli_sim_p_not_fitting "--P = 12 ranks do not fill nodes of 8 ranks" ${SIM} cp --profile h100-ib --P 12)
diffcp_add_fail_test(cli_sim_unknown_method "unknown CP method 'ringy'" ${SIM} cp --methods splitkv,ringy)
diffcp_add_fail_test(cli_sim_method_cannot_serve "sim cp: ulysses: P = 16 ranks do not divide n_kv = 2" ${SIM} cp --P 16 --methods splitkv,ulysses)
diffcp_add_fail_test(cli_sim_p_too_large "P = 16384 ranks; the per-rank work matrix is P x P, supported up to P = 8192" ${SIM} cp --P 16384)
diffcp_add_fail_test(cli_sim_dit_width_zero "--width: Value 0 not in range" ${SIM} dit --width 0)
diffcp_add_fail_test(cli_sim_bad_share "--rank-share = 2, expected a fraction in \\(0, 1\\]" ${SIM} cp --rank-share 2)
