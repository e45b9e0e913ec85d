# tests/cp: the CP methods, the Split-KV layer, load balancing, `diffcp attn` / `plan` / `bench cp`.
# Included by tests/CMakeLists.txt (one directory scope: its variables, functions and the
# label pass at its end apply); ${CMAKE_CURRENT_SOURCE_DIR} is tests/.
add_executable(test_balance cp/test_balance.cpp)
target_link_libraries(test_balance PRIVATE diffcp diffcp_testing GTest::gtest_main)
gtest_discover_tests(test_balance DISCOVERY_TIMEOUT 60 TEST_PREFIX "test_balance." PROPERTIES LABELS unit)

add_executable(test_layer_reference cp/test_layer_reference.cpp)
target_link_libraries(test_layer_reference PRIVATE diffcp diffcp_testing GTest::gtest_main)
gtest_discover_tests(test_layer_reference DISCOVERY_TIMEOUT 60 TEST_PREFIX "test_layer_reference." PROPERTIES LABELS unit)

diffcp_add_mpi_test(test_splitkv_layer cp/test_splitkv_layer.cpp)
diffcp_add_mpi_test(test_redistribute cp/test_redistribute.cpp)

# ---- CLI: `diffcp attn --check` at several P; bad input is refused clearly on every rank ----
foreach(np 1 2 3 4)
  add_test(NAME cli_attn_check_np${np} COMMAND ${RUN_OK} ${MPIRUN} ${np} $<TARGET_FILE:diffcp_cli> attn --check --json --reps 1)
  set_tests_properties(cli_attn_check_np${np} PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120
                       PASS_REGULAR_EXPRESSION "\"check_passed\":true")
endforeach()
# A sliding-window layer (issue #36) through the CLI: Split-KV over an LPT plan of the window's work.
add_test(NAME cli_attn_window_check COMMAND ${RUN_OK} ${MPIRUN} 3 $<TARGET_FILE:diffcp_cli> attn --check --json --reps 1
         --window 100 --balancer lpt)
set_tests_properties(cli_attn_window_check PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120
                     PASS_REGULAR_EXPRESSION "\"check_passed\":true")
diffcp_add_fail_test(cli_attn_bad_window "--window = -2, expected 1 .. 2\\^40" $<TARGET_FILE:diffcp_cli> attn --window -2)
# bf16 Split-KV (--check applies kTolBf16Layer: 2^-6 of each tensor's peak) at P = 3, oproj owned.
# The JSON reports what it judged by (issue #41): the tolerance, max_tol_ratio <= 1, and a
# scale-relative max_rel_err (max |d| / max |ref|: far below 1, not an elementwise ratio of
# near-zero values, which printed 4509 here beside check_passed).
add_test(NAME cli_attn_bf16_check COMMAND ${RUN_OK} ${JSON_CHECK}
         "j['check_passed'] is True" "j['mismatches'] == 0" "j['tolerance'] == {'atol': 2**-6, 'rtol': 0.0, 'atol_scale': 'max(1, max|ref|) of each tensor'}"
         "0 < j['max_tol_ratio'] <= 1" "0 < j['max_rel_err'] < 2**-6"
         -- ${MPIRUN} 3 $<TARGET_FILE:diffcp_cli> attn --dtype bf16 --check --json --reps 1 --oproj owned)
set_tests_properties(cli_attn_bf16_check PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120
                     PASS_REGULAR_EXPRESSION "json_check: passed")
# bf16 LV-XAttn (mixed-dtype packed messages) through the CLI at P = 3.
add_test(NAME cli_attn_bf16_lvxattn COMMAND ${RUN_OK} ${MPIRUN} 3 $<TARGET_FILE:diffcp_cli> attn --dtype bf16 --method lvxattn
                                            --check --json --reps 1 --queries 96 --context 600)
set_tests_properties(cli_attn_bf16_lvxattn PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120
                     PASS_REGULAR_EXPRESSION "\"check_passed\":true")
add_test(NAME cli_attn_dump COMMAND ${RUN_OK} ${MPIRUN} 2 $<TARGET_FILE:diffcp_cli> attn --reps 1 --queries 64 --context 300
                                    --dump ${CMAKE_CURRENT_BINARY_DIR}/attn_dump)
set_tests_properties(cli_attn_dump PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120
                     PASS_REGULAR_EXPRESSION "wrote .npy files and meta.json")
set(ATTN ${MPIRUN} 2 $<TARGET_FILE:diffcp_cli> attn)
diffcp_add_fail_test(cli_attn_queries_not_multiple "--queries = 100 per sample is not a multiple of --block = 16" ${ATTN} --queries 100)
diffcp_add_fail_test(cli_attn_too_many_anchors "anchors per sample = 512 exceeds the 369 response positions" ${ATTN} --context 512 --queries 8k)
diffcp_add_fail_test(cli_attn_bad_gqa "n_q = 6 is not a multiple of n_kv = 4" ${ATTN} --n-q 6 --n-kv 4)
diffcp_add_fail_test(cli_attn_unknown_dtype "--dtype = 'fp8': expected f32 or bf16" ${ATTN} --dtype fp8)
diffcp_add_fail_test(cli_attn_bad_size "--context = '12q': expected a non-negative count" ${ATTN} --context 12q)
diffcp_add_fail_test(cli_attn_block_zero "--block = 0, expected >= 1" ${ATTN} --block 0)
diffcp_add_fail_test(cli_attn_bad_oproj "--oproj = 'rows': expected all, owned or auto" ${ATTN} --oproj rows)
diffcp_add_fail_test(cli_attn_bad_collectives "collective algorithm 'ring': expected flat or hierarchical" ${ATTN} --collectives ring)
diffcp_add_fail_test(cli_attn_bad_link_gbit "--link-gbit = -1, expected >= 0" ${ATTN} --oproj auto --link-gbit -1)
diffcp_add_fail_test(cli_attn_unwritable_dump "--dump '/proc/diffcp_nope': cannot create or write" ${ATTN} --dump /proc/diffcp_nope)
diffcp_add_fail_test(cli_attn_negative_samples "samples = -1, expected >= 1" $<TARGET_FILE:diffcp_cli> attn --samples -1)
foreach(balancer zigzag lpt partition)
  add_test(NAME cli_attn_${balancer}_np3 COMMAND ${RUN_OK} ${MPIRUN} 3 $<TARGET_FILE:diffcp_cli> attn --check --json --reps 1
                                                  --balancer ${balancer} --J 4 --context 512:2k --bucket 512)
  set_tests_properties(cli_attn_${balancer}_np3 PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120
                       PASS_REGULAR_EXPRESSION "\"check_passed\":true")
endforeach()
diffcp_add_fail_test(cli_attn_unknown_balancer "unknown balancer 'best'" ${ATTN} --balancer best)

# ---- CLI: `diffcp plan` (no MPI) ----
add_test(NAME cli_plan_json COMMAND ${RUN_OK} $<TARGET_FILE:diffcp_cli> plan --balancer lpt --P 8 --J 16 --samples 4 --context 64k --json)
set_tests_properties(cli_plan_json PROPERTIES PASS_REGULAR_EXPRESSION "\"balancer\":\"lpt\".*\"imbalance_pct\":0\\.[0-9]")
# Every balancer's plan: one row each, the context covered once in order by its chunks on ranks
# 0..P-1, the same total work, and LPT the most even (issue #37: numbers, not a line of text).
add_test(NAME cli_plan_all COMMAND ${JSON_CHECK}
         "[r['balancer'] for r in j] == ['none', 'zigzag', 'lpt', 'partition']" "all(r['P'] == 4 for r in j)"
         "all([c['start'] for c in sorted(r['chunks'], key=lambda c: c['start'])] == [0] + [c['end'] for c in sorted(r['chunks'], key=lambda c: c['start'])][:-1] for r in j)"
         "len({max(c['end'] for c in r['chunks']) for r in j}) == 1" "all(0 <= c['rank'] < 4 for r in j for c in r['chunks'])"
         "len({sum(r['rank_work']) for r in j}) == 1" "min(j, key=lambda r: r['imbalance_pct'])['balancer'] == 'lpt'"
         "all(abs(100 * (max(r['rank_work']) * 4 / sum(r['rank_work']) - 1) - r['imbalance_pct']) < 1e-6 for r in j)"
         -- $<TARGET_FILE:diffcp_cli> plan --balancer all --P 4 --J 4 --context 8k:16k --json)
set_tests_properties(cli_plan_all PROPERTIES PASS_REGULAR_EXPRESSION "json_check: passed")
diffcp_add_fail_test(cli_plan_bad_J "J = 0, expected >= 1" $<TARGET_FILE:diffcp_cli> plan --J 0)
diffcp_add_fail_test(cli_plan_too_many_chunks "chunks exceed the" $<TARGET_FILE:diffcp_cli> plan --context 100 --queries 16 --P 8 --J 16 --samples 1)
diffcp_add_fail_test(cli_plan_missing_file "--anchors-file '/nonexistent.json': cannot read" $<TARGET_FILE:diffcp_cli> plan --anchors-file /nonexistent.json)
diffcp_add_fail_test(cli_plan_bad_range "--context = '9k:2k': the range's end is below its start" $<TARGET_FILE:diffcp_cli> plan --context 9k:2k)
diffcp_add_fail_test(cli_plan_bad_windows "--windows = 'w2': expected a non-negative count" $<TARGET_FILE:diffcp_cli> plan --windows 2048,w2)
diffcp_add_mpi_test(test_cp_methods cp/test_cp_methods.cpp)
diffcp_add_mpi_test(test_cp_guard cp/test_cp_guard.cpp)
diffcp_add_guard_async_test(test_cp_guard 3 4)



# ---- CLI: `diffcp bench cp` (the CP methods side by side) and `diffcp attn --method` ----
# Every method's row must pass the fp64 check; at P = 4 Ulysses cannot serve n_kv = 2 and must be
# a {"supported": false} row with its reason (under --methods all). Rows are in cp_methods()
# order with "check_passed" before the nested "bytes", so [^{}]* stays inside one row.
set(CP_ROW_OK "[^{}]*\"supported\":true[^{}]*\"check_passed\":true")
add_test(NAME cli_bench_cp_all_np2 COMMAND ${RUN_OK} ${MPIRUN} 2 $<TARGET_FILE:diffcp_cli> bench cp --methods all --check --json --reps 1)
set_tests_properties(cli_bench_cp_all_np2 PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120
  PASS_REGULAR_EXPRESSION "\"method\":\"splitkv\"${CP_ROW_OK}.*\"method\":\"ulysses\"${CP_ROW_OK}.*\"method\":\"ring\"${CP_ROW_OK}.*\"method\":\"ringx\"${CP_ROW_OK}.*\"method\":\"lvxattn\"${CP_ROW_OK}"
  FAIL_REGULAR_EXPRESSION "\"check_passed\":(false|null)")
add_test(NAME cli_bench_cp_all_np4 COMMAND ${RUN_OK} ${MPIRUN} 4 $<TARGET_FILE:diffcp_cli> bench cp --methods all --check --json --reps 1)
set_tests_properties(cli_bench_cp_all_np4 PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120
  PASS_REGULAR_EXPRESSION "\"method\":\"splitkv\"${CP_ROW_OK}.*\"method\":\"ulysses\",\"P\":4,\"supported\":false,\"reason\":\"ulysses: P = 4 ranks do not divide n_kv = 2[^{}]*}.*\"method\":\"ring\"${CP_ROW_OK}.*\"method\":\"ringx\"${CP_ROW_OK}.*\"method\":\"lvxattn\"${CP_ROW_OK}"
  FAIL_REGULAR_EXPRESSION "\"check_passed\":(false|null)")
add_test(NAME cli_bench_cp_text_csv COMMAND ${RUN_OK} ${MPIRUN} 2 $<TARGET_FILE:diffcp_cli> bench cp --methods lvxattn,splitkv --check
                                           --reps 1 --layout-for-all zigzag --csv ${CMAKE_CURRENT_BINARY_DIR}/bench_cp.csv)
set_tests_properties(cli_bench_cp_text_csv PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120
  PASS_REGULAR_EXPRESSION "lvxattn +zigzag [^\n]*PASSED\n +splitkv +zigzag [^\n]*PASSED\n +wrote [^\n]*bench_cp.csv"
  FAIL_REGULAR_EXPRESSION "FAILED")
foreach(method ring ringx lvxattn)
  add_test(NAME cli_attn_method_${method}_np3 COMMAND ${RUN_OK} ${MPIRUN} 3 $<TARGET_FILE:diffcp_cli> attn --method ${method} --check --json --reps 1
                                                     --balancer zigzag)
  set_tests_properties(cli_attn_method_${method}_np3 PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120
                       PASS_REGULAR_EXPRESSION "\"check_passed\":true.*\"method\":\"${method}\"")
endforeach()
add_test(NAME cli_attn_method_ulysses_np2 COMMAND ${RUN_OK} ${MPIRUN} 2 $<TARGET_FILE:diffcp_cli> attn --method ulysses --check --json --reps 1)
set_tests_properties(cli_attn_method_ulysses_np2 PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120
                     PASS_REGULAR_EXPRESSION "\"check_passed\":true.*\"method\":\"ulysses\"")
set(BENCH_CP3 ${MPIRUN} 3 $<TARGET_FILE:diffcp_cli> bench cp)
diffcp_add_fail_test(cli_bench_cp_unknown_method "unknown CP method 'flash', expected one of splitkv, ulysses, ring, ringx, lvxattn"
                     ${BENCH_CP3} --methods splitkv,flash)
diffcp_add_fail_test(cli_attn_unknown_method "unknown CP method 'flash', expected one of splitkv, ulysses, ring, ringx, lvxattn"
                     ${ATTN} --method flash)
diffcp_add_fail_test(cli_bench_cp_ulysses_unsupported_p
                     "--methods ulysses: ulysses: P = 3 ranks do not divide n_kv = 2 kv heads .*use --methods all to list it as unsupported"
                     ${BENCH_CP3} --methods ulysses --n-kv 2)
diffcp_add_fail_test(cli_attn_ulysses_unsupported_p "--method ulysses: ulysses: P = 3 ranks do not divide n_kv = 2"
                     ${MPIRUN} 3 $<TARGET_FILE:diffcp_cli> attn --method ulysses --n-kv 2)
diffcp_add_fail_test(cli_bench_cp_negative_reps "--reps = -1, expected >= 1" ${BENCH_CP3} --reps -1)
diffcp_add_fail_test(cli_bench_cp_bad_gqa "n_q = 6 is not a multiple of n_kv = 4" ${BENCH_CP3} --n-q 6 --n-kv 4)
diffcp_add_fail_test(cli_bench_cp_twice "--methods = 'ring,ring': 'ring' is listed twice" ${BENCH_CP3} --methods ring,ring)
diffcp_add_fail_test(cli_bench_cp_unknown_layout "unknown balancer 'best'" ${BENCH_CP3} --layout-for-all best)
diffcp_add_fail_test(cli_bench_cp_unwritable_csv "--csv '/proc/diffcp_nope.csv': cannot open this file for writing"
                     ${BENCH_CP3} --csv /proc/diffcp_nope.csv)
