"""Two ranks of a tests/gpu script, each a process of its own: the launch
and the deadline the proof's scripts share."""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, script: str, env: dict, rank_env, timeout: float) -> int:
    """Run ``script`` (with this process's arguments) as ranks 0 and 1, the
    rank's variables from ``rank_env(r)``; kill what runs past ``timeout``.
    Returns 0 when both ranks passed."""
    procs = [subprocess.Popen([sys.executable, script, *sys.argv[1:]], env=dict(env, **rank_env(r)))
             for r in range(2)]
    deadline, rc = time.monotonic() + timeout, 0
    for p in procs:
        try:
            rc |= p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            print(f"{name}: a rank ran past {timeout:.0f} s: killed", file=sys.stderr)
            rc = 1
    print(f"{name}:", "passed" if rc == 0 else "FAILED")
    return rc
