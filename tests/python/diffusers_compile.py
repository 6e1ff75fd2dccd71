"""halocp.diffusers under torch.compile(fullgraph=True): converted VAEs'
encode, decode and train step against the same models run eagerly, on gloo
groups of 2 and 3 local processes, one model per launch
(tests/python/ranks_diffusers_compile.py holds what each rank checks).
Named outside pytest's test_*.py pattern: ctest's python_diffusers_compile
runs test_compiled, python_diffusers_compile_more test_compiled_more; both
skip when diffusers is not installed.

    python3 -m pytest -p no:cacheprovider tests/python/diffusers_compile.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher import expect_scenario, launch

pytest.importorskip("diffusers")

HERE = Path(__file__).resolve().parent
# One model per launch: LTX-Video on 2 ranks (uneven shards: where inductor
# first failed), CogVideoX on 3 (the fewest frames on rank 0, an empty rank 1),
# Wan, Mochi and HunyuanVideo on 2 (their frame check and attention as ops);
# the other pairs by hand (docs/diffusers.md), to keep the compiling short.
CASES = [("ltx", 2), ("cogvideox", 3), ("wan", 2), ("mochi", 2), ("hunyuan_video", 2)]
# The other layouts of those classes and LTX-2, apart (test_compiled_more, its
# own ctest: python_diffusers_compile_more), to keep each ctest's time bounded:
# Wan 2.2 on 3 (its shortcuts treat rank 0's first frame apart, alone there).
MORE_CASES = [("wan22", 3), ("hunyuan_video15", 2), ("ltx2", 2)]


def _compiled(model, world):
    # Each rank compiles on its own before its graph's first exchange: on a
    # loaded machine they get there tens of seconds apart (the launcher's
    # 20 s deadline timed out a 3-rank CogVideoX at a load of 14).
    ranks = launch(HERE / "ranks_diffusers_compile.py", world, [model], timeout=400,
                   env={"OMP_NUM_THREADS": "1", "HALO_TIMEOUT_MS": "120000"})
    expect_scenario(ranks, model)


@pytest.mark.parametrize("model,world", CASES, ids=[f"{m}-W{w}" for m, w in CASES])
def test_compiled(model, world):
    _compiled(model, world)


@pytest.mark.parametrize("model,world", MORE_CASES, ids=[f"{m}-W{w}" for m, w in MORE_CASES])
def test_compiled_more(model, world):
    _compiled(model, world)
