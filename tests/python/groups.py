"""One rank of a 4-rank job with several context-parallel groups at once, as
in DP x CP: the contiguous groups [0, 1] and [2, 3], and the offset,
non-contiguous groups [0, 2] and [1, 3], used interleaved, step after step.
tests/python/test_groups.py starts 4 of these.

Every exchange, forward and backward, is compared bit for bit with the
oracle of ranks.py, computed from the group's shards and output gradients
gathered in group-rank order. Prints "RESULT groups ok" or "RESULT groups
FAIL <why>".
"""

from __future__ import annotations

import faulthandler
import os
import random
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import halocp
from ranks import Failure, expect, expect_bits, oracle_backward, oracle_forward, random_values

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16]


def gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every group member's tensor, in group-rank order."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, t.detach().contiguous().clone(), group=group)
    return out


def layout(name: str, step: int):
    """This step's exchange on a group: the same on every member."""
    cfg = random.Random(f"{name} {step}")
    dtype = DTYPES[(step + len(name)) % len(DTYPES)]
    lengths = [cfg.randint(0, 4), cfg.randint(1, 4)]
    cfg.shuffle(lengths)
    return dtype, lengths, cfg.randint(0, 5), cfg.randint(0, 5)


def main() -> int:
    faulthandler.dump_traceback_later(float(os.environ.get("HALOCP_TEST_DEADLINE", "100")) - 5, exit=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    expect(world == 4, f"this test wants 4 ranks, not {world}")
    # Every rank makes every group, in the same order (torch requires it).
    pairs = {"[0,1]": dist.new_group([0, 1]), "[2,3]": dist.new_group([2, 3])}
    strided = {"[0,2]": dist.new_group([0, 2]), "[1,3]": dist.new_group([1, 3])}
    mine = [list(pairs.items())[rank // 2], list(strided.items())[rank % 2]]
    expect(dist.get_rank(mine[1][1]) == rank // 2, "group rank of the strided group")

    for step in range(6):
        order = mine if step % 2 == 0 else mine[::-1]  # interleaved both ways
        ins, outs, grads, cases = [], [], [], []
        for name, group in order:
            dtype, lengths, left, right = layout(name, step)
            grank = dist.get_rank(group)
            gen = torch.Generator().manual_seed(1000 * step + 10 * rank + len(cases))
            x = random_values((2, lengths[grank], 3), dtype, gen).requires_grad_()
            y = halocp.cp_halo_exchange(x, left, right, 1, group)
            g = random_values(tuple(y.shape), dtype, gen)
            ins.append(x)
            outs.append(y)
            grads.append(g)
            cases.append((name, group, grank, lengths, left, right))
        torch.autograd.backward(outs, grads)
        for x, y, g, (name, group, grank, lengths, left, right) in zip(ins, outs, grads, cases):
            what = f"step {step}, group {name} (rank {rank} is its rank {grank}), lengths {lengths}, halos {left}+{right}, {x.dtype}"
            expect_bits(y.detach(), oracle_forward(gather(x, group), grank, left, right, 1), f"{what}: forward")
            want = oracle_backward(gather(g, group), lengths, grank, left, right, 1)
            expect_bits(x.grad, want, f"{what}: backward")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except Exception as e:  # noqa: BLE001 - reported, then the rank ends
        detail = str(e) if isinstance(e, Failure) else traceback.format_exc()
        print(f"RESULT groups FAIL {detail}".replace("\n", "\n    "), flush=True)
        os._exit(1)
    print("RESULT groups ok", flush=True)
    sys.exit(code)
