#!/usr/bin/env bash
# halo under the launchers people use, with the command lines the README
# shows (it copies them from here):
#
#   tests/launchers.sh torchrun-halod HALOD     halod bench --check under torchrun
#   tests/launchers.sh torchrun-halocp REPO     examples/python/halo_job.py under torchrun
#   tests/launchers.sh mpirun-halod HALOD       halod bench --check under Open MPI's mpirun
#
# torchrun: the PyTorch 2 spellings (--nproc-per-node, --master-port,
# --no-python, --log-dir), from the project venv's PyTorch; -r 1 -t 1 tee each
# rank's stdout and stderr to the console as well as to --log-dir's files.
# Exit 77 (skipped) when the launcher is not installed.
set -euo pipefail

mode=$1
target=$(readlink -f "$2")
source "$(dirname "$0")/lib.sh"

torchrun=$(dirname "$python")/torchrun
[ -x "$torchrun" ] || torchrun=$(command -v torchrun || true)
case $mode in
torchrun-halod)
	[ -n "$torchrun" ] || skip "torchrun is not installed (bash scripts/setup.sh makes .venv with PyTorch 2)"
	port=$(free_port_pair)
	run 120 "$torchrun" --nproc-per-node 2 --master-port "$port" -r 1 -t 1 --log-dir "$work/logs" \
		--no-python "$target" bench --check -b 8 -e 64K --iters 20 --log-level debug --log-format json ||
		fail "torchrun ... halod bench exited with status $?"
	grep -q '2 ranks (torchrun)' "$work/out" || fail "rank 0's table does not say 2 ranks (torchrun)"
	grep -q 'Result *: PASS' "$work/out" || fail "rank 0's table does not say PASS"
	# halo's rendezvous is MASTER_PORT+1, next to torchrun's store.
	grep -q "\"rendezvous\":\"127.0.0.1:$((port + 1))\"" "$work/err" ||
		fail "rank 0 did not host the rendezvous on MASTER_PORT+1 = $((port + 1))"
	# Logs go to stderr: stdout holds the table only.
	if grep -v '^\[default[01]\]:#' "$work/out" | grep -v -E '^\[default0\]: +[0-9]+ ' | grep -q .; then
		fail "stdout holds more than the table"
	fi
	echo "ok: torchrun --nproc-per-node 2 -r 1 -t 1 --no-python halod bench --check: PASS, rendezvous on MASTER_PORT+1"
	;;
torchrun-halocp)
	[ -n "$torchrun" ] || skip "torchrun is not installed (bash scripts/setup.sh makes .venv with PyTorch 2)"
	port=$(free_port_pair)
	run 150 env PYTHONPATH="$target/python" "$torchrun" --nproc-per-node 2 --master-port "$port" -r 1 -t 1 \
		--log-dir "$work/logs" "$target/examples/python/halo_job.py" ||
		fail "torchrun ... examples/python/halo_job.py exited with status $?"
	for r in 0 1; do
		grep -q "rank $r of 2: ok" "$work/out" || fail "rank $r did not report ok"
	done
	echo "ok: torchrun --nproc-per-node 2 -r 1 -t 1 examples/python/halo_job.py: both ranks exact"
	;;
mpirun-halod)
	command -v mpirun >/dev/null || skip "mpirun is not installed (Debian: openmpi-bin)"
	mpirun --version 2>&1 | grep -q 'Open MPI' || skip "mpirun is not Open MPI's"
	# As root Open MPI wants --allow-run-as-root; --oversubscribe lets it
	# start more ranks than it counts cores. halod bench takes only the
	# launcher's variables (OMPI_COMM_WORLD_*), not MPI itself.
	root=()
	[ "$(id -u)" -ne 0 ] || root=(--allow-run-as-root)
	run 120 mpirun "${root[@]}" --oversubscribe -np 2 \
		"$target" bench --check -b 8 -e 64K --iters 20 ||
		fail "mpirun ... halod bench exited with status $?"
	grep -q '2 ranks (openmpi)' "$work/out" || fail "rank 0's table does not say 2 ranks (openmpi)"
	grep -q '^# Result *: PASS' "$work/out" || fail "rank 0's table does not say PASS"
	if grep -v '^#' "$work/out" | grep -v -E '^ +[0-9]+ ' | grep -q .; then
		fail "stdout holds more than the table"
	fi
	echo "ok: mpirun --oversubscribe -np 2 halod bench --check: PASS"
	;;
*)
	echo "usage: $0 torchrun-halod|torchrun-halocp|mpirun-halod HALOD|REPO" >&2
	exit 2
	;;
esac
