# tests/project: the project as a user gets it: install, Python package, README tour, bitwise golden, fuzzing.
# Included by tests/CMakeLists.txt (one directory scope: its variables, functions and the
# label pass at its end apply); ${CMAKE_CURRENT_SOURCE_DIR} is tests/.
# Crashes the fuzz targets (fuzz/) found, as regression tests; parse_count / parse_range live in
# the CLI's options.cpp.
add_executable(test_parsers_fuzzed project/test_parsers_fuzzed.cpp ${PROJECT_SOURCE_DIR}/src/cli/options.cpp)
target_link_libraries(test_parsers_fuzzed PRIVATE diffcp diffcp_testing CLI11::CLI11 GTest::gtest_main)
target_include_directories(test_parsers_fuzzed PRIVATE ${PROJECT_SOURCE_DIR}/src)
gtest_discover_tests(test_parsers_fuzzed DISCOVERY_TIMEOUT 60 TEST_PREFIX "test_parsers_fuzzed." PROPERTIES LABELS fuzz)

# ---- issue #51: the CPU results of every CP method, the DiT and the train step, bit for bit
# against the hashes recorded before the compute seam's refactor (skips, saying so, on a machine
# whose kernels have none recorded) ----
add_test(NAME bitwise_golden COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/project/bitwise_golden.sh $<TARGET_FILE:diffcp_cli> check)
set_tests_properties(bitwise_golden PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV};DIFFCP_BUILD_KEY=${CMAKE_BUILD_TYPE}"
                     TIMEOUT 900 SKIP_RETURN_CODE 77 LABELS "golden;mpi")

# ---- the installed package (issue #15): cmake --install, then examples/cpp built against it with
# find_package(diffcp) and with pkg-config, run at P = 2 ----
add_test(NAME install_consumer COMMAND ${RUN_OK} ${CMAKE_CURRENT_SOURCE_DIR}/project/install_consumer.sh ${PROJECT_BINARY_DIR}
         ${PROJECT_SOURCE_DIR} ${CMAKE_INSTALL_LIBDIR})
set_tests_properties(install_consumer PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 300 LABELS install
                     PASS_REGULAR_EXPRESSION "install_consumer: passed")

# ---- the Python package (issue #15): pytest on the in-tree build, and `pip install .` into a venv ----
if(DIFFCP_BUILD_PYTHON)
  add_test(NAME python_pytest COMMAND ${DIFFCP_PYTHON} -m pytest -q -p no:cacheprovider ${PROJECT_SOURCE_DIR}/python/tests)
  set_tests_properties(python_pytest PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV};PYTHONPATH=${PROJECT_BINARY_DIR}/python"
                       TIMEOUT 300 LABELS python)
  # python/tests_mpi at P ranks: diffcp.SplitKV over mpi4py equals the same layer single-process;
  # diffcp.diffusers' parallelized FLUX forward equals the NumPy float64 reference (P = 3: uneven shards).
  foreach(np 1 2 3 4)
    add_test(NAME python_mpi_np${np} COMMAND ${MPIRUN} ${np} ${DIFFCP_PYTHON} -m pytest -q -p no:cacheprovider
             ${PROJECT_SOURCE_DIR}/python/tests_mpi)
    set_tests_properties(python_mpi_np${np} PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV};PYTHONPATH=${PROJECT_BINARY_DIR}/python"
                         TIMEOUT 300 LABELS "python;mpi")
  endforeach()
  # python -m diffcp.serve at P = 2 driven by the openai client (issue #68): equal to the in-process
  # pipeline, batching, bad input, queue full, cancel, shutdown, a failed rank (serve_check.py).
  add_test(NAME python_serve COMMAND ${RUN_OK} ${CMAKE_CURRENT_SOURCE_DIR}/project/serve_check.sh ${DIFFCP_PYTHON}
           ${PROJECT_BINARY_DIR} ${MPIRUN})
  set_tests_properties(python_serve PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 300 LABELS "python;mpi"
                       PASS_REGULAR_EXPRESSION "serve_check: passed")
  # diffcp.data (issue #71): chat templates, loss masks, length policy, regeneration in process and over
  # HTTP (a stub OpenAI server on loopback), a killed run resumed, bad input; transformers from PyPI.
  add_test(NAME python_data COMMAND ${RUN_OK} ${CMAKE_CURRENT_SOURCE_DIR}/project/data_check.sh ${DIFFCP_PYTHON}
           ${PROJECT_BINARY_DIR})
  set_tests_properties(python_data PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 300 LABELS python
                       PASS_REGULAR_EXPRESSION "data_check: passed")
  # The examples run (the balance study without its plot: matplotlib is not a dependency).
  add_test(NAME python_examples COMMAND ${RUN_OK} sh -c "'${DIFFCP_PYTHON}' '${PROJECT_SOURCE_DIR}/examples/python/train_loop_plan.py' --steps 2 && '${DIFFCP_PYTHON}' '${PROJECT_SOURCE_DIR}/examples/python/balance_study.py' --no-plot --P 2 8 --seeds 1")
  set_tests_properties(python_examples PROPERTIES ENVIRONMENT "PYTHONPATH=${PROJECT_BINARY_DIR}/python" TIMEOUT 60
                       LABELS python PASS_REGULAR_EXPRESSION "step 1: .*imbalance lpt.*\n.*P +none +zigzag +lpt")
  # Builds the library again in build/pip (scikit-build-core; incremental afterwards): minutes.
  add_test(NAME python_pip_install COMMAND ${RUN_OK} ${CMAKE_CURRENT_SOURCE_DIR}/project/pip_install.sh ${PROJECT_SOURCE_DIR}
           ${PROJECT_BINARY_DIR}/pip-venv)
  set_tests_properties(python_pip_install PROPERTIES ENVIRONMENT "${DIFFCP_MPI_ENV}" TIMEOUT 1500 LABELS python
                       PASS_REGULAR_EXPRESSION "pip_install: passed")
endif()

# ---- fuzzing (fuzz/) ----
# libFuzzer targets (ASan + UBSan) for every parser of outside data, built by clang++ as a separate
# project (fuzz/CMakeLists.txt) into <build>/fuzz, seeds in <build>/fuzz/seeds/<target>. Each gets
# a bounded, fixed-seed smoke run (label `fuzz`, ~2 min in all on 2 cores); scripts/fuzz.sh runs
# them longer. See fuzz/README.md.
include(ExternalProject)
find_program(DIFFCP_CLANGXX NAMES clang++ clang++-14)
find_program(DIFFCP_LLD NAMES ld.lld ld.lld-14)
if(NOT DIFFCP_CLANGXX OR NOT DIFFCP_LLD)
  message(FATAL_ERROR "the fuzz targets (fuzz/) need clang++ with libFuzzer and lld (Debian: clang libclang-rt-14-dev lld): "
                      "run scripts/install_deps.sh")
endif()
set(DIFFCP_FUZZ_JOBS 1 CACHE STRING "Parallel jobs of the fuzz/ build (it runs beside the main build)")
set(DIFFCP_FUZZ_BIN ${CMAKE_BINARY_DIR}/fuzz)
ExternalProject_Add(diffcp_fuzz
  SOURCE_DIR ${PROJECT_SOURCE_DIR}/fuzz
  BINARY_DIR ${DIFFCP_FUZZ_BIN}
  CMAKE_ARGS -DCMAKE_CXX_COMPILER=${DIFFCP_CLANGXX} -DCMAKE_BUILD_TYPE=RelWithDebInfo
  BUILD_COMMAND ${CMAKE_COMMAND} --build <BINARY_DIR> -j ${DIFFCP_FUZZ_JOBS}
  BUILD_ALWAYS TRUE  # it compiles files of src/: let its own build decide what changed
  INSTALL_COMMAND "")
# target, runs, seconds cap (the runs take ~15 s each here; the cap bounds a slower machine)
set(DIFFCP_FUZZ_SMOKE
  safetensors 60000 25  npy 150000 25  anchors 60000 25  checkpoint 60000 25
  dit_weights 12000 25  shards 40000 25  cli_args 250000 25  diffusers_config 60000 25)
while(DIFFCP_FUZZ_SMOKE)
  list(POP_FRONT DIFFCP_FUZZ_SMOKE target runs secs)
  set(dict ${PROJECT_SOURCE_DIR}/fuzz/diffcp.dict)
  if(target STREQUAL "cli_args")
    set(dict "")
  endif()
  add_test(NAME fuzz_smoke_${target}
           COMMAND ${PROJECT_SOURCE_DIR}/fuzz/smoke.sh ${DIFFCP_FUZZ_BIN}/fuzz_${target} ${DIFFCP_FUZZ_BIN}/seeds/${target}
                   ${CMAKE_CURRENT_BINARY_DIR}/fuzz_smoke/${target} ${runs} ${secs} ${dict})
  set_tests_properties(fuzz_smoke_${target} PROPERTIES LABELS fuzz TIMEOUT 120)
endwhile()

# ---- bench/RESULTS.md: one page (<= 300 lines) whose tables equal what bench/results_tables.py makes
# of the committed CSVs ----
add_test(NAME results_tables COMMAND ${DIFFCP_PYTHON} ${PROJECT_SOURCE_DIR}/bench/results_tables.py --check)
set_tests_properties(results_tables PROPERTIES LABELS cli TIMEOUT 60)
