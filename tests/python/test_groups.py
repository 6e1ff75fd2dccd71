"""Several context-parallel groups in one job: W = 4 gloo ranks, the groups
[0, 1] and [2, 3] at once, and the offset groups [0, 2] and [1, 3],
interleaved (tests/python/groups.py holds what each rank runs).

    python3 -m pytest -p no:cacheprovider tests/python/test_groups.py
"""

from __future__ import annotations

from pathlib import Path

from launcher import launch, report

HERE = Path(__file__).resolve().parent


def test_groups():
    ranks = launch(HERE / "groups.py", 4, timeout=150)
    for r in ranks:
        assert "RESULT groups ok" in r.stdout and r.returncode == 0, f"rank {r.rank}:\n{report(ranks)}"
