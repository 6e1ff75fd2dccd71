"""Issue 24 §2: plans never go out of step. Layers whose inputs coincide in
shape on some ranks and not on others within one step, and every halocp.nn
layer and cp_halo_exchange on shards that change from step to step, over
gloo process groups of 2 to 4 local processes, with no clear_plans anywhere
(tests/python/ranks_plans.py holds the checks each rank runs). Named outside
pytest's test_*.py pattern so that python_halocp does not run it again:
ctest's python_plans does.

    python3 -m pytest -p no:cacheprovider tests/python/plans_layers.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher import expect_scenario, launch

HERE = Path(__file__).resolve().parent
SCENARIOS = ["prepend", "changing", "mismatch"]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"W{w}")
def ranks(request):
    """One launch of W ranks per world size, running every scenario; a short
    deadline, so that a rank left waiting fails the step instead of the
    whole run."""
    return launch(HERE / "ranks_plans.py", request.param, SCENARIOS, timeout=120, env={"HALO_TIMEOUT_MS": "8000"})


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ranks(ranks, scenario):
    """Every rank reports the scenario ok (the first failure ends a rank)."""
    expect_scenario(ranks, scenario)
