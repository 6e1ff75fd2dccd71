"""Starts the ranks of a bench/ script on this machine: the script runs
itself once per rank with torch.distributed's environment (gloo over
loopback), rank 0's output shown, and every rank ended by its deadline.
Also the scripts' shared timing loop (interleaved)."""

from __future__ import annotations

import ctypes
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def launch(script: str, world: int, deadline: float, env_extra: dict | None = None) -> int:
    """Runs `script` with this process's arguments as `world` ranks; returns
    the worst exit status (1 if a rank outlived `deadline` seconds)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "python"), env.get("PYTHONPATH")]))
    env.update(env_extra or {})
    procs = [subprocess.Popen([sys.executable, script, *sys.argv[1:]], env=dict(env, RANK=str(r)),
                              stdout=None if r == 0 else subprocess.DEVNULL) for r in range(world)]
    try:
        codes = [p.wait(timeout=deadline) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [1]
        print(f"benchmark: ranks still running after {deadline} s; stopping them", file=sys.stderr)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return max(codes)


def interleaved(fns: dict, rounds: int, iters: int, warmup: int = 3, before_block=None) -> dict:
    """Median block mean of each function, in µs: `rounds` blocks of
    `iters` calls each, the functions' blocks interleaved so that a change
    of load hits them alike; before_block() (a barrier, say) runs before
    every block, outside its time."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    blocks = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if before_block is not None:
                before_block()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            blocks[name].append((time.perf_counter() - t0) / iters * 1e6)
    return {name: statistics.median(b) for name, b in blocks.items()}


def peak_rss_growth(run) -> int:
    """Bytes the resident set grew by at its peak during run(): freed heap
    returned to the system first, the high-water mark reset (Linux:
    clear_refs 5), VmHWM read after."""
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    run()
    return _status("VmHWM") - before


def _status(key) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")
