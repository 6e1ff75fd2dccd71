"""Issue 21: the summing exchange, GroupNorm across ranks, the context-parallel
ConvTranspose3d and the example's causal VAE blocks (and issue 32's
attention over a sharded sequence, cp_attention), over gloo process
groups of 1 to 4 local processes (tests/python/ranks_vae.py holds the checks
each rank runs). Named outside pytest's test_*.py pattern so that the
python_halocp entry does not run it a second time: ctest's python_vae does.

    python3 -m pytest -p no:cacheprovider tests/python/vae_layers.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher import expect_scenario, launch

HERE = Path(__file__).resolve().parent
SCENARIOS = ["halo_sum", "groupnorm", "norm_mismatch", "transpose", "subgroups", "temporal_padding", "conv_kernels", "conv_agreed_once",
             "pooling", "vae", "attention"]


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"W{w}")
def ranks(request):
    """One launch of W ranks per world size, running every scenario."""
    return launch(HERE / "ranks_vae.py", request.param, SCENARIOS, timeout=150)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ranks(ranks, scenario):
    """Every rank reports the scenario ok (the first failure ends a rank)."""
    expect_scenario(ranks, scenario)
