# Shared by the shell tests (sourced): a scratch folder, a launcher run
# bounded in time whose processes all end with the test, failure reports.
# Needs bash.

# The Python of the tests: HALO_PYTHON (ctest passes the project's), else the
# project venv that scripts/setup.sh makes (.venv, PyTorch 2 from PyPI).
python=${HALO_PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/python}
[ -x "$python" ] || python=python3

work=$(mktemp -d)
launcher_pid=
cleanup() {
	if [ -n "$launcher_pid" ]; then
		# The launcher's process group: the launcher and the ranks it
		# started. SIGTERM first, which launchers pass on to ranks they
		# may have put elsewhere; then SIGKILL.
		kill -TERM -- "-$launcher_pid" 2>/dev/null || true
		for _ in $(seq 50); do
			kill -0 "$launcher_pid" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL -- "-$launcher_pid" 2>/dev/null || true
		wait "$launcher_pid" 2>/dev/null || true
	fi
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
skip() {
	echo "SKIP: $*"
	exit 77
}
fail() {
	echo "FAIL: $*"
	for f in "$work"/out "$work"/err; do
		[ -f "$f" ] && { echo "--- ${f##*/}"; cat "$f"; }
	done
	exit 1
}

# run SECONDS CMD...: run in a process group of its own (so that a stuck
# launcher and its ranks can be ended together), stdout to $work/out,
# stderr to $work/err; return its status, or fail at the deadline.
run() {
	local limit=$1 start=$SECONDS
	shift
	set -m
	"$@" >"$work/out" 2>"$work/err" &
	launcher_pid=$!
	set +m
	while kill -0 "$launcher_pid" 2>/dev/null; do
		[ $((SECONDS - start)) -lt "$limit" ] || fail "still running after $limit s: $*"
		sleep 0.2
	done
	local rc=0
	wait "$launcher_pid" || rc=$?
	launcher_pid=
	return "$rc"
}

# Two free TCP ports in a row: torchrun's store takes MASTER_PORT, halo's
# rendezvous MASTER_PORT+1.
free_port_pair() {
	"$python" - <<'EOF'
import random, socket
# Below the kernel's ephemeral range: a port bind(0) handed out could go to a
# listener of a test running beside this one before the job binds it.
for _ in range(1000):
    p = random.randrange(20000, 32000)
    with socket.socket() as a:
        try:
            a.bind(("127.0.0.1", p))
        except OSError:
            continue
        try:
            with socket.socket() as b:
                b.bind(("127.0.0.1", p + 1))
        except OSError:
            continue
        print(p)
        break
EOF
}

