#!/usr/bin/env bash
# serve_check.sh PYTHON BUILD_DIR MPIRUN...: serve_check.py with the `openai` client from PyPI, in a
# venv over the system's packages (numpy, torch, mpi4py) kept in BUILD_DIR/serve-venv; the stand-in
# folders of the four families made by tools/<family>_reference.py.
set -euo pipefail
py=$1 build=$2
shift 2
src=$(cd "$(dirname "$0")/../.." && pwd)
venv=$build/serve-venv
if ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
  rm -rf "$venv"
  "$py" -m venv --system-site-packages "$venv"
  "$venv/bin/pip" install --disable-pip-version-check -q openai
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" "$src/tools/flux_reference.py" make --out "$tmp/flux1" --format diffusers --heads 4 --hidden 64 --depth 1 \
  --depth-single 2 >/dev/null
for family in sd3 qwenimage flux2; do
  "$py" "$src/tools/${family}_reference.py" make --out "$tmp/$family" >/dev/null
done
PYTHONPATH="$build/python:$src/python/tests_mpi" "$venv/bin/python" "$src/tests/project/serve_check.py" \
  "$tmp/flux1" "$tmp/sd3" "$tmp/qwenimage" "$tmp/flux2" "$@" 2
