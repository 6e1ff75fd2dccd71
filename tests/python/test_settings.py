"""HALO_* settings set from Python before the communicator is made apply
(tests/python/ranks_settings.py holds what each rank runs).

    python -m pytest -p no:cacheprovider tests/python/test_settings.py
"""

from __future__ import annotations

from pathlib import Path

from launcher import expect_scenario, launch

HERE = Path(__file__).resolve().parent


def test_timeout_set_from_python():
    ranks = launch(HERE / "ranks_settings.py", 2, ["timeout_from_python"], timeout=90)
    expect_scenario(ranks, "timeout_from_python")


def test_bootstrap_timeout_read_by_the_library(monkeypatch):
    """halocp reads HALO_BOOTSTRAP_TIMEOUT_MS through libhalo
    (halo_setting_get), so it takes what the library takes and refuses what
    it refuses, naming it; before, it parsed the value by rules of its own
    and fell back to 60 s on anything it could not read."""
    import sys

    import pytest

    sys.path.insert(0, str(HERE.parents[1] / "python"))
    import halocp
    from halocp import _comm

    for value, seconds in (("", 60.0), ("1500", 1.5), ("2s", 2.0), ("250ms", 0.25)):
        monkeypatch.setenv("HALO_BOOTSTRAP_TIMEOUT_MS", value)
        assert _comm.bootstrap_timeout() == seconds, value
    for bad in ("banana", "-5", "1e3"):
        monkeypatch.setenv("HALO_BOOTSTRAP_TIMEOUT_MS", bad)
        with pytest.raises(halocp.HaloError) as e:
            _comm.bootstrap_timeout()
        assert e.value.code == halocp.ERR_INVALID_ARGUMENT and "HALO_BOOTSTRAP_TIMEOUT_MS" in str(e.value), bad
