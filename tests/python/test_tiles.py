"""Memory formats kept by every exchange, halos of tiles on 2-D and 3-D
grids, and the strided, dilated, padded and tiled nn layers, over gloo
process groups of 1 to 4 local processes (tests/python/ranks_tiles.py holds
the checks each rank runs).

    python3 -m pytest -p no:cacheprovider tests/python/test_tiles.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher import expect_scenario, launch

HERE = Path(__file__).resolve().parent
SCENARIOS = ["formats", "tiles", "layers", "modes", "mismatch", "grid_mismatch"]


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"W{w}")
def ranks(request):
    """One launch of W ranks per world size, running every scenario."""
    return launch(HERE / "ranks_tiles.py", request.param, SCENARIOS, timeout=150)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ranks(ranks, scenario):
    """Every rank reports the scenario ok (the first failure ends a rank)."""
    expect_scenario(ranks, scenario)
