# tests/cluster: the emulated cluster (network namespaces).
# Included by tests/CMakeLists.txt (one directory scope: its variables, functions and the
# label pass at its end apply); ${CMAKE_CURRENT_SOURCE_DIR} is tests/.
# ---- the emulated cluster (scripts/emucluster.sh; issue #11). Label `cluster`, in the default
# suite; needs root (network namespaces, veth, tc), as CI has. Serial: they measure bandwidth.
set(CLUSTER_CHECK ${CMAKE_CURRENT_SOURCE_DIR}/cluster/cluster_check.sh)
set(EMUCLUSTER ${PROJECT_SOURCE_DIR}/scripts/emucluster.sh)
foreach(topo 2x1 2x2)
  string(REPLACE "x" ";" nr ${topo})
  add_test(NAME cluster_check_${topo} COMMAND ${CLUSTER_CHECK} $<TARGET_FILE:diffcp_cli> ${nr} 0.2 1)
  set_tests_properties(cluster_check_${topo} PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 240
                       LABELS cluster RUN_SERIAL TRUE)
endforeach()
add_test(NAME cluster_faults COMMAND ${RUN_OK} ${CMAKE_CURRENT_SOURCE_DIR}/cluster/cluster_faults.sh $<TARGET_FILE:diffcp_cli>)
set_tests_properties(cluster_faults PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 300 LABELS cluster RUN_SERIAL TRUE
                     PASS_REGULAR_EXPRESSION "cluster_faults: passed")
# `diffcp sim` predicts a run it makes on the emulated cluster (issue #12).
add_test(NAME cluster_sim_prediction COMMAND ${RUN_OK} ${CMAKE_CURRENT_SOURCE_DIR}/sim/sim_cluster_check.sh $<TARGET_FILE:diffcp_cli> 40)
set_tests_properties(cluster_sim_prediction PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 300 LABELS cluster RUN_SERIAL TRUE
                     PASS_REGULAR_EXPRESSION "sim_cluster_check: passed")
add_test(NAME cluster_teardown COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/cluster/cluster_teardown.sh)
set_tests_properties(cluster_teardown PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 120 LABELS cluster RUN_SERIAL TRUE)
# TAPA's groups come from the emulated nodes (DIFFCP_NODE): L = 2, bitwise equal to flat.
add_test(NAME cluster_dit_tapa_2x2 COMMAND ${RUN_OK} ${EMUCLUSTER} run --nodes 2 --ranks-per-node 2 --inter-gbit 1 --intra-gbit 4
         -- $<TARGET_FILE:diffcp_cli> dit ${DIT_TINY} --mode tapa --group-size 0 --compare flat --json --out "")
set_tests_properties(cluster_dit_tapa_2x2 PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 240 LABELS cluster RUN_SERIAL TRUE
                     PASS_REGULAR_EXPRESSION "\"mode\":\"tapa\",\"P\":4,\"group_size\":2,.*\"max_abs_diff\":0\\.0[,}]")
diffcp_add_fail_test(cluster_unknown_profile "profile 'nope': no file" ${EMUCLUSTER} run --nodes 2 --ranks-per-node 1 --profile nope -- true)
diffcp_add_fail_test(cluster_bad_nodes "--nodes '0': expected 1..250" ${EMUCLUSTER} run --nodes 0 --ranks-per-node 1 --profile h100-ib -- true)
diffcp_add_fail_test(cluster_bad_profile_field "unknown field 'bogus'" ${EMUCLUSTER} run --nodes 2 --ranks-per-node 1
                     --profile ${CMAKE_CURRENT_SOURCE_DIR}/data/bad_profile.json -- true)
diffcp_add_fail_test(cluster_no_program "run: give the program after --" ${EMUCLUSTER} run --nodes 2 --ranks-per-node 1 --inter-gbit 1)
diffcp_add_fail_test(comm_node_env_partial "DIFFCP_NODE is set on 1 of 2 ranks"
                     ${MPIEXEC_EXECUTABLE} --oversubscribe -np 1 env DIFFCP_NODE=0 $<TARGET_FILE:diffcp_cli> bench p2p
                     : -np 1 $<TARGET_FILE:diffcp_cli> bench p2p)
diffcp_add_fail_test(comm_node_env_junk "DIFFCP_NODE = 'abc': expected a non-negative integer"
                     ${MPIEXEC_EXECUTABLE} --oversubscribe -np 2 env DIFFCP_NODE=abc $<TARGET_FILE:diffcp_cli> bench p2p)
# `diffcp bench coll`: each collective's bytes as rank 0 counts them (comm/communicator.hpp rules).
add_test(NAME cli_bench_coll_np3 COMMAND ${RUN_OK} ${MPIRUN} 3 $<TARGET_FILE:diffcp_cli> bench coll --bytes 12k --reps 2 --json)
set_tests_properties(cli_bench_coll_np3 PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 60 LABELS mpi
  PASS_REGULAR_EXPRESSION "\"bytes_sent_per_rank\":24576\\.0,\"collective\":\"all_gather\".*\"bytes_sent_per_rank\":24576\\.0,\"collective\":\"reduce_scatter\".*\"bytes_sent_per_rank\":16384\\.0,\"collective\":\"all_reduce\".*\"bytes_sent_per_rank\":8192\\.0,\"collective\":\"all_to_all\"")
diffcp_add_fail_test(cli_bench_p2p_one_rank "bench p2p needs at least 2 ranks" ${MPIRUN} 1 $<TARGET_FILE:diffcp_cli> bench p2p)
diffcp_add_fail_test(cli_bench_coll_too_small "--bytes = '4': at least 4 bytes \\(one f32\\) per destination rank" ${MPIRUN} 2 $<TARGET_FILE:diffcp_cli> bench coll --bytes 4)
