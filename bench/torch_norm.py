#!/usr/bin/env python3
"""halocp.nn.GroupNorm's local work beside torch's GroupNorm, one process.

    python3 bench/torch_norm.py                       # (1, 32, 8, 64, 64) float32
    python3 bench/torch_norm.py --shape 1,64,16,64,64 --dtype bfloat16

The sharded layer on a group of one rank takes torch's GroupNorm, so this
runs its autograd Function directly with no group: the statistics, the
normalisation and the backward exactly as on W ranks, minus the two small
collectives. That is the cost of the layer beyond its communication, and
torch's fused kernels are the floor. Forward alone (no_grad) and forward +
backward (input, weight and bias gradients); median of --iters after a
warm-up, one thread; the ratio is against torch in the same run, and the
outputs and gradients are compared with torch's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from halocp.norm import _GroupNorm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=lambda s: tuple(int(v) for v in s.split(",")), default=(1, 32, 8, 64, 64),
                    help="N,C,T,H,W (default 1,32,8,64,64)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64", "float16", "bfloat16"))
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.shape, dtype=dtype, requires_grad=True)
    w = torch.randn(args.shape[1], dtype=dtype, requires_grad=True)
    b = torch.randn(args.shape[1], dtype=dtype, requires_grad=True)
    g = torch.randn(args.shape, dtype=dtype)
    variants = {"torch": lambda: F.group_norm(x, args.groups, w, b, 1e-5),
                "halocp": lambda: _GroupNorm.apply(x, w, b, args.groups, 1e-5, None, None)}

    def forward(fn):
        with torch.no_grad():
            return fn()

    def step(fn):
        x.grad = w.grad = b.grad = None
        y = fn()
        y.backward(g)
        return [y.detach(), x.grad, w.grad, b.grad]

    want, got = step(variants["torch"]), step(variants["halocp"])
    err = max(float((a.double() - e.double()).abs().max() / e.double().abs().max()) for a, e in zip(got, want))
    times = {(k, kind): [] for k in variants for kind in ("fwd", "fwd+bwd")}
    for _ in range(args.iters + 1):  # alternating, the first round a warm-up
        for k, fn in variants.items():
            for kind, run in (("fwd", forward), ("fwd+bwd", step)):
                t0 = time.perf_counter()
                run(fn)
                times[(k, kind)].append(time.perf_counter() - t0)
    ms = {key: statistics.median(v[1:]) * 1e3 for key, v in times.items()}
    print(f"# GroupNorm({args.groups}, {args.shape[1]}) on {args.shape} {args.dtype}, one thread, "
          f"median of {args.iters}")
    print("| variant | fwd ms | fwd+bwd ms | fwd+bwd vs torch |")
    print("| --- | --- | --- | --- |")
    for k in variants:
        print(f"| {k} | {ms[(k, 'fwd')]:.2f} | {ms[(k, 'fwd+bwd')]:.2f} | "
              f"{ms[(k, 'fwd+bwd')] / ms[('torch', 'fwd+bwd')]:.2f}x |")
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    print(f"# halocp vs torch: outputs and gradients differ by at most {err:.1e} of their largest magnitude "
          f"({'ok' if err < tol else 'FAILED'})")
    return 0 if err < tol else 1


if __name__ == "__main__":
    sys.exit(main())
