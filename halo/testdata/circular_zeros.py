"""Writes circular_zeros.json: where torch's circular padding backward adds
+0, for the padding oracle (halo/oracle_test.go). Run with a python that
has torch:

    python3 halo/testdata/circular_zeros.py > halo/testdata/circular_zeros.json
    python3 halo/testdata/circular_zeros.py --check halo/testdata/circular_zeros.json

Adding +0 changes nothing but a -0 sum, which it turns into +0: so which
slices of the gradient get one is seen only on an all -0 output gradient.
For every global length T up to MAX_T and halos L, R <= T (torch's limit):
a string of T characters, '+' where the slice's gradient comes out +0, '-'
where it stays -0. The check also confirms the order of the additions the
oracle assumes (a slice's own gradient, then the right slot's copy of it,
then the left slot's), on values whose sums round differently in any other
order. PyTorch 1.13 and 2.15 give the same table.
"""
import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

MAX_T = 16


def grad(T, L, R, g):
    x = torch.zeros(1, 1, T, dtype=torch.float64, requires_grad=True)
    F.pad(x, (L, R), mode="circular").backward(g.view(1, 1, -1))
    return x.grad.view(-1)


def zeros_mask(T, L, R):
    got = grad(T, L, R, torch.full((T + L + R,), -0.0, dtype=torch.float64))
    return "".join("-" if math.copysign(1.0, v) < 0 else "+" for v in got.tolist())


def order_holds(T, L, R):
    """torch's sums equal own + right copy + left copy, in that order, on
    operands of mixed magnitudes (any other order rounds differently)."""
    scale = torch.tensor([1e16, 1.0, -1e16, 3.0])
    g = torch.randn(T + L + R, dtype=torch.float64, generator=torch.Generator().manual_seed(T * 100 + L * 10 + R))
    g = g * scale.repeat(T + L + R)[: T + L + R].double()
    got = grad(T, L, R, g)
    for p in range(T):
        v = g[L + p]
        if p < R:
            v = v + g[L + T + p]
        if p >= T - L:
            v = v + g[p - (T - L)]
        if v.item() != got[p].item():
            return False
    return True


def table():
    return [[T, L, R, zeros_mask(T, L, R)] for T in range(1, MAX_T + 1) for L in range(T + 1) for R in range(T + 1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", help="compare this torch with a written table instead of writing one")
    args = ap.parse_args()
    if not args.check:
        json.dump({"torch": torch.__version__, "max_T": MAX_T, "cases": table()}, sys.stdout, separators=(",", ":"))
        sys.stdout.write("\n")
        return 0
    with open(args.check) as f:
        want = {tuple(c[:3]): c[3] for c in json.load(f)["cases"]}
    bad = [f"T {T} L {L} R {R}: torch {m}, table {want.get((T, L, R))}" for T, L, R, m in table()
           if want.get((T, L, R)) != m]
    bad += [f"T {T} L {L} R {R}: torch adds in another order" for T in range(1, 9) for L in range(T + 1)
            for R in range(T + 1) if not order_holds(T, L, R)]
    for line in bad[:20]:
        print(line)
    print(f"torch {torch.__version__}: {len(want)} cases, {len(bad)} differ from {args.check}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
