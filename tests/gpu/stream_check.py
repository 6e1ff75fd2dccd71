"""halo_exchange_start (include/halo.h 0.4) on streams, from Python over ctypes.

    stream_check.py [--cpu] [--json FILE] [--iters N]

Two ranks (fresh processes) on this machine. Each exchanges through
halo_exchange_start every form (padded and halos-only, forward and backward,
one layout and two), float32 and bfloat16, and compares the tensors bit for
bit with the 0.3 blocking calls on the same data:

- on a GPU: host-memory plans ordered on a torch CUDA stream, the data made
  by work queued on that stream just before the start (a sleep kernel, then
  a copy) and the backward waited for under another stream; where the
  library moves CUDA memory (halo_comm_memory_types), a HALO_MEMORY_CUDA
  halos-only plan on CUDA tensors, forward, against the host plan;
- with --cpu: the same host-memory plans with HALO_CUDA_DRIVER=host-fake
  (the proxy path on host memory).

Then it times, on rank 0, the host time one stream-ordered start blocks its
caller and one exchange end to end (start + host wait), against the
stream-less start of the same exchange: medians over --iters, microseconds.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import two_ranks

RANK_VAR = "STREAM_CHECK_RANK"
SHAPE, DIM, LEFT, RIGHT = (1, 4, 6, 10, 12), 2, 2, 1


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="no GPU: the proxy on host memory (host-fake driver)")
    ap.add_argument("--json", help="rank 0 writes its results here")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=120)
    return ap.parse_args(argv)


def launch(args) -> int:
    env = dict(os.environ, STREAM_CHECK_PORT=str(two_ranks.free_port()))
    if args.cpu:
        env["HALO_CUDA_DRIVER"] = "host-fake"
    return two_ranks.run("stream_check", __file__, env, lambda r: {RANK_VAR: str(r)}, args.timeout)


class Halo:
    """The few calls of libhalo this check needs, over halocp's structs."""

    def __init__(self, rank: int, port: int):
        from halocp import _lib

        self.L, self.lib = _lib, _lib.lib()
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self.lib.halo_exchange_start.argtypes = [vp, i, ctypes.POINTER(vp), sz, vp, ctypes.POINTER(vp)]
        self.lib.halo_request_test.argtypes = [vp, ctypes.POINTER(i)]
        self.lib.halo_request_wait.argtypes = [vp, vp]
        self.lib.halo_request_free.argtypes = [vp]
        self.lib.halo_comm_memory_types.argtypes = [vp, ctypes.POINTER(ctypes.c_uint64)]
        for f in ("halo_exchange_start", "halo_request_test", "halo_request_wait", "halo_request_free",
                  "halo_comm_memory_types"):
            getattr(self.lib, f).restype = i
        p = _lib.CommParams()
        p.field_mask = _lib.COMM_PARAM_RENDEZVOUS | _lib.COMM_PARAM_TIMEOUT
        p.rendezvous = f"127.0.0.1:{port}".encode()
        p.timeout_ms = 30000
        self.comm = vp()
        self.ok(self.lib.halo_comm_create(rank, 2, ctypes.byref(p), ctypes.byref(self.comm)), "halo_comm_create")
        types = ctypes.c_uint64()
        self.ok(self.lib.halo_comm_memory_types(self.comm, ctypes.byref(types)), "halo_comm_memory_types")
        self.moves_cuda = bool(types.value & 2)

    def ok(self, rc: int, what: str):
        if rc != 0:
            raise self.L.error(rc, what)

    def plan(self, dtypes, halos_only: bool, cuda: bool = False):
        ps = (self.L.PlanParams * len(dtypes))()
        self._keep = shape = (ctypes.c_int64 * len(SHAPE))(*SHAPE)
        for p, dt in zip(ps, dtypes):
            p.dtype, p.ndim, p.shape, p.dim, p.left, p.right = dt, len(SHAPE), shape, DIM, LEFT, RIGHT
            if halos_only:
                p.field_mask |= self.L.PLAN_PARAM_HALOS_ONLY
                p.halos_only = 1
            if cuda:
                p.field_mask |= self.L.PLAN_PARAM_MEMORY_TYPE
                p.memory_type = 1
        h = ctypes.c_void_p()
        self.ok(self.lib.halo_plan_create_multi(self.comm, len(dtypes), ps, ctypes.byref(h)), "halo_plan_create_multi")
        return h

    def start(self, plan, direction: int, tensors, stream: int | None):
        bufs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
        req = ctypes.c_void_p()
        self.ok(self.lib.halo_exchange_start(plan, direction, bufs, len(tensors), stream, ctypes.byref(req)),
                "halo_exchange_start")
        return req

    def finish(self, req, stream: int | None = None):
        if stream:
            self.ok(self.lib.halo_request_wait(req, stream), "halo_request_wait(stream)")
        self.ok(self.lib.halo_request_wait(req, None), "halo_request_wait")
        self.ok(self.lib.halo_request_free(req), "halo_request_free")


def tensors(torch, dtype, halos_only: bool, device, seed: int):
    """The tensors of one layout: forward's, then backward's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 8, SHAPE, generator=g).to(dtype)
    n = SHAPE[DIM]
    def sized(k):
        s = list(SHAPE)
        s[DIM] = k
        return torch.randint(-8, 8, s, generator=g).to(dtype)
    if halos_only:
        t = [x, sized(LEFT), sized(RIGHT), sized(LEFT), sized(RIGHT), sized(n)]
    else:
        t = [x, sized(n + LEFT + RIGHT), sized(n + LEFT + RIGHT), sized(n)]
    return [a.to(device) for a in t]


def rank_main(args, rank: int) -> int:
    import torch

    port = int(os.environ["STREAM_CHECK_PORT"])
    h = Halo(rank, port)
    L = h.L
    gpu = not args.cpu
    dev = "cuda" if gpu else "cpu"
    if gpu:
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        sid1, sid2 = s1.cuda_stream, s2.cuda_stream
    else:
        sid1, sid2 = 0x51, 0x52
    results, failures = [], 0
    dt = {torch.float32: L.FLOAT32, torch.bfloat16: L.BFLOAT16}
    for layouts in ([torch.float32], [torch.bfloat16], [torch.float32, torch.bfloat16]):
        for halos_only in (False, True):
            plan = h.plan([dt[d] for d in layouts], halos_only)
            per = 3 if halos_only else 2
            base = [tensors(torch, d, halos_only, "cpu", 10 * rank + k) for k, d in enumerate(layouts)]
            want = [[t.clone() for t in ts] for ts in base]  # the 0.3 path: a host start + wait
            got = [[t.clone().pin_memory() if gpu else t.clone() for t in ts] for ts in base]
            for direction in (0, 1):
                sl = slice(0, per) if direction == 0 else slice(per, 2 * per) if halos_only else slice(1, 3)
                flat_w = [t for ts in want for t in ts[sl]]
                h.finish(h.start(plan, direction, flat_w, None))
                flat_g = [t for ts in got for t in ts[sl]]
                if gpu:
                    # Each layout's first tensor is written by the stream
                    # after a sleep: an exchange that did not wait for the
                    # stream would send zeros.
                    firsts = flat_g[::per] if len(layouts) > 1 else flat_g[:1]
                    truth = [t.to("cuda") for t in firsts]
                    for t in firsts:
                        t.zero_()
                    with torch.cuda.stream(s1):
                        torch.cuda._sleep(20_000_000)
                        for t, src in zip(firsts, truth):
                            t.copy_(src, non_blocking=True)
                    req = h.start(plan, direction, flat_g, sid1)
                    h.finish(req, sid2 if direction == 1 else None)
                    torch.cuda.synchronize()
                else:
                    h.finish(h.start(plan, direction, flat_g, sid1), sid2 if direction == 1 else None)
            same = all(torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                   b.cpu().view(torch.int16) if b.dtype == torch.bfloat16 else b.cpu())
                       for wa, ga in zip(want, got) for a, b in zip(wa, ga))
            name = f"{'halos-only' if halos_only else 'padded'} {'+'.join(str(d)[6:] for d in layouts)} fwd+bwd on a stream"
            results.append({"check": name, "bit_identical": same})
            failures += not same
            h.L.lib().halo_plan_destroy(plan)

    if gpu and h.moves_cuda:
        hp, cp = h.plan([dt[torch.bfloat16]], True), h.plan([dt[torch.bfloat16]], True, cuda=True)
        host = tensors(torch, torch.bfloat16, True, "cpu", rank)
        dev_t = [t.to("cuda") for t in host]
        h.finish(h.start(hp, 0, host[:3], None))
        h.finish(h.start(cp, 0, dev_t[:3], sid1))
        torch.cuda.synchronize()
        # The CUDA plan leaves halo slices outside the sequence as they
        # were: compare the halo that comes from the other rank.
        same = torch.equal(host[2 if rank == 0 else 1].view(torch.int16), dev_t[2 if rank == 0 else 1].cpu().view(torch.int16))
        results.append({"check": "HALO_MEMORY_CUDA halos-only bf16 forward on a stream vs host plan", "bit_identical": same})
        failures += not same
    elif gpu:
        results.append({"check": "HALO_MEMORY_CUDA plan", "skipped": "this UCX does not move CUDA memory"})

    if True:  # collective: both ranks time
        plan = h.plan([dt[torch.bfloat16]], True)
        ts = tensors(torch, torch.bfloat16, True, "cpu", rank)
        if gpu:
            ts = [t.pin_memory() for t in ts]
        timing = {}
        for label, sid in (("no stream", None), ("stream", sid1)):
            blocked, total = [], []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                req = h.start(plan, 0, ts[:3], sid)
                t1 = time.perf_counter()
                h.finish(req)
                total.append(time.perf_counter() - t1 + (t1 - t0))
                blocked.append(t1 - t0)
            timing[label] = {"start_blocks_us": statistics.median(blocked) * 1e6,
                             "exchange_us": statistics.median(total) * 1e6}
        if rank == 0:
            results.append({"timing": "bf16 halos-only forward, x (1,4,6,10,12) dim 2 halos 2+1, median of %d" % args.iters,
                            **timing})
    for r in results:
        print(f"rank {rank}: {json.dumps(r)}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0) if gpu else "cpu (host-fake driver)",
                       "results": results, "failures": failures}, f, indent=1)
    h.lib.halo_comm_destroy(h.comm)
    return 1 if failures else 0


if __name__ == "__main__":
    a = parse(sys.argv[1:])
    r = os.environ.get(RANK_VAR)
    sys.exit(rank_main(a, int(r)) if r is not None else launch(a))
