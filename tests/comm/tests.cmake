# tests/comm: communicators (MPI, rendezvous, NCCL), hierarchical groups, one rank's error, the watchdog.
# Included by tests/CMakeLists.txt (one directory scope: its variables, functions and the
# label pass at its end apply); ${CMAKE_CURRENT_SOURCE_DIR} is tests/.
# ---- multi-rank ----
diffcp_add_mpi_test(test_comm comm/test_comm.cpp)
diffcp_add_mpi_test(test_rendezvous comm/test_rendezvous.cpp)
# The transfer patterns of Ring's backward and LV-XAttn's forward before issue #65 hang on NCCL's
# semantics at P >= 3 (the rendezvous communicator; the watchdog names the stuck receive); the
# per-hop pattern that replaced them completes and delivers at every P.
add_executable(rendezvous_helper comm/rendezvous_helper.cpp)
target_link_libraries(rendezvous_helper PRIVATE diffcp)
foreach(np 3 4)
  foreach(old ring_backward_old lvxattn_forward_old)
    diffcp_add_fail_test(rendezvous_${old}_hangs_np${np} "watchdog: recv from rank [0-9]+ on communicator 'world'.*did not complete within 2 s"
                         ${MPIRUN} ${np} $<TARGET_FILE:rendezvous_helper> 2 ${old})
  endforeach()
endforeach()
# The CP suite on NCCL's semantics at P = 3 and 4 (DIFFCP_COMM=rendezvous: tests/mpi_test_main.cpp),
# and the commands that communicate (tests/rendezvous_check.sh).
foreach(np 3 4)
  add_test(NAME test_cp_methods_rendezvous_np${np} COMMAND ${MPIRUN} ${np} $<TARGET_FILE:test_cp_methods> --gtest_brief=1)
  set_tests_properties(test_cp_methods_rendezvous_np${np} PROPERTIES
                       ENVIRONMENT "${DIFFCP_MPI_ENV};DIFFCP_COMM=rendezvous;DIFFCP_COMM_TIMEOUT=120" TIMEOUT 400 LABELS mpi)
endforeach()
add_test(NAME test_tapa_rendezvous_np4 COMMAND ${MPIRUN} 4 $<TARGET_FILE:test_tapa>)
set_tests_properties(test_tapa_rendezvous_np4 PROPERTIES
                     ENVIRONMENT "${DIFFCP_MPI_ENV};DIFFCP_COMM=rendezvous;DIFFCP_COMM_TIMEOUT=120" TIMEOUT 300 LABELS mpi)
foreach(what attn bench dit train)
  add_test(NAME rendezvous_cli_${what} COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/comm/rendezvous_check.sh $<TARGET_FILE:diffcp_cli> ${what})
  set_tests_properties(rendezvous_cli_${what} PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 600 LABELS "mpi;cli")
endforeach()
foreach(np IN LISTS DIFFCP_TEST_RANKS)
  add_test(NAME rendezvous_hops_np${np} COMMAND ${MPIRUN} ${np} $<TARGET_FILE:rendezvous_helper> 30 hops)
  set_tests_properties(rendezvous_hops_np${np} PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120 LABELS mpi)
endforeach()
diffcp_add_mpi_test(test_hierarchical comm/test_hierarchical.cpp)
diffcp_add_mpi_test(test_comm_device comm/test_comm_device.cpp)

# The NCCL communicator (CUDA builds): at np 1 and 2; it needs one GPU per rank, and skips (saying
# why: no CUDA device, or ranks sharing one) where the machine has fewer.
if(DIFFCP_CUDA)
  add_executable(test_nccl_comm comm/test_nccl_comm.cpp)
  target_link_libraries(test_nccl_comm PRIVATE diffcp_mpi_test_main)
  foreach(np 1 2)
    add_test(NAME test_nccl_comm_np${np} COMMAND ${MPIRUN} ${np} $<TARGET_FILE:test_nccl_comm>)
    set_tests_properties(test_nccl_comm_np${np} PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 300 LABELS "mpi;cuda")
  endforeach()
endif()

# ---- one rank's error brings the whole job down, with its message, without a hang ----
add_executable(abort_helper comm/abort_helper.cpp)
target_link_libraries(abort_helper PRIVATE diffcp)
foreach(np 2 3 8)
  diffcp_add_fail_test(abort_on_one_rank_np${np} "error on rank 1 of ${np}: deliberate failure on rank 1"
                       ${MPIRUN} ${np} $<TARGET_FILE:abort_helper>)
endforeach()

# ---- the collective watchdog: a stalled (SIGSTOP), busy or silent rank ends the job with a message
# naming the operation and the ranks that had not arrived, within the timeout + a few seconds ----
add_executable(watchdog_helper comm/watchdog_helper.cpp)
target_link_libraries(watchdog_helper PRIVATE diffcp)
foreach(np 2 3 8)
  diffcp_add_fail_test(watchdog_stall_np${np}
    "watchdog: all_reduce #3 on communicator 'world' .*did not complete within 2 s.*not arrived: ranks? ([0-9]+, )*1[ ,]"
    ${MPIRUN} ${np} $<TARGET_FILE:watchdog_helper> 2 stall)
endforeach()
diffcp_add_fail_test(watchdog_busy_rank "watchdog: all_reduce #3 .*not arrived: rank 1 .*arrived and waiting in it too: rank 2"
                     ${MPIRUN} 3 $<TARGET_FILE:watchdog_helper> 2 sleep)
diffcp_add_fail_test(watchdog_recv "watchdog: recv from rank 1 on communicator 'world' .*receives 3.91 KiB.*not arrived: rank 1"
                     ${MPIRUN} 2 $<TARGET_FILE:watchdog_helper> 1 recv)
diffcp_add_fail_test(watchdog_hierarchical "watchdog: all_reduce #3 on communicator 'world' .*not arrived: rank 1"
                     ${MPIRUN} 4 $<TARGET_FILE:watchdog_helper> 2 hier)
add_test(NAME watchdog_huge_timeout COMMAND ${MPIRUN} 2 $<TARGET_FILE:watchdog_helper> 1e300 none)  # no overflow: never expires
set_tests_properties(watchdog_huge_timeout PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60 LABELS mpi)
diffcp_add_fail_test(watchdog_bad_env "DIFFCP_COMM_TIMEOUT = 'soon': expected a number of seconds"
                     ${CMAKE_COMMAND} -E env DIFFCP_COMM_TIMEOUT=soon ${MPIRUN} 2 $<TARGET_FILE:watchdog_helper> 0 env)
add_test(NAME watchdog_quiet COMMAND ${MPIRUN} 4 $<TARGET_FILE:watchdog_helper> 5 none)
set_tests_properties(watchdog_quiet PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60 LABELS mpi)
diffcp_add_fail_test(cli_bad_comm_timeout "--comm-timeout: '-1': expected a number of seconds >= 0"
                     $<TARGET_FILE:diffcp_cli> attn --comm-timeout -1)
diffcp_add_fail_test(cli_bad_comm_timeout_env "--comm-timeout: 'soon': expected a number of seconds >= 0"
                     ${CMAKE_COMMAND} -E env DIFFCP_COMM_TIMEOUT=soon $<TARGET_FILE:diffcp_cli> attn)
