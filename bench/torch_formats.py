#!/usr/bin/env python3
"""cp_halo_exchange of channels-last tensors: kept in their format, against
contiguous tensors and against converting to contiguous and back.

    python3 bench/torch_formats.py                     # both shapes, every dim, forward and backward
    python3 bench/torch_formats.py --iters 100 --json formats.json

One rank (the local copies are what differs by layout; no peer, so no
waiting on one), one torch thread, float32, halo 1 a side, for each dim of
a (1, 32, 64, 64) tile in channels_last and a (1, 32, 8, 32, 32) clip in
channels_last_3d:

  contiguous     a contiguous tensor
  kept           the tensor in its format, output and gradient in it too
                 (halocp's way: no conversion)
  converted      the tensor made contiguous, exchanged, and the result made
                 channels-last again (what a caller would do without it)

forward: the exchange under no_grad; backward: torch.autograd.grad of the
exchange's output (the graph kept), the gradient in the output's format.
Each time is the median of --rounds block means of --iters calls after a
warm-up, the variants alternating block by block. The targets (issue 20):
kept / contiguous at most 1.5 and kept / converted at most 1. The exit
status is 1 if a kept result differs from the contiguous one by a bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import ranks  # bench/ranks.py, beside this script


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=50, help="calls per block")
    ap.add_argument("--rounds", type=int, default=5, help="blocks per variant")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        return ranks.launch(__file__, 1, deadline=600)

    import torch
    import torch.distributed as dist

    import halocp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cases = [((1, 32, 64, 64), torch.channels_last, "channels_last", ("C", "H", "W")),
             ((1, 32, 8, 32, 32), torch.channels_last_3d, "channels_last_3d", ("C", "T", "H", "W"))]

    def timed(fns):
        return ranks.interleaved(fns, args.rounds, args.iters, warmup=5)

    def ex(t, dim):
        return halocp.cp_halo_exchange(t, 1, 1, dim)

    print(f"# halo 1 a side, float32, 1 rank, 1 torch thread; median of {args.rounds} blocks of {args.iters} calls")
    print(f"# {'shape':<18} {'format':<16} {'dim':<3} {'pass':<8} {'contiguous':>10} {'kept':>8} {'converted':>9}"
          f" {'kept/contig':>11} {'kept/conv':>9} {'#wrong':>6}")
    print(f"# {'':<18} {'':<16} {'':<3} {'':<8} {'us':>10} {'us':>8} {'us':>9} {'':>11} {'':>9} {'':>6}")
    rows, wrong_total, worst = [], 0, {"contiguous": 0.0, "converted": 0.0}
    for shape, fmt, fname, names in cases:
        x = torch.randn(shape)
        x_cl = x.contiguous(memory_format=fmt)
        for dim, dname in enumerate(names, start=1):
            with torch.no_grad():
                y, y_cl = ex(x, dim), ex(x_cl, dim)
            g = torch.randn(y.shape)
            g_cl = g.contiguous(memory_format=fmt)
            xr, xr_cl = x.clone().requires_grad_(), x_cl.clone().requires_grad_()
            yr, yr_cl = ex(xr, dim), ex(xr_cl, dim)
            gx, gx_cl = torch.autograd.grad(yr, xr, g, retain_graph=True)[0], \
                torch.autograd.grad(yr_cl, xr_cl, g_cl, retain_graph=True)[0]
            # A result not in the input's format counts as one wrong value.
            wrong = {"forward": int((y_cl != y).sum()) + (not y_cl.is_contiguous(memory_format=fmt)),
                     "backward": int((gx_cl != gx).sum()) + (not gx_cl.is_contiguous(memory_format=fmt))}
            xc = x_cl.contiguous().requires_grad_()
            yc = ex(xc, dim)

            def no_grad(fn):
                def run():
                    with torch.no_grad():
                        fn()
                return run

            fwd = timed({
                "contiguous": no_grad(lambda: ex(x, dim)),
                "kept": no_grad(lambda: ex(x_cl, dim)),
                "converted": no_grad(lambda: ex(x_cl.contiguous(), dim).contiguous(memory_format=fmt)),
            })
            bwd = timed({
                "contiguous": lambda: torch.autograd.grad(yr, xr, g, retain_graph=True),
                "kept": lambda: torch.autograd.grad(yr_cl, xr_cl, g_cl, retain_graph=True),
                "converted": lambda: torch.autograd.grad(yc, xc, g_cl.contiguous(), retain_graph=True)[0]
                .contiguous(memory_format=fmt),
            })
            for what, t in (("forward", fwd), ("backward", bwd)):
                r_cont, r_conv = t["kept"] / t["contiguous"], t["kept"] / t["converted"]
                worst["contiguous"], worst["converted"] = max(worst["contiguous"], r_cont), max(worst["converted"], r_conv)
                wrong_total += wrong[what]
                print(f"  {str(shape):<18} {fname:<16} {dname:<3} {what:<8} {t['contiguous']:>10.1f} {t['kept']:>8.1f}"
                      f" {t['converted']:>9.1f} {r_cont:>10.2f}x {r_conv:>8.2f}x {wrong[what]:>6}")
                rows.append({"shape": shape, "format": fname, "dim": dname, "pass": what, "us": t,
                             "kept_vs_contiguous": r_cont, "kept_vs_converted": r_conv, "wrong": wrong[what]})
    ok = wrong_total == 0
    print(f"# worst kept / contiguous {worst['contiguous']:.2f}x (target <= 1.5), worst kept / converted "
          f"{worst['converted']:.2f}x (target <= 1); {'all results bit-identical to the contiguous ones' if ok else f'{wrong_total} wrong values'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"iters": args.iters, "rounds": args.rounds, "rows": rows, "wrong": wrong_total}, f, indent=1)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
