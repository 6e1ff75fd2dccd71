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
             "tile_exchange", "mismatch", "norm_mismatch", "transpose", "group_forms", "changing_lengths", "inductor"]


@pytest.fixture(scope="module")
def ranks():
    return launch(HERE / "ranks_compile.py", 2, SCENARIOS, timeout=240)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ranks(ranks, scenario):
    """Every rank reports the scenario ok."""
    expect_scenario(ranks, scenario)


def test_one_process():
    """The layers of one process with the whole sequence (no process group):
    nothing to exchange, one graph, torch's results."""
    import sys

    import torch
    from torch._dynamo.testing import CompileCounterWithBackend

    sys.path.insert(0, str(HERE.parents[1] / "python"))
    import halocp

    torch.manual_seed(29)
    model = torch.nn.Sequential(halocp.nn.CausalConv3d(2, 3, 3, stride=(2, 1, 1), padding=1, padding_mode="replicate"),
                                halocp.nn.ConvTranspose3d(3, 2, 3, stride=(2, 1, 1), padding=1))
    x = torch.randn(1, 2, 5, 3, 3)
    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(model, backend=counter, fullgraph=True)(x)
    assert counter.frame_count == 1
    assert torch.allclose(got, model(x), rtol=1e-5, atol=1e-5)
