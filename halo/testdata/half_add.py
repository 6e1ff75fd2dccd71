"""Writes half_add.json: torch's float16 and bfloat16 additions, for the
kernels' test (halo/add_test.go). Run with a python that has torch:

    python3 halo/testdata/half_add.py > halo/testdata/half_add.json

For every dtype: the sums of every 16-bit pattern a with each b of B (the
list below), as a SHA-256 of the results (uint16, little-endian, b-major),
and the results for a in B spelled out, so that a mismatch names its pair.
torch adds elementwise in its scalar loop here (the operands are strided);
its vectorised loop differs only in NaN results (see bench/RESULTS.md).
"""
import hashlib
import json
import random

import torch

SPECIAL = {
    torch.float16: [0x0000, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0xfe00, 0x7c01, 0xfd55, 0x7fff,
                    0x0001, 0x8001, 0x03ff, 0x83ff, 0x0400, 0x8400, 0x7bff, 0xfbff, 0x3c00,
                    0xbc00, 0x3c01, 0x1400, 0x5bff, 0x0002, 0x7800],
    torch.bfloat16: [0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0xffc0, 0x7f81, 0xffa5, 0x7fff,
                     0x0001, 0x8001, 0x007f, 0x807f, 0x0080, 0x8080, 0x7f7f, 0xff7f, 0x3f80,
                     0xbf80, 0x3f81, 0x3b80, 0x4b7f, 0x0002, 0x7f00],
}


def add(dtype, a, b):
    """a + b in dtype through torch's elementwise (non-vectorised) loop."""
    def strided(v):
        t = torch.zeros(2 * len(v), dtype=torch.int16)[::2]
        t.copy_(torch.tensor(v, dtype=torch.int32).to(torch.int16))
        return t.view(dtype)
    x = strided(a)
    x.add_(strided(b))
    return [v & 0xFFFF for v in x.view(torch.int16).tolist()]


def main():
    rng = random.Random(13)
    out = {}
    for dtype, name in [(torch.float16, "float16"), (torch.bfloat16, "bfloat16")]:
        B = SPECIAL[dtype] + [rng.randrange(1 << 16) for _ in range(16)]
        every = list(range(1 << 16))
        h = hashlib.sha256()
        for b in B:
            for v in add(dtype, every, [b] * len(every)):
                h.update(v.to_bytes(2, "little"))
        table = [add(dtype, [a] * len(B), B) for a in B]
        out[name] = {"b": B, "sha256": h.hexdigest(), "table": table}
    out["torch"] = torch.__version__
    print(json.dumps(out, separators=(",", ":")))


if __name__ == "__main__":
    main()
