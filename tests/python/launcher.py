"""Spawn W local ranks of a Python script with a torch.distributed gloo
group on 127.0.0.1, and collect what they print.

Each rank is a fresh interpreter (not a fork: libhalo runs a Go runtime and
UCX threads, which a fork would not carry over). The launcher kills the ranks
it started, by pid, when they outlive the deadline.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Rank:
    rank: int
    returncode: int | None  # None: killed at the deadline
    stdout: str
    stderr: str


def free_port() -> int:
    """A free port below the kernel's ephemeral range: one that bind(0)
    handed out could go, before rank 0 binds it, to a listener of a test
    running beside this one (every rank holds a liveness listener)."""
    import random

    for _ in range(1000):
        port = random.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000..31999")


def launch(script: Path, world: int, args: list[str] = (), timeout: float = 120, env: dict | None = None) -> list[Rank]:
    """Run ``script args`` as ranks 0..world-1; return when all have exited
    or the deadline has passed (then the rest are killed)."""
    for _ in range(3):
        ranks = _launch_once(script, world, args, timeout, env)
        # The free port may have been taken before rank 0 listened on it.
        if not any("address already in use" in r.stderr.lower() for r in ranks):
            break
    return ranks


def _launch_once(script, world, args, timeout, env) -> list[Rank]:
    base = dict(os.environ)
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "python"), base.get("PYTHONPATH")])),
    )
    base.setdefault("GLOO_SOCKET_IFNAME", "lo")
    base["HALOCP_TEST_DEADLINE"] = str(timeout)
    base.setdefault("HALO_TIMEOUT_MS", "20000")  # a wrong exchange fails in seconds, not minutes
    base.update(env or {})
    procs, files = [], []
    try:
        for r in range(world):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            files.append((out, err))
            procs.append(subprocess.Popen([sys.executable, str(script), *args], env=dict(base, RANK=str(r)),
                                          stdout=out, stderr=err, cwd=REPO))
        deadline = time.monotonic() + timeout
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    ranks = []
    for r, (out, err) in enumerate(files):
        out.seek(0)
        err.seek(0)
        ranks.append(Rank(r, codes[r] if r < len(codes) else None, out.read(), err.read()))
        out.close()
        err.close()
    return ranks


def report(ranks: list[Rank]) -> str:
    """Everything the ranks said, for an assertion message."""
    parts = []
    for r in ranks:
        state = "killed at the deadline" if r.returncode is None else f"exit {r.returncode}"
        parts.append(f"--- rank {r.rank}: {state}\n{r.stdout}{r.stderr}")
    return "\n".join(parts)


def expect_scenario(ranks: list[Rank], scenario: str) -> None:
    """Fail the test unless every rank printed "RESULT <scenario> ok" (the
    first failure ends a rank, so later scenarios then report nothing)."""
    import pytest

    for r in ranks:
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith(f"RESULT {scenario} ")]
        if not lines or not lines[0].startswith(f"RESULT {scenario} ok"):
            pytest.fail(f"rank {r.rank} of {len(ranks)}: scenario {scenario} did not pass\n{report(ranks)}")
    assert all(r.returncode == 0 for r in ranks), report(ranks)


if __name__ == "__main__":  # python3 launcher.py W script [args...]
    result = launch(Path(sys.argv[2]), int(sys.argv[1]), sys.argv[3:])
    print(report(result))
    sys.exit(0 if all(r.returncode == 0 for r in result) else 1)
