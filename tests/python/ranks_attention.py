"""One rank of the tests of halocp.cp_attention (causal by frame): each rank's
queries, keys and values of its frames, against scaled_dot_product_attention
over the whole sequence with the causal frame mask (diffusers' HunyuanVideo
prepare_causal_attention_mask, rebuilt here), computed by every rank in one
process. tests/python/test_attention.py starts W of them (helpers: ranks.py).

    ranks_attention.py SCENARIO...
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import halocp
import ranks
from ranks import expect

TOL = 1e-12
# Frames per rank: uneven, an empty rank, a rank with one frame.
FRAMES = {1: [[3], [1]], 2: [[2, 3], [0, 2], [1, 0]], 3: [[2, 0, 3], [1, 2, 1], [0, 0, 2]]}


def whole_mask(frames, tokens_per_frame):
    """The additive mask of the whole sequence: a token attends the tokens
    of its own and every earlier frame."""
    index = torch.arange(1, frames + 1).repeat_interleave(tokens_per_frame)
    return torch.where(index[None, :] <= index[:, None], 0.0, float("-inf")).double()


def close(got, want, what):
    expect(got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    err = (got - want).abs().max().item() if got.numel() else 0.0
    expect(err <= TOL, f"{what}: max error {err:.3g} > {TOL:.3g}")
    return err


def scenario_frame_attention():
    """Forward, every input's gradient and no_grad, over uneven and empty
    shards, two heads, a batch of two, values of another width than keys."""
    worst = 0.0
    hw, n, heads, e, ev = 3, 2, 2, 4, 5
    for i, frames in enumerate(FRAMES[ranks.WORLD]):
        torch.manual_seed(10 + i)
        total = sum(frames) * hw
        q, k = (torch.randn(n, heads, total, e, dtype=torch.float64, requires_grad=True) for _ in range(2))
        v = torch.randn(n, heads, total, ev, dtype=torch.float64, requires_grad=True)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=whole_mask(sum(frames), hw))
        gy = torch.randn_like(y)
        y.backward(gy)

        a, m = sum(frames[:ranks.RANK]) * hw, frames[ranks.RANK] * hw
        local = [t.detach()[:, :, a:a + m].clone().requires_grad_() for t in (q, k, v)]
        y_local = halocp.cp_attention(*local, causal=True, tokens_per_frame=hw)
        y_local.backward(gy[:, :, a:a + m])
        what = f"frames {frames}"
        worst = max(worst, close(y_local, y.detach()[:, :, a:a + m], what + ": output"))
        for name, t, whole in zip("qkv", local, (q, k, v)):
            worst = max(worst, close(t.grad, whole.grad[:, :, a:a + m], f"{what}: grad of {name}"))
        with torch.no_grad():
            served = halocp.cp_attention(*(t.detach() for t in local), causal=True, tokens_per_frame=hw)
        expect(served.grad_fn is None, what + ": a graph under no_grad")
        worst = max(worst, close(served, y.detach()[:, :, a:a + m], what + ": output under no_grad"))
    print(f"max error: absolute {worst:.3g}", flush=True)


def scenario_frame_attention_refuses():
    """Ranks that disagree (on the heads), a shard that is not whole
    frames, or inputs one rank refuses (keys of another width than its
    queries) raise one HaloError on every rank, before any gather."""
    import pytest

    heads = 2 if ranks.RANK == ranks.WORLD - 1 and ranks.WORLD > 1 else 1
    t = torch.zeros(1, heads, 6, 4, dtype=torch.float64)
    if ranks.WORLD > 1:
        with pytest.raises(halocp.HaloError, match=f"disagree .*rank {ranks.WORLD - 1}: .*heads 2") as e:
            halocp.cp_attention(t, t, t, causal=True, tokens_per_frame=3)
        expect(e.value.code == halocp.ERR_MISMATCH, f"code {e.value.code}")
    bad = torch.zeros(1, 1, 6, 3 if ranks.RANK == ranks.WORLD - 1 else 4, dtype=torch.float64)
    with pytest.raises(halocp.HaloError, match=f"not on rank\\(s\\) {ranks.WORLD - 1}") as e:
        halocp.cp_attention(t[:, :1], bad, t[:, :1], causal=True, tokens_per_frame=3)
    expect(e.value.code == halocp.ERR_INVALID_ARGUMENT, f"code {e.value.code}")
    length = 5 if ranks.RANK == 0 else 6
    t = torch.zeros(1, 1, length, 4, dtype=torch.float64)
    with pytest.raises(halocp.HaloError, match="not whole frames of 3 tokens \\(rank 0: 5 positions\\)"):
        halocp.cp_attention(t, t, t, causal=True, tokens_per_frame=3)


if __name__ == "__main__":
    ranks.main(globals())
