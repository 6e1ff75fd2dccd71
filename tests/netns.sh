#!/usr/bin/env bash
# Several hosts on one machine: four network namespaces ("hosts"), one rank
# each, joined by veth pairs to a bridge in a fifth namespace that runs the
# shared halod serve with a token. UCX runs over TCP on each host's veth
# (UCX_TLS=tcp,self, UCX_NET_DEVICES=eth0), as it would between machines.
#
#   tests/netns.sh HALOD
#
# Checks, with halod bench --check (every value compared, bit for bit):
#   1. a 4-rank job across the four hosts;
#   2. a client with a wrong token is refused, promptly and by name;
#   3. two jobs on the one halod serve at the same time;
#   4. a rank SIGKILLed on one host is named on the others within seconds;
#   5. --compare-perftest between two hosts (ucx_perftest's server on rank
#      0's host, its client on rank 1's).
# Addresses are 198.18.0.0/24 (benchmarking space), assigned only inside the
# namespaces made here; every namespace and process is removed at the end,
# also on failure. Needs root and `ip netns`; exit 77 (skipped) otherwise.
set -euo pipefail

halod=$(readlink -f "$1")
skip() {
	echo "SKIP: $*"
	exit 77
}
[ "$(id -u)" -eq 0 ] || skip "needs root to create network namespaces"
command -v ip >/dev/null || skip "no ip command (Debian: iproute2)"

tag=halo-$$
hub=$tag-hub
hosts=("$tag-0" "$tag-1" "$tag-2" "$tag-3")
serve_addr=198.18.0.254:29700
work=$(mktemp -d)
pids=()
made=()

cleanup() {
	local p n
	for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	for n in "${made[@]}"; do ip netns del "$n" 2>/dev/null || true; done
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# Everything below finishes well within this; a stuck process fails the
# test instead of outliving it.
deadline=$((SECONDS + 100))
finish() { # pid: wait for it (by the deadline) and return its status
	while kill -0 "$1" 2>/dev/null; do
		if [ "$SECONDS" -ge "$deadline" ]; then
			echo "FAIL: pid $1 still running at the test's deadline"
			exit 1
		fi
		sleep 0.1
	done
	wait "$1"
}

ip netns add "$hub" 2>/dev/null || skip "cannot create a network namespace (ip netns add failed)"
made+=("$hub")
ip -n "$hub" link set lo up
ip -n "$hub" link add br0 type bridge
ip -n "$hub" addr add 198.18.0.254/24 dev br0
ip -n "$hub" link set br0 up
for k in 0 1 2 3; do
	h=${hosts[$k]}
	ip netns add "$h"
	made+=("$h")
	ip -n "$h" link set lo up
	ip -n "$h" link add eth0 type veth peer name port$k netns "$hub"
	ip -n "$hub" link set port$k master br0 up
	ip -n "$h" addr add 198.18.0.$((k + 1))/24 dev eth0
	ip -n "$h" link set eth0 up
done

token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
printf '%s\n' "$token" >"$work/token"
ip netns exec "$hub" "$halod" serve --listen "$serve_addr" --token-file "$work/token" --log-format json \
	2>"$work/serve.log" &
pids+=($!)
until ip netns exec "$hub" ss -Hltn "sport = :${serve_addr##*:}" | grep -q .; do
	kill -0 "${pids[0]}" 2>/dev/null || { cat "$work/serve.log"; echo "FAIL: halod serve exited"; exit 1; }
	[ "$SECONDS" -lt "$deadline" ] || { echo "FAIL: halod serve does not listen"; exit 1; }
	sleep 0.1
done

# rank JOB RANK WORLD HOST [halod bench flags]: start one rank in the
# background, as a launcher on that host would; its pid is in $!.
rank() {
	local job=$1 r=$2 world=$3 host=$4
	shift 4
	env HALO_RENDEZVOUS="$serve_addr" HALO_RENDEZVOUS_EXTERNAL=1 HALO_TOKEN="$token" HALO_JOB_ID="$job" \
		HALO_BOOTSTRAP_TIMEOUT_MS=30s HALO_TIMEOUT_MS=30s UCX_TLS="${RANK_UCX_TLS:-tcp,self}" UCX_NET_DEVICES=eth0 \
		ip netns exec "$host" "$halod" bench --rank "$r" --world-size "$world" --progress off "$@" \
		>"$work/$job.$r.out" 2>"$work/$job.$r.err" &
	pids+=($!)
}

# job NAME HOST... -- [flags]: start one rank per host; JOB_PIDS holds them.
job() {
	local name=$1 hs=() r=0
	shift
	while [ "$1" != -- ]; do hs+=("$1"); shift; done
	shift
	JOB_PIDS=()
	for h in "${hs[@]}"; do
		rank "$name" "$r" "${#hs[@]}" "$h" "$@"
		JOB_PIDS+=($!)
		r=$((r + 1))
	done
}

# passed NAME PIDS...: every rank exits 0 and rank 0's table says PASS.
passed() {
	local name=$1 r=0 p bad=0
	shift
	for p in "$@"; do
		if ! finish "$p"; then
			echo "FAIL: job $name rank $r failed:"
			cat "$work/$name.$r.err"
			bad=1
		fi
		r=$((r + 1))
	done
	if ! grep -q '^# Result *: PASS' "$work/$name.0.out"; then
		echo "FAIL: job $name: rank 0's table does not say PASS:"
		cat "$work/$name.0.out" "$work/$name.0.err"
		bad=1
	fi
	[ "$bad" -eq 0 ] || exit 1
	echo "ok: job $name, $# ranks on $# hosts: every value checked, PASS"
}

check=(--check -b 8 -e 64K -f 8 --warmup 2 --iters 20)

# 1. One job across the four hosts.
job across "${hosts[@]}" -- "${check[@]}"
passed across "${JOB_PIDS[@]}"
grep -q '4 ranks (flags)' "$work/across.0.out" || { cat "$work/across.0.out"; echo "FAIL: not 4 ranks"; exit 1; }

# 2. A wrong token is refused, and said so, within seconds.
t0=$SECONDS
env HALO_RENDEZVOUS="$serve_addr" HALO_RENDEZVOUS_EXTERNAL=1 HALO_TOKEN=not-the-token HALO_JOB_ID=intruder \
	HALO_BOOTSTRAP_TIMEOUT_MS=20s ip netns exec "${hosts[0]}" "$halod" bench --rank 0 --world-size 2 \
	>"$work/intruder.out" 2>"$work/intruder.err" &
pids+=($!)
if finish $!; then
	echo "FAIL: a rank with a wrong token was let in"
	exit 1
fi
if ! grep -q 'rejected the token' "$work/intruder.err" || [ $((SECONDS - t0)) -gt 15 ]; then
	echo "FAIL: the wrong token was not refused promptly by name:"
	cat "$work/intruder.err"
	exit 1
fi
grep -q 'bad token' "$work/serve.log" || { echo "FAIL: halod serve did not log the refusal"; exit 1; }
echo "ok: a wrong token is refused ($((SECONDS - t0)) s)"

# 3. Two jobs at once on the one service.
job pair "${hosts[0]}" "${hosts[1]}" -- "${check[@]}"
pair=("${JOB_PIDS[@]}")
job other "${hosts[2]}" "${hosts[3]}" -- "${check[@]}"
passed pair "${pair[@]}"
passed other "${JOB_PIDS[@]}"
for j in pair other; do
	grep -q "\"job\":\"$j\".*job complete" "$work/serve.log" || { echo "FAIL: halod serve did not see job $j complete"; exit 1; }
done
echo "ok: two jobs at once on one halod serve"

# 4. A rank SIGKILLed on one host mid-run is PEER_FAILED, named, on the
# others within seconds (its liveness link across the veths closes), not at
# the 30 s deadline. UCX runs on shared memory here (the "hosts" share a
# kernel and a hostname, so UCX takes them for one), where it notices no
# death itself: only the liveness link, dialled across the veths (the
# namespaces are different network stacks), can tell.
RANK_UCX_TLS=shm,self job killed "${hosts[0]}" "${hosts[1]}" "${hosts[2]}" -- -b 2K -e 2K --op forward --warmup 2 \
	--duration 60s --min-iters 1 --max-iters 10000000
killed=("${JOB_PIDS[@]}")
until grep -q . "$work/killed.0.out" 2>/dev/null; do # its table's header: connected
	kill -0 "${killed[0]}" 2>/dev/null || { cat "$work/killed.0.err"; echo "FAIL: job killed: rank 0 exited early"; exit 1; }
	[ "$SECONDS" -lt "$deadline" ] || { echo "FAIL: job killed never started"; exit 1; }
	sleep 0.1
done
sleep 1
kill -KILL "${killed[1]}"
t0=$SECONDS
for r in 0 2; do
	if finish "${killed[$r]}"; then
		echo "FAIL: job killed: rank $r went on without rank 1"
		exit 1
	fi
	# It names rank 1, also where the other survivor saw rank 1 die first
	# and aborted ("rank 0 aborted its communicator: rank 1's process ended").
	if ! grep -q "rank 1's process ended" "$work/killed.$r.err" || [ $((SECONDS - t0)) -gt 10 ]; then
		echo "FAIL: job killed: rank $r did not name the killed rank 1 promptly ($((SECONDS - t0)) s):"
		cat "$work/killed.0.err" "$work/killed.2.err"
		exit 1
	fi
done
echo "ok: a rank killed on one host is named on the others ($((SECONDS - t0)) s)"
for r in 0 2; do echo "  rank $r: $(grep -o 'ucx: wait: [^"]*' "$work/killed.$r.err" | cut -c1-400)"; done

# 5. ucx_perftest beside halo between two hosts: its server on rank 0's
# host, its client on rank 1's.
if ! command -v ucx_perftest >/dev/null; then
	echo "note: ucx_perftest is not installed (Debian: ucx-utils); the comparison was not run"
	exit 0
fi
job perftest "${hosts[0]}" "${hosts[1]}" -- --check -b 2K -e 2K --op forward --warmup 2 --iters 50 --compare-perftest
passed perftest "${JOB_PIDS[@]}"
row=$(grep -E '^ *2048 ' "$work/perftest.0.out" || true)
if [ "$(grep -o '[0-9.]*x' <<<"$row" | wc -l)" -ne 2 ] || ! grep -q 'between hosts' "$work/perftest.0.out"; then
	echo "FAIL: no ucx_perftest comparison between the two hosts:"
	cat "$work/perftest.0.out" "$work/perftest.0.err" "$work/perftest.1.err"
	exit 1
fi
echo "ok: ucx_perftest between two hosts: $(tr -s ' ' <<<"$row")"
