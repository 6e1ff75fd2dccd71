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
