#!/usr/bin/env bash
# Every test: Go unit tests, the rendezvous fuzzer (briefly), the C tests over
# real processes, the C++ find_package and pkg-config builds, the PyTorch
# bindings (several groups, the wheel in a venv), halod and halocp under
# torchrun and mpirun, and ranks on four network namespaces (as root), all
# through ctest. A test whose tool is missing says so and is skipped.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
export PATH="$PATH:/usr/local/go/bin"
exec ctest --test-dir build --output-on-failure "$@"
