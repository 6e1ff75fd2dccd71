"""halocp's asynchronous and halos-only exchanges (finished in any order),
the fused nn layers and abort, over gloo process groups of 2, 3 and 4 local processes
(tests/python/ranks_overlap.py holds the checks each rank runs).

    python3 -m pytest -p no:cacheprovider tests/python/test_overlap.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import REPO, expect_scenario, launch

HERE = Path(__file__).resolve().parent
SCENARIOS = ["async", "halos", "layers", "abort"]  # abort last: it fails a communicator


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"W{w}")
def ranks(request):
    """One launch of W ranks per world size, running every scenario."""
    return launch(HERE / "ranks_overlap.py", request.param, SCENARIOS, timeout=150)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ranks(ranks, scenario):
    """Every rank reports the scenario ok (the first failure ends a rank)."""
    expect_scenario(ranks, scenario)


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_orders(world):
    """Two exchanges in flight that agree again, finished in any order
    (ranks_overlap.py's scenario_orders); a short deadline, so that a rank
    blocked in one's agreement while its peer blocks in the other's fails
    in seconds."""
    expect_scenario(launch(HERE / "ranks_overlap.py", world, ["orders"], timeout=60,
                           env={"HALO_TIMEOUT_MS": "3000"}), "orders")


def test_layers_without_distributed():
    """With torch.distributed not initialised and no group, the layers are
    plain convolutions over the whole sequence (zeros before and after it)."""
    code = (
        "import torch, torch.nn.functional as F, halocp\n"
        "torch.manual_seed(0)\n"
        "for cls, left, right in [(halocp.nn.CausalConv3d, 2, 0), (halocp.nn.CenteredConv3d, 1, 1)]:\n"
        "    layer = cls(2, 3, 3, padding=1, dtype=torch.float64)\n"
        "    x = torch.randn(1, 2, 4, 3, 3, dtype=torch.float64)\n"
        "    want = F.conv3d(F.pad(x, (0, 0, 0, 0, left, right)), layer.weight, layer.bias, padding=(0, 1, 1))\n"
        "    assert torch.equal(layer(x), want), cls\n"
        "print('ok')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO / "python")))
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr
