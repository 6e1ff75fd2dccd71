"""halocp's CUDA support as far as a CPU can take it, over gloo process
groups of 2 and 3 local processes (tests/python/ranks_cuda.py holds the
checks each rank runs; tests/gpu/ the check for a machine with a GPU).

    python3 -m pytest -p no:cacheprovider tests/python/test_cuda.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher import expect_scenario, launch

HERE = Path(__file__).resolve().parent
SCENARIOS = ["memory", "staged_exchange", "staged_padding", "staged_async", "staged_errors", "staged_halos", "staged_nn",
             "slabs", "direct", "direct_handles", "handover", "failed_after_wait", "refused"]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"W{w}")
def ranks(request):
    """One launch of W ranks per world size, running every scenario."""
    # The host emulation of the CUDA driver: the direct path's streams on CPU.
    return launch(HERE / "ranks_cuda.py", request.param, SCENARIOS, timeout=120, env={"HALO_CUDA_DRIVER": "host-fake"})


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ranks(ranks, scenario):
    """Every rank reports the scenario ok."""
    expect_scenario(ranks, scenario)
