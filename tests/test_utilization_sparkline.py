"""The status page's sparklines from the driver's utilization samples: a GPU that drops to idle for a
fraction of every second shows it, though its per-tick utilization stays high; the sample rings stay
bounded, drop the repeats of overlapping batches, and give way to the per-tick values without samples."""

from __future__ import annotations

import re
from dataclasses import replace

from snapshots import make_gpu, make_gpus, make_snapshot

from gpuscope.snapshot import GpuReading, Snapshot, UtilizationSample
from gpuscope.web.sparkline import SPARK_HEIGHT, sparkline
from gpuscope.web.utilization_history import MAX_SAMPLES, UtilizationHistory, sample_capacity

SAMPLE_US = 166_667  # the driver's period: six samples a second
T0_US = 1_700_000_000_000_000
SAMPLES_EVERY = 5  # ticks between two reads of the samples (nvml.samples_interval at its default)


def dipping(first: int, last: int) -> tuple[UtilizationSample, ...]:
    """Driver samples ``first`` to ``last``: 96 % busy, but idle for one sample of each second."""
    return tuple(UtilizationSample(T0_US + k * SAMPLE_US, 0.0 if k % 6 == 0 else 0.96)
                 for k in range(first, last + 1))


def feed(history: UtilizationHistory, ticks: int, gpu: GpuReading, *, overlap: int = 6) -> Snapshot:
    """``ticks`` ticks of 1 s of a dipping GPU whose per-tick utilization reads 80 %; its samples come
    in a batch every SAMPLES_EVERY ticks, each repeating the previous batch's last ``overlap``."""
    snapshot = make_snapshot(gpus=[gpu])
    for tick in range(1, ticks + 1):
        batch: tuple[UtilizationSample, ...] = ()
        if tick % SAMPLES_EVERY == 0:
            batch = dipping(max(0, (tick - SAMPLES_EVERY) * 6 - overlap), tick * 6 - 1)
        reading = replace(gpu, utilization_ratio=0.8, utilization_samples=batch)
        snapshot = replace(snapshot, gpus=(reading,), monotonic=100.0 + tick)
        history.observe(snapshot)
    return snapshot


def drawn_values(svg: str) -> list[float]:
    """The utilizations (0-1) that a sparkline's polygons reach, from their y coordinates."""
    ys = [int(point.split(",")[1]) for shape in re.findall(r'<polygon points="([^"]+)"', svg)
          for point in shape.split()]
    return [(SPARK_HEIGHT - 1 - y) / (SPARK_HEIGHT - 2) for y in ys]


def test_a_gpu_idle_for_a_fraction_of_each_second_shows_its_dips() -> None:
    history = UtilizationHistory()  # 60 ticks of 1 s: a minute
    gpu = make_gpu(0)
    feed(history, 300, gpu)
    series = history.series(0, gpu.uuid)
    assert series.values[-1] == 0.8  # what the per-tick reading says: busy
    svg = sparkline(series, history.points)
    assert "<polygon" in svg and '<polyline class="mean"' in svg  # the samples' band, and their mean
    values = drawn_values(svg)
    assert min(values) < 0.05  # the dips to idle reach the bottom
    assert max(values) > 0.9
    # The mean line stays near the GPU's level (the dips take a sixth of each second), not at an edge.
    (mean_points,) = re.findall(r'<polyline class="mean" points="([^"]+)"', svg)
    means = [(SPARK_HEIGHT - 1 - float(p.split(",")[1])) / (SPARK_HEIGHT - 2) for p in mean_points.split()]
    assert all(0.5 < mean < 0.95 for mean in means), means
    # The newest sample at the right edge; a minute of samples across the width.
    xs = [int(point.split(",")[0]) for point in re.findall(r'<polygon points="([^"]+)"', svg)[0].split()]
    assert max(xs) == 120 and min(xs) <= 2
    # Bounded: the samples of the last minute, each once though every batch repeated a second.
    assert len(series.samples) <= sample_capacity(60.0)
    assert 60 * 6 - 6 <= len(series.samples) <= 60 * 6 + 1
    ages = [age for age, _ in series.samples]
    assert ages == sorted(ages, reverse=True) and len(set(ages)) == len(ages)
    assert ages[0] <= 60.0 and ages[-1] == 0.0


def test_the_sample_ring_has_a_hard_cap() -> None:
    history = UtilizationHistory(points=600)  # ten minutes at 1 s, at 10 s a tick: 100 minutes
    gpu = make_gpu(0)
    burst = tuple(UtilizationSample(T0_US + k * 1000, 0.5) for k in range(3 * MAX_SAMPLES))  # 1 ms apart
    snapshot = make_snapshot(gpus=[replace(gpu, utilization_samples=burst)], interval_seconds=10.0)
    history.observe(snapshot)
    assert len(history.series(0, gpu.uuid).samples) == MAX_SAMPLES
    assert sample_capacity(1e9) == MAX_SAMPLES


def test_the_page_draws_the_dips_of_a_gpu_with_samples_and_the_ticks_of_one_without() -> None:
    history = UtilizationHistory()
    gpus = make_gpus(2)
    snapshot = make_snapshot(gpus=gpus)
    for tick in range(1, 31):
        dips = dipping((tick - 1) * 6, tick * 6 - 1)
        readings = (replace(gpus[0], utilization_ratio=0.8, utilization_samples=dips),
                    replace(gpus[1], utilization_ratio=0.8, utilization_samples=()))
        snapshot = replace(snapshot, gpus=readings, monotonic=float(tick))
        history.observe(snapshot)
    with_samples = sparkline(history.series(0, gpus[0].uuid), history.points)
    without = sparkline(history.series(1, gpus[1].uuid), history.points)
    assert min(drawn_values(with_samples)) < 0.05
    assert "<polygon" not in without and len(re.findall(r"\d+\.\d,\d+\.\d", without)) == 30


def test_a_gpu_whose_samples_stop_falls_back_to_its_per_tick_values() -> None:
    history = UtilizationHistory(points=10)
    gpu = make_gpu(0)
    snapshot = feed(history, 10, gpu)
    assert history.series(0, gpu.uuid).samples
    for tick in range(1, 12):  # the samples reads fail: no batch for more than the span
        history.observe(replace(snapshot, gpus=(replace(gpu, utilization_samples=()),),
                                monotonic=snapshot.monotonic + tick))
    assert history.series(0, gpu.uuid).samples == ()
    fallback = sparkline(history.series(0, gpu.uuid), history.points)
    assert "<polyline" in fallback and "<polygon" not in fallback and 'class="mean"' not in fallback


def test_a_replaced_gpu_starts_without_the_old_ones_samples() -> None:
    history = UtilizationHistory()
    gpu = make_gpu(0)
    snapshot = feed(history, 10, gpu)
    other = replace(gpu, uuid="GPU-replacement", utilization_samples=())
    history.observe(replace(snapshot, gpus=(other,), monotonic=snapshot.monotonic + 1))
    assert history.series(0, other.uuid).samples == ()
    assert history.series(0, gpu.uuid).samples == ()


def test_a_driver_clock_that_starts_again_starts_the_ring_again() -> None:
    history = UtilizationHistory()
    gpu = make_gpu(0)
    snapshot = feed(history, 10, gpu)
    early = (UtilizationSample(1000, 0.25), UtilizationSample(1000 + SAMPLE_US, 0.5))
    history.observe(replace(snapshot, gpus=(replace(gpu, utilization_samples=early),),
                            monotonic=snapshot.monotonic + 1))
    assert [value for _, value in history.series(0, gpu.uuid).samples] == [0.25, 0.5]
