#!/usr/bin/env bash
# The first run: build halo (installing what it needs), then, in a minute or
# two on a small machine:
#   1. halod bench: the halo exchange between N ranks on this machine (one
#      per CPU, 2 to 4), halos of 16 B to 1 MiB per side, forward and
#      backward, every value checked, beside ucx_perftest's tag_lat and
#      tag_bw at the same sizes; a table, bench/out/quickstart.png and .json;
#   2. bench/torch_bench.py: halocp against a plain torch.distributed
#      implementation of the same exchange, in the same processes, forward
#      and backward, the results compared bit for bit.
# Extra arguments go to halod bench (e.g. ./run.sh --local 4).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
mkdir -p bench/out

# No more ranks than CPUs: ranks that share a CPU measure the scheduler.
cpus=$(nproc)
ranks=$((cpus < 2 ? 2 : cpus > 4 ? 4 : cpus))
echo "== 1/2  halod bench: halo between $ranks ranks on this machine, beside ucx_perftest"
build/bin/halod bench --local "$ranks" --min-bytes 16 --max-bytes 1M --step-factor 4 --op both --check \
	--compare-perftest --plot bench/out/quickstart.png --json bench/out/quickstart.json --log-format console "$@"
echo
echo "== 2/2  halocp against torch.distributed (gloo): 2 ranks, forward + backward, checked bit for bit"
.venv/bin/python bench/torch_bench.py --json bench/out/torch_bench.json
echo
echo "== wrote bench/out/quickstart.png, bench/out/quickstart.json and bench/out/torch_bench.json"
