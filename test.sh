#!/usr/bin/env bash
# Every test: Go unit tests, the rendezvous fuzzer (briefly), the C tests over
# real processes, the C++ find_package build, the PyTorch bindings and the
# halod smoke tests, all through ctest.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
export PATH="$PATH:/usr/local/go/bin"
exec ctest --test-dir build --output-on-failure "$@"
