"""halocp's choice of UCX (HALO_UCX, python/halocp/_lib.py): wheel loads
PyPI's UCX wheel before libhalo, system leaves it to the loader, auto takes
the wheel when it is installed; a bad value is refused by name. Each mode in
a fresh process, the libucp mapped into it read from /proc/self/maps."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROBE = """
import os, halocp
halocp._lib.lib()
print(sorted({os.path.realpath(l.split()[-1]) for l in open('/proc/self/maps') if 'libucp.so' in l}))
"""


def mapped(mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HALO_UCX=mode, PYTHONPATH=str(REPO / "python"))
    env.pop("LD_LIBRARY_PATH", None)
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)


def main() -> int:
    import libucx

    wheel = os.path.realpath(os.path.join(os.path.dirname(libucx.__file__), "lib"))
    for mode, from_wheel in (("wheel", True), ("auto", True), ("system", False)):
        r = mapped(mode)
        if r.returncode != 0:
            print(f"FAIL: HALO_UCX={mode}: {r.stderr}")
            return 1
        libs = eval(r.stdout.strip().splitlines()[-1])
        if len(libs) != 1 or libs[0].startswith(wheel) != from_wheel:
            print(f"FAIL: HALO_UCX={mode}: libucp mapped from {libs}, wheel's is in {wheel}")
            return 1
        print(f"ok: HALO_UCX={mode}: {libs[0]}")
    r = mapped("bogus")
    if r.returncode == 0 or "HALO_UCX='bogus'" not in r.stderr:
        print(f"FAIL: HALO_UCX=bogus was not refused by name: {r.stderr}")
        return 1
    print("ok: HALO_UCX=bogus refused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
