"""The suite's own helpers (tests/helpers/): a time limit that grows with the machine's load."""
import os

import pytest

from helpers import patient

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("load, cores, limit", [
    (0.5, 2, 240),      # idle: the given limit
    (2.0, 2, 240),      # each core busy: still the given limit
    (16.0, 2, 1920),    # 8 runnable processes per core: 8x
    (100.0, 2, 2400),   # at most 10x: a hang still fails
    (16.0, 64, 240),    # a big machine is not busy at that load
])
def test_a_time_limit_grows_with_the_load_per_core_up_to_ten_times(monkeypatch, load, cores, limit):
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load / 2, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert patient(240) == pytest.approx(limit)


def test_the_higher_of_the_one_and_five_minute_loads_counts(monkeypatch):
    """A load that has just dropped (a neighbour's job ended) may come back: the 5-minute
    average keeps the limit long."""
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 8.0, 8.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert patient(100) == pytest.approx(400)
