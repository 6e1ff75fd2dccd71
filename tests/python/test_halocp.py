"""halocp against an oracle, over gloo process groups of 2, 3 and 4 local
processes (tests/python/ranks.py holds the checks each rank runs).

    python3 -m pytest -p no:cacheprovider tests/python
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import REPO, expect_scenario, launch

HERE = Path(__file__).resolve().parent
SCENARIOS = ["exchange", "padding", "conv", "gradcheck", "errors", "timeout"]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"W{w}")
def ranks(request):
    """One launch of W ranks per world size, running every scenario."""
    return launch(HERE / "ranks.py", request.param, SCENARIOS, timeout=150)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ranks(ranks, scenario):
    """Every rank reports the scenario ok (the first failure ends a rank, so
    later scenarios then report nothing)."""
    expect_scenario(ranks, scenario)


def test_padding_one_rank():
    """The padding modes on a rank that is its own neighbour."""
    ranks = launch(HERE / "ranks.py", 1, ["padding"], timeout=100)
    assert ranks[0].returncode == 0 and "RESULT padding ok" in ranks[0].stdout, report(ranks)


def test_forked_child_leaves_the_communicator_alone():
    """Issue 31 §5: a forked child's sys.exit (halocp's atexit) must not
    destroy the parent's communicator; both ranks exchange afterwards."""
    ranks = launch(HERE / "ranks.py", 2, ["fork"], timeout=60, env={"HALO_TIMEOUT_MS": "5000"})
    expect_scenario(ranks, "fork")


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO / "python"), **env))


def test_missing_library_says_where_it_looked(tmp_path):
    """import works without the library; the first use says where it looked."""
    code = (
        "import halocp\n"
        "try:\n"
        "    halocp.version()\n"
        "except halocp.HaloError as e:\n"
        "    print(type(e).__mro__[1].__name__, e)\n"
    )
    p = _python(code, HALO_LIBRARY=str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("RuntimeError "), p.stdout
    assert f"HALO_LIBRARY: {tmp_path / 'libhalo.so'} (no such file)" in p.stdout, p.stdout
