#!/bin/sh
# Builds bench/mpi_halo.c with Open MPI's mpicc and runs it on 2 ranks over
# UCX (pml ucx), bound to a core each, with the arguments given:
#
#   bench/mpi.sh --bytes 2048 --op both
#   bench/mpi.sh --shape 64x4x8192 --check
#   MPI_HALO=/path/to/mpi_halo bench/mpi.sh ...    an existing build
#
# pml ucx refuses to start without InfiniBand unless told that any transport
# and device will do. UCX_TLS is the caller's (bench/core.sh sets shm,self).
# Exits 77 when Open MPI (mpicc, mpirun: Debian's libopenmpi-dev and
# openmpi-bin) is not installed.
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
if ! command -v mpirun >/dev/null 2>&1 || ! mpirun --version 2>&1 | grep -q 'Open MPI'; then
	echo "# Open MPI's mpirun is not installed (Debian: openmpi-bin): no MPI figures" >&2
	exit 77
fi
tmp=
cleanup() { [ -z "$tmp" ] || rm -rf "$tmp"; }
trap cleanup EXIT
if [ -z "${MPI_HALO:-}" ]; then
	if ! command -v mpicc >/dev/null 2>&1; then
		echo "# Open MPI's mpicc is not installed (Debian: libopenmpi-dev): no MPI figures" >&2
		exit 77
	fi
	tmp=$(mktemp -d)
	mpicc -O2 -std=c99 -o "$tmp/mpi_halo" "$root/bench/mpi_halo.c" -lm
	MPI_HALO=$tmp/mpi_halo
fi
asroot=
[ "$(id -u)" -ne 0 ] || asroot=--allow-run-as-root
mpirun $asroot -np 2 --bind-to core --map-by core \
	--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any \
	"$MPI_HALO" "$@"
