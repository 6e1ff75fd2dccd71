"""halocp under torch.compile(fullgraph=True), on gloo process groups of 2
local processes (tests/python/ranks_compile.py holds the checks each rank
runs): no graph break, and the eager results.

    python3 -m pytest -p no:cacheprovider tests/python/test_compile.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher import expect_scenario, launch

HERE = Path(__file__).resolve().parent
SCENARIOS = ["default_group", "new_group", "exchanges_bits", "layers", "strided", "no_output", "tiled",
             "tile_exchange", "mismatch", "transpose"]


@pytest.fixture(scope="module")
def ranks():
    return launch(HERE / "ranks_compile.py", 2, SCENARIOS, timeout=240)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ranks(ranks, scenario):
    """Every rank reports the scenario ok."""
    expect_scenario(ranks, scenario)
