"""The status page's utilization sparklines: small inline SVGs, newest at the right edge.

A GPU with driver samples gets an envelope: the sparkline's width is cut into two-pixel columns of
time, each filled (lightly) from the lowest to the highest sample that falls in it (a pixel at
least), so a dip to idle shorter than a column still reaches the bottom while a steady GPU is a
thin line; a darker line joins the columns' mean values, so a GPU that swings between idle and busy
shows both its range and its level. The band is one polygon per stretch of samples (a gap where the
driver kept none, e.g. while the GPU was down), on whole pixels, the points in line with their
neighbours left out: a few hundred bytes for a steady GPU, a few kilobytes for one that swings
every column, as the page holds one per GPU and reloads every few seconds. Where a GPU has no
samples, and for a MIG device, a polyline through its per-tick values.
"""

from __future__ import annotations

import math

from gpuscope.web.utilization_history import UtilizationSeries

SPARK_WIDTH, SPARK_HEIGHT = 120, 28
# The envelope's columns: two pixels each, so that a 60-tick sparkline at the default 1 s interval has
# a column per second. A job that idles part of every step then fills each column from idle to busy
# rather than alternate between an idle column and a busy one, which reads as two dotted lines.
COLUMN_PX = 2
COLUMNS = SPARK_WIDTH // COLUMN_PX
# Samples further apart than this are a gap (the driver kept none), not a stretch to join up.
GAP_SECONDS = 1.5


def sparkline(series: UtilizationSeries, slots: int) -> str:
    """Utilization 0-100 % as an inline SVG: the driver samples' envelope when the series has samples,
    else a polyline through the last ``slots`` per-tick values (gaps where unread)."""
    if series.samples and series.window_seconds > 0:
        shapes = _envelope(series.samples, series.window_seconds)
    else:
        shapes = _per_tick(series.values[-slots:], slots)
    return (f'<svg class="spark" width="{SPARK_WIDTH}" height="{SPARK_HEIGHT}" '
            f'viewBox="0 0 {SPARK_WIDTH} {SPARK_HEIGHT}" role="img" aria-label="utilization history">'
            f'<rect width="{SPARK_WIDTH}" height="{SPARK_HEIGHT}"/>{shapes}</svg>')


def _y(value: float) -> float:
    """The SVG y of a utilization (y grows downwards: 100 % is near the top, 0 near the bottom)."""
    return SPARK_HEIGHT - 1 - min(1.0, max(0.0, value)) * (SPARK_HEIGHT - 2)


def _per_tick(values: tuple[float | None, ...], slots: int) -> str:
    step = SPARK_WIDTH / max(1, slots - 1)
    offset = SPARK_WIDTH - (len(values) - 1) * step
    runs: list[list[str]] = [[]]
    for i, value in enumerate(values):
        if value is None or not math.isfinite(value):
            runs.append([])
            continue
        runs[-1].append(f"{offset + i * step:.1f},{_y(value):.1f}")
    lines = "".join(f'<polyline points="{" ".join(run)}"/>' for run in runs if len(run) > 1)
    dots = "".join(f'<circle cx="{run[0].split(",")[0]}" cy="{run[0].split(",")[1]}" r="1.2"/>'
                   for run in runs if len(run) == 1)
    return lines + dots


def _envelope(samples: tuple[tuple[float, float], ...], window: float) -> str:
    """``samples``: (seconds before the newest, value), oldest first, none older than ``window``."""
    # Per column: [lowest, highest, sum, count] of the samples that fall in it.
    stats: list[list[float] | None] = [None] * COLUMNS

    def extend(column: int, value: float, *, counted: bool = True) -> None:
        known = stats[column]
        if known is None:
            stats[column] = [value, value, value if counted else 0.0, 1.0 if counted else 0.0]
            return
        known[0], known[1] = min(known[0], value), max(known[1], value)
        if counted:
            known[2] += value
            known[3] += 1.0

    previous: tuple[int, float, float] | None = None  # (column, age, value) of the sample before
    for age, value in samples:
        if not math.isfinite(value) or not math.isfinite(age):
            continue
        column = min(COLUMNS - 1, max(0, COLUMNS - 1 - math.floor(age / window * COLUMNS)))
        extend(column, value)
        # Columns narrower than the driver's sample period fall between two samples: they get the
        # stretch from one to the other, as a line joining them would.
        if previous is not None and previous[1] - age <= GAP_SECONDS:
            for between in range(previous[0] + 1, column):
                extend(between, previous[2], counted=False)
                extend(between, value, counted=False)
        previous = (column, age, value)
    shapes = []
    run: list[tuple[int, list[float]]] = []  # the columns of the current stretch, with their stats
    for column, known in enumerate([*stats, None]):
        if known is not None:
            run.append((column, known))
        elif run:
            shapes.append(_band(run[0][0], [(_y(k[1]), _y(k[0])) for _, k in run]))
            shapes.append(_mean_line(run))
            run = []
    return "".join(shapes)


def _mean_line(run: list[tuple[int, list[float]]]) -> str:
    """The mean of each column's samples, through the columns' centres (a column between two samples
    takes the mean of its range)."""
    points: list[tuple[float, float]] = []
    for column, (lowest, highest, total, count) in run:
        mean = total / count if count else (lowest + highest) / 2
        point = (column * COLUMN_PX + COLUMN_PX / 2, round(_y(mean), 1))
        # A point level with the two before it adds nothing to the line: the middle one goes.
        if len(points) >= 2 and points[-2][1] == points[-1][1] == point[1]:
            points.pop()
        points.append(point)
    if len(points) == 1:
        return f'<circle class="mean" cx="{points[0][0]:g}" cy="{points[0][1]:g}" r="1.2"/>'
    return f'<polyline class="mean" points="{" ".join(f"{x:g},{y:g}" for x, y in points)}"/>'


def _band(start: int, columns: list[tuple[float, float]]) -> str:
    """One polygon over consecutive columns from ``start``: (top y, bottom y) each, whole pixels."""
    top = []
    bottom = []
    for offset, (upper, lower) in enumerate(columns):
        x = (start + offset) * COLUMN_PX
        high = round(upper)
        low = max(round(lower), high + 1)  # at least a pixel tall: a steady GPU is a line, not nothing
        top += [(x, high), (x + COLUMN_PX, high)]
        bottom += [(x, low), (x + COLUMN_PX, low)]
    points = _simplified(top + bottom[::-1])
    return f'<polygon points="{" ".join(f"{x},{y}" for x, y in points)}"/>'


def _simplified(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The points less repeats and those on the straight segment between their neighbours."""
    kept: list[tuple[int, int]] = []
    for point in points:
        while len(kept) >= 2 and _between(kept[-2], kept[-1], point):
            kept.pop()
        if not kept or point != kept[-1]:
            kept.append(point)
    return kept


def _between(before: tuple[int, int], middle: tuple[int, int], after: tuple[int, int]) -> bool:
    """Whether ``middle`` lies on the horizontal or vertical segment from ``before`` to ``after``."""
    if before[0] == middle[0] == after[0]:
        return min(before[1], after[1]) <= middle[1] <= max(before[1], after[1])
    if before[1] == middle[1] == after[1]:
        return min(before[0], after[0]) <= middle[0] <= max(before[0], after[0])
    return False
