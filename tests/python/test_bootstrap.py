"""Making a group's communicator when a rank never comes.

    python3 -m pytest -p no:cacheprovider tests/python/test_bootstrap.py
"""

from __future__ import annotations

from pathlib import Path

from launcher import launch, report

HERE = Path(__file__).resolve().parent


def test_absent_rank_is_named_within_the_bootstrap_timeout():
    """Rank 2 of 3 is alive but never calls the exchange: ranks 0 and 1 fail
    with a HaloError (ERR_RENDEZVOUS) naming rank 2 after the bootstrap
    timeout of 3 s, not torch's RuntimeError after its 30 minutes."""
    ranks = launch(HERE / "absent_rank.py", 3, timeout=40,
                   env={"HALO_BOOTSTRAP_TIMEOUT_MS": "3000", "ABSENT_FOR": "6"})
    for r in ranks[:2]:
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")), "")
        assert line.startswith("RESULT ok "), f"rank {r.rank}: {line!r}\n{report(ranks)}"
        took = float(line.split()[2])
        assert 2.5 <= took <= 10, f"rank {r.rank} failed after {took} s, bootstrap timeout 3 s\n{report(ranks)}"
        assert "code=7 " in line, line  # halocp.ERR_RENDEZVOUS
        assert "rank 2 of 3 did not take part" in line, line
        assert "HALO_BOOTSTRAP_TIMEOUT_MS" in line, line
    assert ranks[2].returncode == 0, report(ranks)
