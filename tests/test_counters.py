from gpuscope.sampling.counters import RateIntegrator, ResetSafeCounter
from gpuscope.sampling.idle_dips import IdleDipCounter


def test_reset_safe_counter_starts_at_driver_total_and_survives_a_reset() -> None:
    c = ResetSafeCounter()
    assert c.update(1000.0) == 1000.0  # energy since the driver loaded
    assert c.update(1500.0) == 1500.0
    # Driver reload: the raw counter restarts at 0 and has counted 40 J since.
    assert c.update(40.0) == 1540.0
    assert c.update(100.0) == 1600.0


def test_rate_integrator_uses_trapezoids_over_real_intervals() -> None:
    r = RateIntegrator()
    assert r.update(100.0, at=10.0) == 0.0  # first reading: no interval yet
    assert r.update(300.0, at=12.0) == 400.0  # mean 200 B/s over 2 s
    assert r.update(300.0, at=12.0) == 400.0  # same instant adds nothing
    assert r.update(0.0, at=13.0) == 550.0


def _samples(values: list[float], step_us: int = 166_667) -> list[tuple[int, float]]:
    return [(i * step_us, v) for i, v in enumerate(values)]


def test_idle_dips_counts_runs_between_busy_samples() -> None:
    c = IdleDipCounter(threshold=0.25)
    # busy, dip, busy, dip (two samples), busy: two dips
    assert c.update(_samples([0.9, 0.1, 0.95, 0.0, 0.05, 0.9])) == 2


def test_idle_dips_ignores_leading_idle_and_an_unfinished_dip() -> None:
    c = IdleDipCounter(threshold=0.25)
    assert c.update(_samples([0.0, 0.0, 0.9, 0.1])) == 0  # idle start is not a dip; the last one is open
    assert c.update([(700_000, 0.8)]) == 1  # ... and is counted when the next tick closes it


def test_idle_dips_long_idle_period_is_not_a_dip() -> None:
    c = IdleDipCounter(threshold=0.25, max_duration_us=5_000_000)
    values = [0.9] + [0.0] * 60 + [0.9]  # 10 s idle between busy samples
    assert c.update(_samples(values)) == 0


def test_idle_dips_threshold_is_exclusive() -> None:
    c = IdleDipCounter(threshold=0.25)
    assert c.update(_samples([0.9, 0.25, 0.9])) == 0
    assert c.update([(10_000_000, 0.2), (10_200_000, 0.9)]) == 1
