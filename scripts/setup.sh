#!/usr/bin/env bash
# Installs what halo needs on a Debian machine (when missing) and builds it.
# Used by run.sh, test.sh and CI; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# Build: UCX, CMake, a C/C++ compiler. Tests and run.sh: PyTorch and pytest;
# venv, pip, setuptools and wheel (halocp's wheel); Open MPI's mpirun and
# torchrun (the launcher tests), and its mpicc (bench/mpi_halo.c, the MPI peer
# of bench/core.sh); iproute2 (network namespaces).
packages=(libucx-dev ucx-utils cmake pkg-config gcc g++ make
  python3-torch python3-pytest python3-numpy python3-venv python3-pip python3-setuptools python3-wheel
  openmpi-bin libopenmpi-dev iproute2)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
fi

# Go 1.26 or newer (the machine's toolchain; Debian's golang is older).
export PATH="$PATH:/usr/local/go/bin"
if ! command -v go >/dev/null; then
  echo "error: Go 1.26 or newer is required (https://go.dev/dl), not found on PATH or in /usr/local/go/bin" >&2
  exit 1
fi
minor=$(go env GOVERSION | sed -E 's/^go1\.([0-9]+).*/\1/')
if [ "${minor:-0}" -lt 26 ]; then
  echo "error: Go 1.26 or newer is required, found $(go env GOVERSION)" >&2
  exit 1
fi

cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc)"
