#!/usr/bin/env bash
# install_deps.sh [run|all]: installs from Debian 12's packages, on a machine that has only Debian's
# minimal base (checked by scripts/check_fresh_machine.sh), what building and running the diffcp
# program needs (run: command 1) or everything the build, the tests and the scripts need (all, the
# default: command 2). Idempotent: skips apt when everything is already installed. Needs root (or sudo).
set -euo pipefail
set_=${1:-all}
[ "$set_" = run ] || [ "$set_" = all ] || { echo "install_deps.sh: '$set_': expected run or all" >&2; exit 2; }
pkgs=(build-essential cmake ninja-build pkg-config
      libopenmpi-dev openmpi-bin
      # Debian's libdnnl-dev is built with the OpenCL GPU runtime: its CMake config runs
      # find_package(OpenCL REQUIRED), so the OpenCL loader and headers are build dependencies.
      libdnnl-dev ocl-icd-opencl-dev
      libcli11-dev nlohmann-json3-dev libmetis-dev)
test_pkgs=(
      libgtest-dev libgmock-dev libbenchmark-dev
      # scripts/emucluster.sh (emulated hosts: ip, tc; unshare, taskset; jq reads its profiles)
      iproute2 util-linux procps jq
      # fuzz/ (libFuzzer targets built with clang, ASan + UBSan, linked by lld)
      clang libclang-rt-14-dev lld
      # tools/dflash_reference.py (the numpy check of the DFlash format, tests/drafter/dflash_numpy_check.sh)
      python3-numpy
      # the Python package (python/: pybind11 extension, pytest suite, `pip install .` in a venv;
      # pip fetches the build backend from PyPI over HTTPS, which needs the CA bundle)
      python3-dev pybind11-dev python3-pytest python3-venv python3-mpi4py ca-certificates
      # diffcp.torch (the autograd Function) and its tests: Debian's CPU build of PyTorch
      python3-torch)
[ "$set_" = run ] || pkgs+=("${test_pkgs[@]}")
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "install_deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
