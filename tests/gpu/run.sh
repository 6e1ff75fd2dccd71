#!/bin/bash
# The GPU proof, one command, from the repository root on the GPU machine:
#
#   tests/gpu/run.sh [--cpu] [--quick]
#
# with the bundle tests/gpu/bundle.sh made where halo builds (GPU_BUNDLE names
# another). Probes first (glibc, ptrace scope, GPU, CUDA IPC between two
# processes, UCX's transports, halod info), then the checks: stream-ordered
# halo_exchange_start (stream_check.py), halocp's CUDA paths (check.py) and
# the timings and layer checks (timing.py), each with the wheel's UCX (CUDA transports: the direct path) and with
# Debian's (none: the staged path). Every step has a short timeout; each
# writes one JSON line to $OUT/proof.jsonl as it ends (OUT defaults to
# ./gpu-proof), and their figures go to $OUT/*.json. The exit status is 0
# only when every step passed; steps past the 290 s budget are skipped, failed. --cpu is the dry run on a machine
# with no GPU: the GPU probes are skipped and the checks run on CPU tensors
# (the proxy with the host-fake driver, halocp's staging path and its direct
# path's code on host-fake streams).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bundle=${GPU_BUNDLE:-$here/bundle}
cpu=0 quick=
for a in "$@"; do
  case $a in
    --cpu) cpu=1 ;;
    --quick) quick=--quick ;;
    *) echo "run.sh: unknown option $a (--cpu, --quick)" >&2; exit 2 ;;
  esac
done
[ -f "$bundle/lib/libhalo.so" ] || { echo "run.sh: no bundle at $bundle: run tests/gpu/bundle.sh where halo builds" >&2; exit 2; }
out=${OUT:-$PWD/gpu-proof}
mkdir -p "$out"
log=$out/proof.jsonl
: > "$log"
py=${PYTHON:-python3}
failed=0
deadline=$((SECONDS + 290))

# step NAME TIMEOUT_S CMD...: runs CMD, its output to $out/NAME.log, and
# appends {"step", "ok", "rc", "seconds", "tail"} to proof.jsonl.
step() {
  local name=$1 limit=$2 t0 rc left=$((deadline - SECONDS))
  shift 2
  if [ $left -lt 10 ]; then skip "$name" "out of time (the whole run keeps under 5 minutes)"; failed=1; return; fi
  [ "$limit" -le $left ] || limit=$left
  t0=$(date +%s.%N)
  timeout --kill-after=5 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  [ $rc = 0 ] || failed=1
  "$py" - "$name" "$rc" "$t0" "$out/$name.log" "$log" <<'PY'
import json, sys, time
name, rc, t0, path, log = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
tail = open(path, errors="replace").read()[-1500:]
took = round(time.time() - t0, 2)
with open(log, "a") as f:
    print(json.dumps({"step": name, "ok": rc == 0, "rc": rc, "timed_out": rc in (124, 137), "seconds": took,
                      "tail": tail}), file=f)
print(f"run.sh: {name:24} {'ok' if rc == 0 else f'FAILED rc={rc}'} ({took} s)")
if rc:
    print(tail[-600:])
PY
}
skip() { echo "{\"step\": \"$1\", \"skipped\": \"$2\"}" >> "$log"; echo "run.sh: $1 skipped: $2"; }

export HALO_LIBRARY=$bundle/lib/libhalo.so
export PYTHONPATH=$bundle/python${PYTHONPATH:+:$PYTHONPATH}
# libhalo is loaded after torch's CUDA libraries: leave it static TLS to spare.
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.rtld.optional_static_tls=16384}
base_ld=${LD_LIBRARY_PATH:-}
debian_ucx() {
  export LD_LIBRARY_PATH=$bundle/lib:$bundle/lib/ucx${base_ld:+:$base_ld}
  export UCX_MODULE_DIR=$bundle/lib/ucx/modules
}
wheel_ucx() {
  export LD_LIBRARY_PATH=$bundle/lib:$bundle/ucx-cu13/libucx/lib${base_ld:+:$base_ld}
  export UCX_MODULE_DIR=$bundle/ucx-cu13/libucx/lib/ucx
}
have_wheel=0
[ -f "$bundle/ucx-cu13/libucx/lib/libucp.so.0" ] && have_wheel=1

cat "$bundle/MANIFEST"
cp "$bundle/MANIFEST" "$out/MANIFEST"

# ---- probes
step probe_glibc 10 bash -c "ldd --version | head -1; need=\$(sed -n 's/^needs glibc >= //p' '$bundle/MANIFEST'); have=\$(getconf GNU_LIBC_VERSION | cut -d' ' -f2); echo \"have \$have, bundle needs \$need\"; [ \"\$(printf '%s\n' \"\$need\" \"\$have\" | sort -V | head -1)\" = \"\$need\" ]"
step probe_ptrace 5 bash -c "echo ptrace_scope=\$(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo absent); echo '(cma, UCX single-copy shared memory, needs 0, or the ranks as children of one process)'"
step probe_torch 60 "$py" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
if [ $cpu = 0 ]; then
  step probe_gpu 20 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv
  # CUDA IPC between two processes: a child maps the parent's tensor.
  step probe_cuda_ipc 60 "$py" -c "
import torch, torch.multiprocessing as mp
def child(q):
    t = q.get(); t += 1; torch.cuda.synchronize(); q.put(int(t.sum()))
if __name__ == '__main__':
    ctx = mp.get_context('spawn'); q = ctx.Queue()
    t = torch.zeros(1024, device='cuda'); p = ctx.Process(target=child, args=(q,)); p.start()
    q.put(t); import time; time.sleep(2); s = q.get(timeout=30); p.join(30)
    print('child saw', s, 'parent sees', int(t.sum())); assert s == 1024 and int(t.sum()) == 1024
"
else
  skip probe_gpu "--cpu"
  skip probe_cuda_ipc "--cpu"
fi
if [ $have_wheel = 1 ]; then
  wheel_ucx
  step probe_ucx_cu13 20 bash -c "'$bundle/ucx-cu13/libucx/bin/ucx_info' -v; '$bundle/ucx-cu13/libucx/bin/ucx_info' -d | grep -E 'Transport|Memory domain' | sort -u"
else
  skip probe_ucx_cu13 "the bundle carries no libucx-cu13 wheel (bundle.sh --no-ucx-wheel)"
fi
if [ -x "$bundle/bin/halod" ]; then
  debian_ucx
  step probe_halod_info 20 "$bundle/bin/halod" info
  [ $have_wheel = 1 ] && { wheel_ucx; step probe_halod_info_cu13 20 "$bundle/bin/halod" info; }
else
  skip probe_halod_info "no halod in the bundle"
fi

# ---- checks
mode=(); [ $cpu = 1 ] && mode=(--cpu)
iters=200; [ -n "$quick" ] && iters=50
ucxs=(debian); [ $have_wheel = 1 ] && ucxs+=(cu13)
for u in "${ucxs[@]}"; do
  if [ $u = cu13 ]; then wheel_ucx; else debian_ucx; fi
  step "stream_$u" 60 "$py" "$here/stream_check.py" "${mode[@]}" --iters $iters --timeout 55 --json "$out/stream_$u.json"
  step "halocp_$u" 90 "$py" "$here/check.py" "${mode[@]}" $quick --timeout 85 --json "$out/halocp_$u.json"
  step "timing_$u" 90 "$py" "$here/timing.py" "${mode[@]}" $quick --timeout 85 --json "$out/timing_$u.json"
done
if [ $cpu = 1 ]; then  # the direct path's code, on CPU memory and the driver's host emulation
  debian_ucx
  step halocp_direct_cpu 60 "$py" "$here/check.py" --direct-cpu $quick --timeout 55 --json "$out/halocp_direct_cpu.json"
fi

"$py" - "$log" "$out/proof.json" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1])]
json.dump({"passed": all(s.get("ok", True) for s in steps), "steps": steps}, open(sys.argv[2], "w"), indent=1)
PY
echo "run.sh: $([ $failed = 0 ] && echo passed || echo FAILED); JSON in $out"
exit $failed
