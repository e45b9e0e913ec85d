#!/usr/bin/env bash
# dflash_bad_hidden.sh DIFFCP MODEL_DIR WORK_DIR: `diffcp draft` with target hidden states of the
# wrong shape [5, 7] must fail with a message naming the expected shape (checked by expect_fail.sh).
set -euo pipefail
py=${DIFFCP_PYTHON:-python3}  # a python3 with numpy (tests/CMakeLists.txt)
mkdir -p "$3"
"$py" -c "import numpy as n, sys; n.save(sys.argv[1], n.zeros((5, 7), n.float32))" "$3/h57.npy"
exec mpirun -np 2 "$1" draft --model "$2" --target-hidden "$3/h57.npy" --noise-embedding "$3/h57.npy" --out "$3/o.npy"
