#!/usr/bin/env bash
# install_consumer.sh BUILD_DIR SOURCE_DIR [LIBDIR]: `cmake --install` into a fresh prefix, then build
# examples/cpp against it twice — with find_package(diffcp CONFIG) and with pkg-config — and run
# both at P = 2. Checks that the public headers are installed and the test-support ones are not.
set -euo pipefail
build=$1 src=$2 libdir=${3:-lib}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail() { echo "install_consumer: FAIL: $*"; exit 1; }
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null
[ -f "$prefix/include/diffcp/cp/splitkv.hpp" ] || fail "public header diffcp/cp/splitkv.hpp not installed"
[ ! -e "$prefix/include/diffcp/testing" ] || fail "test-support headers installed"
[ -x "$prefix/bin/diffcp" ] || fail "CLI not installed"
[ -f "$prefix/share/diffcp/profiles/h100-ib.json" ] || fail "profiles not installed"
log=$work/log
run() { "$@" >"$log" 2>&1 || { tail -n 30 "$log"; return 1; }; }
run cmake -S "$src/examples/cpp" -B "$work/cmake" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
  || fail "find_package(diffcp) project did not configure"
run cmake --build "$work/cmake" || fail "find_package(diffcp) project did not build"
pc=$(PKG_CONFIG_PATH="$prefix/$libdir/pkgconfig" pkg-config --cflags --libs diffcp) || fail "pkg-config diffcp"
# shellcheck disable=SC2086
run c++ -O2 "$src/examples/cpp/splitkv_layer.cpp" $pc -o "$work/pc_example" || fail "pkg-config build failed"
for exe in "$work/cmake/splitkv_layer" "$work/pc_example"; do
  out=$(mpirun -np 2 "$exe") || fail "$exe failed"
  echo "$out"
  [ "$(grep -c '^rank [01]/2: .* sent [1-9][0-9]* bytes' <<<"$out")" -eq 2 ] || fail "$exe: unexpected output"
done
echo "install_consumer: passed"
