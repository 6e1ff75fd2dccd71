"""halocp on one GPU: correctness bit for bit, and time against torch.distributed.

    check.py [--cpu | --direct-cpu] [--world 2] [--quick] [--json FILE]

Starts --world ranks (fresh interpreters) on this machine, all on GPU 0;
torch.distributed's gloo group is only their bootstrap. Each rank checks
cp_halo_exchange, halos, halo_exchange_ and cp_halo_exchange_start (forward and autograd backward)
on CUDA tensors for float32 and bfloat16 against the reference module's
semantics computed on the GPU (tests/python/ranks.py's oracle), also on a
side stream, and a started exchange waited for under another stream than
the one that started it (after a long kernel there that writes x); then
2 KiB and 2 MiB halos are timed against the same exchange
over torch.distributed NCCL (or, where NCCL refuses two ranks on one GPU,
gloo with device copies, labelled as such). The exit status is 0 only when
every rank passed.

--cpu is the dry run for machines without a GPU: the same checks and timings
with CPU tensors routed through the staging path for CUDA tensors, against
gloo on CPU tensors. --direct-cpu is the dry run of the direct path's code:
CPU tensors through halocp's direct path on host-memory plans, started on
streams of libhalo's host emulation of the CUDA driver; its cases are those a
CUDA plan takes (a host plan takes any layout, so a CUDA plan's refusal, and
the staged rerun that follows it, cannot be seen there).
tests/gpu/README.md says how to run it with the bundle.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
RANK_VAR = "GPU_CHECK_RANK"  # set for the ranks this script starts


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run: CPU tensors through the staging path")
    ap.add_argument("--direct-cpu", action="store_true", help="dry run: CPU tensors through the direct path's code")
    ap.add_argument("--world", type=int, default=2, help="ranks (all on GPU 0), default 2")
    ap.add_argument("--quick", action="store_true", help="fewer timing iterations")
    ap.add_argument("--json", help="rank 0 writes the figures here")
    ap.add_argument("--timeout", type=float, default=420, help="seconds before the ranks are killed")
    return ap.parse_args(argv)


# ---------------------------------------------------------------- launcher


def launch(args) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.world))
    if args.direct_cpu:
        env["HALO_CUDA_DRIVER"] = "host-fake"  # the direct path's streams, on the host
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # halocp from PYTHONPATH (the bundle's) if set, else from this checkout.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(HERE.parents[1] / "python")]))
    procs = []
    for r in range(args.world):
        procs.append(subprocess.Popen([sys.executable, __file__] + sys.argv[1:], env=dict(env, RANK=str(r), **{RANK_VAR: str(r)}),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline, outs, codes = time.monotonic() + args.timeout, [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()  # this process's own child, by its handle
            out, _ = p.communicate()
            out += f"\n(killed after {args.timeout:.0f}s)"
        outs.append(out)
        codes.append(p.returncode)
    for r, out in enumerate(outs):
        print(f"==== rank {r} (exit {codes[r]})\n{out.rstrip()}")
    ok = all(c == 0 for c in codes)
    print("==== " + ("all ranks passed" if ok else "FAILED"))
    return 0 if ok else 1


# ---------------------------------------------------------------- one rank


def rank_main(args) -> int:
    import torch
    import torch.distributed as dist

    import halocp
    from halocp import _cuda

    sys.path.insert(0, str(HERE.parent / "python"))
    import ranks  # the oracle and helpers of the CPU tests

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks.RANK, ranks.WORLD = rank, world
    args.cpu = args.cpu or args.direct_cpu
    if args.cpu:
        dev = torch.device("cpu")
        args.staging = _cuda.stage_cpu("direct" if args.direct_cpu else True)  # kept: for the whole run
        args.staging.__enter__()
    else:
        if not torch.cuda.is_available():
            print("RESULT setup FAIL torch sees no CUDA device (run with --cpu for the dry run)")
            return 1
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    print(f"rank {rank}/{world}: torch {torch.__version__}, device {dev}"
          + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
          + f", libhalo {halocp.version()} from {halocp.library_path()}, path for CUDA tensors: {halocp.cuda_path()}",
          flush=True)
    status = 0
    for name, fn in (("correctness", correctness), ("timing", timing)):
        t0 = time.monotonic()
        try:
            detail = fn(args, dev, rank, world)
        except Exception as e:  # noqa: BLE001 - reported, then the rank ends
            import traceback

            text = str(e) if isinstance(e, ranks.Failure) else traceback.format_exc()
            print(f"RESULT {name} FAIL {text}", flush=True)
            os._exit(1)  # the peers fail fast at their next collective
        print(f"RESULT {name} ok {time.monotonic() - t0:.1f}s {detail}", flush=True)
    # No destroy_process_group: a NCCL group that failed to start may hang
    # in its teardown. Every peer is done with the store by now.
    dist.barrier()
    sys.stdout.flush()
    os._exit(status)


def _cases(world, direct_cpu=False):
    """(name, shape with None at dim, dim, lengths, left, right, layout)."""
    return [
        ("uneven shards", (2, None, 3), 1, [5 + r % 2 for r in range(world)], 2, 1, "contiguous"),
        ("long shards (slab-sized buffers)", (2, None, 4), 1, [40 + 3 * r for r in range(world)], 1, 2, "contiguous"),
        *([] if direct_cpu else  # a CUDA plan refuses it (staged); a host plan would take it
          [("halos longer than shards", (3, None), 1, [2 + r % 2 for r in range(world)], 4, 3, "contiguous")]),
        ("dim 0, permuted x", (None, 4, 5), 0, [3] * world, 1, 1, "permuted"),
        ("right halo only", (None, 6), 0, [4] * world, 0, 2, "contiguous"),
    ]


def correctness(args, dev, rank, world) -> str:
    import torch

    import halocp
    import ranks
    from ranks import expect_bits, oracle_backward, oracle_forward, random_values

    checked = crossed = 0
    streams = [None]
    if dev.type == "cuda":
        streams.append(torch.cuda.Stream(dev))  # the exchange on a side stream: its ordering is the test
    for case_no, (name, shape, dim, lengths, L, R, layout) in enumerate(_cases(world, args.direct_cpu)):
        for dtype in (torch.float32, torch.bfloat16):
            for stream in streams:
                for again in range(2):  # the second time through the cached plan and buffers
                    gen = torch.Generator().manual_seed(1000 * case_no + 10 * again + (dtype == torch.bfloat16))
                    shapes = [tuple(n if s is None else s for s in shape) for n in lengths]
                    out_shapes = [tuple(n + L + R if s is None else s for s in shape) for n in lengths]
                    shards = [random_values(s, dtype, gen).to(dev) for s in shapes]
                    grads = [random_values(s, dtype, gen).to(dev) for s in out_shapes]
                    what = f"{name} {dtype} {'side stream ' if stream else ''}call {again + 1}"
                    ctx = torch.cuda.stream(stream) if stream is not None else _Null()
                    if stream is not None:
                        stream.wait_stream(torch.cuda.current_stream(dev))
                    with ctx:
                        got = _run_four(halocp, torch, shards[rank], grads[rank], L, R, dim, layout, random.Random(case_no))
                    if stream is not None:
                        torch.cuda.current_stream(dev).wait_stream(stream)
                    n = lengths[rank]
                    want_out = oracle_forward(shards, rank, L, R, dim)
                    want_gx = oracle_backward(grads, lengths, rank, L, R, dim)
                    zero_inside = [g.clone() for g in grads]
                    for g, m in zip(zero_inside, lengths):
                        g.narrow(dim, L, m).zero_()
                    want_halos_gx = oracle_backward(zero_inside, lengths, rank, L, R, dim)
                    out, gx, lh, rh, halos_gx, padded, inplace_gx, started, started_gx = got
                    expect_bits(out, want_out, f"{what}: cp_halo_exchange output")
                    expect_bits(gx, want_gx, f"{what}: cp_halo_exchange gradient")
                    expect_bits(lh, want_out.narrow(dim, 0, L), f"{what}: halos left")
                    expect_bits(rh, want_out.narrow(dim, L + n, R), f"{what}: halos right")
                    expect_bits(halos_gx, want_halos_gx, f"{what}: halos gradient")
                    expect_bits(padded, want_out, f"{what}: halo_exchange_ output")
                    expect_bits(inplace_gx, want_gx, f"{what}: halo_exchange_ gradient")
                    expect_bits(started, want_out, f"{what}: cp_halo_exchange_start output")
                    expect_bits(started_gx, want_gx, f"{what}: cp_halo_exchange_start gradient")
                    ranks.expect(out.device == dev and gx.device == dev, f"{what}: results left {dev}")
                    checked += 1
            if dev.type == "cuda":
                out, gx = _across_streams(halocp, torch, shards[rank], grads[rank], L, R, dim)
                expect_bits(out, oracle_forward(shards, rank, L, R, dim), f"{name} {dtype}: started on one stream, "
                            "waited for under another: output")
                expect_bits(gx, oracle_backward(grads, lengths, rank, L, R, dim), f"{name} {dtype}: started on one "
                            "stream, waited for under another: gradient")
                crossed += 1
    return f"({checked} cases x 4 calls, forward and backward, bit for bit; {crossed} across streams)"


def _across_streams(halocp, torch, shard, grad, L, R, dim):
    """cp_halo_exchange_start on stream a, after a long kernel there and
    the copy that writes x; then a long kernel on a again, and the wait,
    the backward and the reads under stream b: the exchange must come after
    a's first kernel, and b must see the results without waiting for a's
    second (which any result copies left on a would sit behind)."""
    dev = shard.device
    a, b = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    x = torch.empty_like(shard)
    a.wait_stream(torch.cuda.current_stream(dev))
    b.wait_stream(torch.cuda.current_stream(dev))  # grad was written there
    with torch.cuda.stream(a):
        torch.cuda._sleep(20_000_000)
        x.copy_(shard)
        x.requires_grad_(True)
        h = halocp.cp_halo_exchange_start(x, L, R, dim)
        torch.cuda._sleep(50_000_000)
    with torch.cuda.stream(b):
        out = h.wait()
        out.backward(grad)
        got = out.detach().clone(), x.grad.clone()
    torch.cuda.current_stream(dev).wait_stream(b)
    torch.cuda.current_stream(dev).wait_stream(a)
    return got


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _run_four(halocp, torch, shard, grad, L, R, dim, layout, cfg):
    """cp_halo_exchange, halos, halo_exchange_ and cp_halo_exchange_start
    with their backward, on the current stream; the results are read on it."""
    from ranks import with_layout

    n = shard.shape[dim]
    x = with_layout(shard.cpu(), layout, cfg, dim).to(shard.device).requires_grad_(True)
    out = halocp.cp_halo_exchange(x, L, R, dim)
    out.backward(grad)

    x2 = shard.clone().requires_grad_(True)
    lh, rh = halocp.halos(x2, L, R, dim)
    torch.autograd.backward([lh, rh], [grad.narrow(dim, 0, L), grad.narrow(dim, L + n, R)])

    x3 = shard.clone().requires_grad_(True)
    z = lambda k: torch.zeros(shard.shape[:dim] + (k,) + shard.shape[dim + 1:], dtype=shard.dtype, device=shard.device)  # noqa: E731
    padded = torch.cat([z(L), x3, z(R)], dim)
    halocp.halo_exchange_(padded, L, R, dim)
    padded.backward(grad)

    x4 = shard.clone().requires_grad_(True)
    h = halocp.cp_halo_exchange_start(x4, L, R, dim)
    torch.mul(shard, 2)  # work on the stream while the halos travel
    started = h.wait()
    started.backward(grad)
    return [t.detach().clone() for t in (out, x.grad, lh, rh, x2.grad, padded, x3.grad, started, x4.grad)]


# ---------------------------------------------------------------- timing


def _torch_exchange(torch, dist, x, L, R, dim, group, staged_dev=None):
    """The reference's exchange over torch.distributed P2P: pack the boundary
    slabs, send and receive, cat. staged_dev: the tensors live there, the
    wire (gloo) sees CPU copies."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = x.shape[dim]
    wire = x.device if staged_dev is None else torch.device("cpu")
    zeros = lambda k: torch.zeros(x.shape[:dim] + (k,) + x.shape[dim + 1:], dtype=x.dtype, device=wire)  # noqa: E731
    slab = lambda lo, k: x.narrow(dim, lo, k).contiguous().to(wire)  # noqa: E731
    left, right = zeros(L), zeros(R)
    ops = []
    if rank > 0:
        ops += [dist.P2POp(dist.isend, slab(0, R), rank - 1, group), dist.P2POp(dist.irecv, left, rank - 1, group)]
    if rank < world - 1:
        ops += [dist.P2POp(dist.isend, slab(n - L, L), rank + 1, group), dist.P2POp(dist.irecv, right, rank + 1, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    if staged_dev is not None:
        left, right = left.to(staged_dev), right.to(staged_dev)
    return torch.cat([left, x, right], dim)


def _time(fn, sync, warm, iters):
    ts = []
    for i in range(warm + iters):
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= warm:
            ts.append(time.perf_counter() - t0)
    ts.sort()
    return statistics.median(ts) * 1e6, ts[min(len(ts) - 1, int(0.99 * len(ts)))] * 1e6


def timing(args, dev, rank, world) -> str:
    import torch
    import torch.distributed as dist

    import halocp
    from halocp import _cuda

    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    baseline, why = "gloo (CPU tensors)", ""
    group, staged_dev = dist.group.WORLD, None
    if dev.type == "cuda":
        try:
            group = dist.new_group(backend="nccl")
            probe = torch.ones(1, device=dev)
            dist.all_reduce(probe, group=group)
            sync()
            baseline = "NCCL"
        except Exception as e:  # noqa: BLE001 - NCCL refuses two ranks on one GPU
            why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            baseline, group, staged_dev = "gloo with device copies (NCCL unavailable)", dist.group.WORLD, dev
    rows = []
    for label, cols in (("2 KiB", 512), ("2 MiB", 512 * 1024)):
        x = torch.randn(8, cols, device=dev)
        warm, iters = (20, 200) if label == "2 KiB" else (5, 50)
        if args.quick:
            warm, iters = 3, max(10, iters // 10)
        ours = _time(lambda: halocp.cp_halo_exchange(x, 1, 1, 0), sync, warm, iters)
        theirs = _time(lambda: _torch_exchange(torch, dist, x, 1, 1, 0, group, staged_dev), sync, warm, iters)
        rows.append({"halo": label, "bytes": cols * 4, "halocp_p50_us": ours[0], "halocp_p99_us": ours[1],
                     "baseline_p50_us": theirs[0], "baseline_p99_us": theirs[1], "iterations": iters})
        if dev.type == "cpu":  # what staging costs: the same call on halocp's CPU path
            with _cuda.stage_cpu(False):
                rows[-1]["halocp_cpu_path_p50_us"] = _time(lambda: halocp.cp_halo_exchange(x, 1, 1, 0), sync, warm, iters)[0]
    # What one stream synchronisation costs (the staged path makes one per
    # direction before the host plan reads the slabs), and the host time of
    # one started and waited exchange with no device synchronisation (the
    # direct path's is stream-ordered: the caller is not blocked).
    sync_cost = host_us = None
    if dev.type == "cuda":
        x = torch.randn(8, 512, device=dev)
        warm, iters = (20, 200) if not args.quick else (3, 20)
        host_us = _time(lambda: halocp.cp_halo_exchange_start(x, 1, 1, 0).wait(), lambda: None, warm, iters)[0]
        sync()
        s = torch.cuda.current_stream(dev)
        sync_cost = _time(lambda: torch.cuda._sleep(1) or s.synchronize(), lambda: None, 20, 200)[0]
    if rank == 0:
        path = halocp.cuda_path()
        if dev.type == "cpu":  # what the dry run routes CPU tensors through
            path = "direct path's code, host-fake streams" if args.direct_cpu else "staging path's code"
        print(f"# cp_halo_exchange forward, 2 ranks on one {dev.type} device, x (8, C) float32, dim 0, left = right = 1")
        print(f"# halocp path: {path}; baseline: torch.distributed {baseline}" + (f" ({why})" if why else ""))
        print("# times per call from the caller's side, device synchronised after each; median and p99 of back-to-back calls")
        print(f"# {'halo':>6} {'bytes':>9} {'halocp p50':>11} {'p99':>9} {'baseline p50':>13} {'p99':>9} {'ratio':>6}")
        print(f"# {'':>6} {'':>9} {'(us)':>11} {'(us)':>9} {'(us)':>13} {'(us)':>9} {'':>6}")
        for r in rows:
            print(f"  {r['halo']:>6} {r['bytes']:>9} {r['halocp_p50_us']:>11.1f} {r['halocp_p99_us']:>9.1f} "
                  f"{r['baseline_p50_us']:>13.1f} {r['baseline_p99_us']:>9.1f} {r['baseline_p50_us'] / r['halocp_p50_us']:>6.2f}")
        for r in rows:
            if "halocp_cpu_path_p50_us" in r:
                print(f"# {r['halo']}: halocp's CPU path (no staging) in the same run: p50 {r['halocp_cpu_path_p50_us']:.1f} us")
        if sync_cost is not None:
            print(f"# one stream synchronisation after a tiny kernel: {sync_cost:.1f} us (median)")
        if host_us is not None:
            print(f"# host time of cp_halo_exchange_start(2 KiB).wait() with no device sync ({path}): {host_us:.1f} us (median)")
        if args.json:
            Path(args.json).write_text(json.dumps({"device": str(dev), "path": path, "baseline": baseline,
                                                   "baseline_note": why, "stream_sync_us": sync_cost,
                                                   "host_us_start_wait": host_us, "rows": rows},
                                                  indent=2))
    return f"(baseline {baseline})"


if __name__ == "__main__":
    a = parse(sys.argv[1:])
    if os.environ.get(RANK_VAR) is None:
        sys.exit(launch(a))
    sys.exit(rank_main(a))
