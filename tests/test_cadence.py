"""The one cadence of the sampler's occasional reads and the alert engine's evaluation."""

from __future__ import annotations

import pytest

from gpuscope.common.cadence import Cadence


def ticks(cadence: Cadence, times: list[float]) -> list[float]:
    """The ticks at which it is done."""
    done = []
    for now in times:
        if cadence.due(now):
            cadence.done(now)
            done.append(now)
    return done


def test_due_at_the_first_tick_then_every_period_with_half_a_tick_of_slack() -> None:
    # Ticks a little late or early: every 10 s stays every 10 s, not every 11.
    times = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 9.6, 10.6, 11.6, 19.55, 20.5, 29.6]
    assert ticks(Cadence(10.0, 1.0), times) == [0.0, 9.6, 19.55, 29.6]


def test_a_zero_period_is_every_tick_and_a_reset_is_due_at_once() -> None:
    every = Cadence(0.0, 1.0)
    assert every.every_tick and ticks(every, [0.0, 1.0, 2.0]) == [0.0, 1.0, 2.0]
    cadence = Cadence(60.0, 1.0)
    assert not cadence.every_tick
    assert ticks(cadence, [0.0, 1.0, 2.0]) == [0.0]
    cadence.reset()
    assert ticks(cadence, [3.0, 4.0]) == [3.0]


def test_the_tick_may_change_between_ticks() -> None:
    cadence = Cadence(5.0, 1.0)
    cadence.done(0.0)
    assert not cadence.due(4.0)  # 4 s < 5 - 0.5
    cadence.tick_seconds = 2.0
    assert cadence.due(4.0)  # 4 s >= 5 - 1


def test_a_negative_period_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"-1.0 s"):
        Cadence(-1.0, 1.0)
