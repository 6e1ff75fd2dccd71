"""halocp.diffusers under torch.compile(fullgraph=True): converted VAEs'
encode, decode and train step against the same models run eagerly, on gloo
groups of 2 and 3 local processes, one model per launch
(tests/python/ranks_diffusers_compile.py holds what each rank checks).
Named outside pytest's test_*.py pattern: ctest's python_diffusers_compile
runs it, and skips it when diffusers is not installed.

    python3 -m pytest -p no:cacheprovider tests/python/diffusers_compile.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher import expect_scenario, launch

pytest.importorskip("diffusers")

HERE = Path(__file__).resolve().parent
# (scenario, backend): inductor's decompositions are what guarded on a
# strided layer's unbacked output count (Eq(u, 0) in LayerNorm's backward);
# the "decompositions" backend traces with them and runs the graph eagerly,
# without inductor's minutes of C++ compiling on 2 CPUs.
MODELS = ["ltx", "cogvideox"]


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("model", MODELS)
def test_compiled(model, world):
    ranks = launch(HERE / "ranks_diffusers_compile.py", world, ["--backend=decompositions", model], timeout=240,
                   env={"OMP_NUM_THREADS": "1"})
    expect_scenario(ranks, model)
