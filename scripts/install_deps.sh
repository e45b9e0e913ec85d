#!/usr/bin/env bash
# Installs diffcp's build and run dependencies from Debian's packages (idempotent; skips apt when
# everything is already installed). Needs root (or sudo) on Debian 12.
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config
      libopenmpi-dev openmpi-bin libdnnl-dev
      libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev libmetis-dev)
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
