"""halocp.cp_attention (causal by frame) on gloo groups of 1 to 3 local processes,
against the whole sequence's attention in one process
(tests/python/ranks_attention.py holds what each rank checks), and on one
process without torch.distributed.

    python3 -m pytest -p no:cacheprovider tests/python/test_attention.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from launcher import REPO, expect_scenario, launch

sys.path.insert(0, str(REPO / "python"))

import halocp  # noqa: E402

HERE = Path(__file__).resolve().parent
SCENARIOS = ["frame_attention", "frame_attention_refuses"]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"W{w}")
def ranks(request):
    return launch(HERE / "ranks_attention.py", request.param, SCENARIOS, timeout=120, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ranks(ranks, scenario):
    expect_scenario(ranks, scenario)


def test_one_process():
    """Without torch.distributed: the whole sequence's causal frame attention."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, dtype=torch.float64) for _ in range(3))
    frame = torch.arange(8) // 2
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=frame[None, :] <= frame[:, None])
    assert torch.allclose(halocp.cp_attention(q, k, v, causal=True, tokens_per_frame=2), want, rtol=0, atol=1e-13)
    with pytest.raises(halocp.HaloError, match="not whole frames"):
        halocp.cp_attention(q, k, v, causal=True, tokens_per_frame=3)
    with pytest.raises(halocp.HaloError, match="want \\(N, heads, L, E\\).*not on rank\\(s\\) 0"):
        halocp.cp_attention(q, k[:, :1], v, causal=True, tokens_per_frame=2)
