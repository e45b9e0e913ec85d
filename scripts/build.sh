#!/usr/bin/env bash
# Install the dependencies (if missing) and build the release preset. Used by both README commands.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
cmake --preset release >/dev/null
cmake --build --preset release
