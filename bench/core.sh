#!/bin/sh
# The core library's benchmark: forward and backward of a 2 KiB and a 2 MiB
# halo between W = 2 processes on shared memory, median and p99, printed
# beside ucx_perftest's tag_lat and tag_bw at the same sizes, measured by the
# same run, with the ratios; then a strided 2 MiB slab (64 runs of 32 KiB),
# and the same three exchanges done with Open MPI over UCX (bench/mpi_halo.c,
# MPI_Isend/MPI_Irecv and a plain add loop, when Open MPI is installed), with
# the ratio of its p50 to ours. bench/PERFORMANCE.md says how the figures are
# obtained and how ours and ucx_perftest's compare; bench/RESULTS.md holds
# the figures measured so far and what they are held against.
#
#   bench/core.sh                    from the repository's root
#   HALOD=/path/to/halod bench/core.sh
#   DURATION=5s bench/core.sh        time budget per size and op (default 2s)
#   UCX_TLS=tcp,self bench/core.sh   another transport (default shm,self)
#
# Writes $OUT/core.json, $OUT/core.png, $OUT/strided.json and $OUT/mpi.txt
# (OUT defaults to bench/out).
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

timing="--warmup 100 --duration $DURATION --min-iters 200 --max-iters 1000000"
status=0
"$HALOD" bench --local 2 \
	--min-bytes 2K --max-bytes 2M --step-factor 1024 --op both $timing \
	--compare-perftest --progress off \
	--json "$OUT/core.json" --plot "$OUT/core.png" | tee "$OUT/core.txt" || status=$?
if [ "$status" -ne 0 ]; then
	echo "# halod bench failed (exit status $status)" >&2
	exit "$status"
fi
# The strided slab: a (1, 64, 4, 1, 8192) shard along dim 2, one slice each side.
"$HALOD" bench --local 2 --shape 1x64x4x1x8192 --dim 2 --left 1 --right 1 --op both $timing \
	--progress off --json "$OUT/strided.json" >"$OUT/strided.txt" || status=$?
if [ "$status" -ne 0 ]; then
	echo "# halod bench --shape failed (exit status $status)" >&2
	exit "$status"
fi
echo "#"
echo "# strided: a (1, 64, 4, 1, 8192) float32 shard along dim 2, one slice each side (64 runs of 32 KiB); columns as above"
grep -v '^#' "$OUT/strided.txt"

# Open MPI doing the same exchanges (seconds per op as above).
secs=$(echo "$DURATION" | sed 's/s$//')
mpi_timing="--warmup 100 --duration $secs --min-iters 200 --max-iters 1000000"
: >"$OUT/mpi.txt"
for args in "--bytes 2048" "--bytes 2097152" "--shape 64x4x8192"; do
	status=0
	"$root/bench/mpi.sh" $args --op both $mpi_timing >>"$OUT/mpi.txt" || status=$?
	if [ "$status" -eq 77 ]; then
		echo "# Open MPI is not installed: no MPI comparison (Debian: openmpi-bin libopenmpi-dev)"
		echo "# wrote $OUT/core.json and $OUT/core.png"
		exit 0
	elif [ "$status" -ne 0 ]; then
		echo "# bench/mpi.sh $args failed (exit status $status)" >&2
		exit "$status"
	fi
done
echo "#"
echo "# Open MPI, the same exchanges: size count type op iters p50 p99 algbw #wrong (bench/mpi_halo.c)"
grep -v '^#' "$OUT/mpi.txt"

# Ours beside Open MPI's, row by row: the sweep's rows are contiguous, the
# --shape rows strided, in that order in both files.
echo "#"
echo "# against Open MPI ($(sed -n 's/^# mpi_halo: \([^,]*\),.*/\1/p' "$OUT/mpi.txt" | head -n 1), pml ucx, bench/mpi_halo.c), same run; ratio = MPI p50 / halo p50 (higher: halo faster)"
printf '# %8s %10s %4s %12s %12s %8s\n' slab size op "halo p50" "MPI p50" ratio
printf '# %8s %10s %4s %12s %12s %8s\n' "" "(B)" "" "(us)" "(us)" ""
grep -hv '^#' "$OUT/core.txt" "$OUT/strided.txt" >"$OUT/.halo_rows"
grep -v '^#' "$OUT/mpi.txt" | awk -v ours="$OUT/.halo_rows" '
	{ if ((getline row <ours) <= 0) exit 1; split(row, h)
	  if (h[1] != $1 || h[4] != $4) { print "# rows out of step: " row " | " $0; exit 1 }
	  printf "  %8s %10s %4s %12.2f %12.2f %7.2fx\n", (NR > 4 ? "strided" : "contig"), $1, $4, h[6], $6, $6 / h[6] }' || status=$?
rm -f "$OUT/.halo_rows"
[ "$status" -eq 0 ] || exit "$status"
echo "# wrote $OUT/core.json, $OUT/core.png, $OUT/strided.json and $OUT/mpi.txt"
