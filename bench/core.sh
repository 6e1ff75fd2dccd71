#!/bin/sh
# The core library's benchmark: forward and backward of a 2 KiB and a 2 MiB
# halo between W = 2 processes on shared memory, median and p99, printed
# beside ucx_perftest's tag_lat and tag_bw at the same sizes, measured by the
# same run, with the ratios. bench/PERFORMANCE.md says how the figures are
# obtained and how ours and ucx_perftest's compare; bench/RESULTS.md holds
# the figures measured so far and what they are held against.
#
#   bench/core.sh                    from the repository's root
#   HALOD=/path/to/halod bench/core.sh
#   DURATION=5s bench/core.sh        time budget per size and op (default 2s)
#   UCX_TLS=tcp,self bench/core.sh   another transport (default shm,self)
#
# Writes $OUT/core.json and $OUT/core.png (OUT defaults to bench/out).
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$root/bench/out}
DURATION=${DURATION:-2s}
UCX_TLS=${UCX_TLS:-shm,self}
export UCX_TLS

# The halod to run: $HALOD, the CMake build's, one on PATH, or one built now.
tmp=
cleanup() { [ -z "$tmp" ] || rm -rf "$tmp"; }
trap cleanup EXIT
if [ -z "${HALOD:-}" ]; then
	if [ -x "$root/build/bin/halod" ]; then
		HALOD=$root/build/bin/halod
	elif command -v halod >/dev/null 2>&1; then
		HALOD=$(command -v halod)
	else
		tmp=$(mktemp -d)
		echo "# building halod" >&2
		(cd "$root" && go build -o "$tmp/halod" ./daemon/cmd/halod)
		HALOD=$tmp/halod
	fi
fi
mkdir -p "$OUT"

status=0
"$HALOD" bench --local 2 \
	--min-bytes 2K --max-bytes 2M --step-factor 1024 --op both \
	--warmup 100 --duration "$DURATION" --min-iters 200 --max-iters 1000000 \
	--compare-perftest --progress off \
	--json "$OUT/core.json" --plot "$OUT/core.png" | tee "$OUT/core.txt" || status=$?
if [ "$status" -ne 0 ]; then
	echo "# halod bench failed (exit status $status)" >&2
	exit "$status"
fi

echo "# wrote $OUT/core.json and $OUT/core.png"
