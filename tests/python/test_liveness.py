"""Dead peers and Ctrl-C through halocp (issue 31 §7), with every setting
at its default and a 30 s deadline, so that only finding out passes.

    python3 -m pytest -p no:cacheprovider tests/python/test_liveness.py
"""

from __future__ import annotations

from pathlib import Path

from launcher import launch, report

HERE = Path(__file__).resolve().parent
ENV = {"HALO_TIMEOUT_MS": "30000", "HALO_DETECT_PEER_FAILURE": ""}


def _result(r, ranks):
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")), "")
    assert line.startswith("RESULT ok "), f"rank {r.rank}: {line!r}\n{report(ranks)}"
    return float(line.split()[2]), line


def test_killed_rank_is_peer_failed_within_seconds():
    """Rank 1 of 3 is SIGKILLed between two exchanges: ranks 0 and 2 get
    PEER_FAILED naming rank 1 within 3 s, not a TIMEOUT after 30 s."""
    ranks = launch(HERE / "liveness_ranks.py", 3, ["kill"], timeout=60, env=ENV)
    for r in (ranks[0], ranks[2]):
        took, line = _result(r, ranks)
        assert took < 3.0, f"rank {r.rank} found the dead rank after {took} s\n{report(ranks)}"
        assert "code=5 " in line, line  # halocp.ERR_PEER_FAILED


def test_sigint_in_a_blocked_exchange_raises_keyboard_interrupt():
    """Rank 0 is blocked in an exchange that rank 1 does not join; a SIGINT
    raises KeyboardInterrupt within 2 s (the deadline is 30 s), the
    communicator is aborted, and rank 1 is told so when it comes back."""
    ranks = launch(HERE / "liveness_ranks.py", 2, ["sigint"], timeout=60, env=ENV)
    took, line = _result(ranks[0], ranks)
    assert took < 2.0, line
    took, line = _result(ranks[1], ranks)
    assert took < 3.0 and "code=5 " in line, line
