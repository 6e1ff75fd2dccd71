"""halocp beside FSDP2 (issue 17): a small context-parallel model, two
halocp.nn.CausalConv3d layers each wrapped with fully_shard, trains for a few
steps on CP ranks x DP (FSDP) ranks, gloo on CPU, and matches the same model
trained on one process: the loss of every step and the parameters after.

    python tests/fsdp2.py --cp 2 --dp 2    (starts torchrun with cp*dp ranks)

Time is split over the CP ranks of a DP group, the batch over DP groups;
FSDP2 shards the parameters over the DP ranks of a CP position and averages
their gradients; the CP ranks' gradients are summed by hand (each holds the
gradient of its frames). halo's exchanges run on the CP groups while FSDP2's
all-gathers and reduce-scatters run on the DP groups, interleaved."""

import argparse
import copy
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS, B, C, T, H, W = 3, 4, 2, 8, 3, 3


def free_port_pair() -> int:
    import random

    # Below the kernel's ephemeral range: a port bind(0) handed out could go
    # to a listener of a test running beside this one before the job binds it.
    for _ in range(1000):
        p = random.randrange(20000, 32000)
        with socket.socket() as a:
            try:
                a.bind(("127.0.0.1", p))
            except OSError:
                continue
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise SystemExit("no two free ports in a row")


def launch(cp: int, dp: int) -> int:
    port = free_port_pair()
    env = dict(os.environ, HALO_RENDEZVOUS=f"127.0.0.1:{port + 1}", PYTHONPATH=str(REPO / "python"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp * dp), "--master-port",
           str(port), __file__, "--cp", str(cp), "--dp", str(dp)]
    return subprocess.run(cmd, env=env, timeout=240).returncode


def rank_main(cp: int, dp: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # PyTorch 2.4, 2.5
        from torch.distributed._composable.fsdp import fully_shard
    import halocp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    d, c = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    cp_group = mesh["cp"].get_group()
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]

    torch.manual_seed(0)
    model = torch.nn.Sequential(halocp.nn.CausalConv3d(C, 4, 3, padding=1), torch.nn.GELU(),
                                halocp.nn.CausalConv3d(4, C, 3, padding=1))
    ref = copy.deepcopy(model)
    for m, g in ((model, cp_group), (ref, alone)):
        m[0].group = m[2].group = g
    x = torch.randn(STEPS, B, C, T, H, W)
    target = torch.randn(STEPS, B, C, T, H, W)

    # The reference: one process, the whole batch and every frame.
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_losses = []
    for s in range(STEPS):
        loss = ((ref(x[s]) - target[s]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())

    fully_shard(model[0], mesh=mesh["dp"])
    fully_shard(model[2], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    bs, ts = B // dp, T // cp
    n = B * C * T * H * W / dp  # elements of one DP group's batch
    for s in range(STEPS):
        xs = x[s, d * bs:(d + 1) * bs, :, c * ts:(c + 1) * ts].contiguous()
        ts_ = target[s, d * bs:(d + 1) * bs, :, c * ts:(c + 1) * ts]
        local = ((model(xs) - ts_) ** 2).sum() / n
        opt.zero_grad()
        local.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad.to_local(), group=cp_group)
        opt.step()
        loss = local.detach().clone()
        dist.all_reduce(loss)
        loss = loss.item() / dp
        if abs(loss - ref_losses[s]) > 1e-5 * max(1.0, abs(ref_losses[s])):
            raise SystemExit(f"rank {rank} (dp {d}, cp {c}): step {s}: loss {loss}, one process {ref_losses[s]}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        full = p.full_tensor()
        err = (full - q).abs().max().item()
        if not torch.allclose(full, q, rtol=1e-5, atol=1e-6):
            raise SystemExit(f"rank {rank} (dp {d}, cp {c}): {name} differs from one process's by {err}")
    print(f"rank {rank} of {cp * dp} (dp {d}, cp {c}): ok, {STEPS} steps, losses {ref_losses}")
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    args = ap.parse_args()
    if "LOCAL_RANK" in os.environ:
        rank_main(args.cp, args.dp)
    else:
        sys.exit(launch(args.cp, args.dp))
