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
             "tile_exchange", "mismatch", "norm_mismatch", "transpose", "group_forms", "changing_lengths", "pooling", "inductor"]


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


def test_count_bounds():
    """_splits.count_bounds, the output counts a compiled strided layer
    tells the graph from this rank's length and place alone, hold the count
    that _splits.outputs gives from every rank's lengths, for every split of
    up to 3 ranks of 0 to 6 frames; and decide it for rank 0 and for the
    multiples of the stride that converted VAEs' ranks hold."""
    import itertools
    import sys

    sys.path.insert(0, str(HERE.parents[1] / "python"))
    from halocp._splits import count_bounds, outputs

    for s, e, pl, pr in itertools.product(range(1, 4), range(4), range(4), range(4)):
        for world in (1, 2, 3):
            for lengths in itertools.product(range(7), repeat=world):
                for rank in range(world):
                    lo, hi = count_bounds(s, e, pl, pr, lengths[rank], rank, world)
                    count = outputs(s, e, pl, pr, list(lengths), rank)[1]
                    assert lo <= count <= hi, (s, e, pl, pr, lengths, rank, count, lo, hi)
    assert count_bounds(2, 2, 2, 0, 9, 0, 2) == (5, 5)  # LTX-Video's strided causal conv, rank 0: 1 + 8 frames
    assert count_bounds(2, 2, 2, 0, 16, 1, 2) == (8, 8)
    assert count_bounds(2, 2, 2, 0, 8, 1, 3) == (4, 4) and count_bounds(2, 2, 2, 0, 0, 1, 3) == (0, 0)
    assert count_bounds(3, 2, 2, 0, 2, 1, 2) == (0, 1)  # ranks_compile.py no_output: decided by the others
