#!/usr/bin/env bash
# data_check.sh PYTHON BUILD_DIR: python/tests_data (diffcp.data, issue #71) with transformers, tokenizers
# and jinja2 from PyPI (no torch: the tests build their tokenizer and stand in for the target), in a
# venv over the system's packages (numpy, pytest) kept in BUILD_DIR/data-venv.
set -euo pipefail
py=$1 build=$2
src=$(cd "$(dirname "$0")/../.." && pwd)
venv=$build/data-venv
if ! "$venv/bin/python" -c "import transformers, tokenizers, jinja2" 2>/dev/null; then
  rm -rf "$venv"
  "$py" -m venv --system-site-packages "$venv"
  "$venv/bin/pip" install --disable-pip-version-check -q transformers tokenizers jinja2
fi
PYTHONPATH="$build/python" "$venv/bin/python" -m pytest -q -p no:cacheprovider "$src/python/tests_data"
echo "data_check: passed"
