#!/usr/bin/env bash
# pip_install.sh SOURCE_DIR VENV_DIR: what the README promises after command 1 — `pip install .`
# (PEP 517, scikit-build-core + pybind11 from PyPI in pip's isolated build env) into a venv made
# with --system-site-packages (Debian's numpy and pytest), then the pytest suite against the
# installed package, run from outside the source tree.
set -euo pipefail
src=$1 venv=$2
py=${DIFFCP_PYTHON:-python3}
fail() { echo "pip_install: FAIL: $*"; exit 1; }
rm -rf "$venv" "$venv.pip.log"
"$py" -m venv --system-site-packages "$venv" || fail "python3 -m venv (Debian package python3-venv)"
if ! "$venv/bin/pip" install --disable-pip-version-check -q "$src" >"$venv.pip.log" 2>&1; then
  tail -n 25 "$venv.pip.log"
  fail "pip install $src: $(grep -m1 -E 'Error|error:|ERROR' "$venv.pip.log" || tail -n1 "$venv.pip.log")"
fi
cd "$venv"
"$venv/bin/python" -c "import diffcp, os; assert os.path.dirname(diffcp.__file__).startswith('$venv'), diffcp.__file__" \
  || fail "diffcp imported from outside the venv"
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$src/python/tests" || fail "pytest on the installed package"
# the console script (diffcp.data): its help, and bad input's exit status 2 with the message
"$venv/bin/diffcp-data" tokenize --help >/dev/null || fail "diffcp-data --help"
printf '{"messages": []}\n' >"$venv/empty.jsonl"
set +e
msg=$("$venv/bin/diffcp-data" regenerate "$venv/empty.jsonl" --out "$venv/o.jsonl" --model m --server http://127.0.0.1:9 2>&1)
rc=$?
set -e
[ "$rc" = 2 ] && [[ "$msg" == *"an empty conversation"* ]] || fail "diffcp-data on bad input: exit $rc, '$msg'"
echo "pip_install: passed"
