#!/usr/bin/env bash
# The main job: build halo, then run the halo-exchange benchmark with 4 local
# ranks over a small sweep of halo sizes, checking every result, printing the
# nccl-tests-style table and writing a plot. Extra arguments go to halod bench.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
mkdir -p bench/out
exec build/bin/halod bench --local 4 --min-bytes 8 --max-bytes 1M --op both --check \
  --plot bench/out/quickstart.png --json bench/out/quickstart.json "$@"
