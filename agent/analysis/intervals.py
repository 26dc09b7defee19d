"""Sets of disjoint time intervals, for "how much of this window was the device busy" in O(log n).

A diagnosis asks the same few questions of every step (busy, waiting for input, behind a
synchronisation): each category's spans are merged once into an IntervalSet, whose prefix sums then
answer a window's covered time by two binary searches.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable


class IntervalSet:
    """Disjoint, sorted, half-open intervals [start, end) in microseconds."""

    __slots__ = ("_prefix", "ends", "starts")

    def __init__(self, starts: array[float], ends: array[float]) -> None:
        self.starts = starts
        self.ends = ends
        prefix = array("d", [0.0])
        total = 0.0
        for s, e in zip(starts, ends, strict=True):
            total += e - s
            prefix.append(total)
        self._prefix = prefix

    @classmethod
    def merge(cls, intervals: Iterable[tuple[float, float]]) -> IntervalSet:
        """The union of any intervals (overlapping, unsorted, empty ones ignored)."""
        return cls.from_sorted(sorted(i for i in intervals if i[1] > i[0]))

    @classmethod
    def from_sorted(cls, intervals: Iterable[tuple[float, float]]) -> IntervalSet:
        """The union of intervals that come sorted by start (a trace's columns): merged as they stream
        by, never held as a list."""
        starts, ends = array("d"), array("d")
        for s, e in intervals:
            if e <= s:
                continue
            if ends and s <= ends[-1]:
                ends[-1] = max(ends[-1], e)
            else:
                starts.append(s)
                ends.append(e)
        return cls(starts, ends)

    @classmethod
    def empty(cls) -> IntervalSet:
        return cls(array("d"), array("d"))

    def __len__(self) -> int:
        return len(self.starts)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return zip(self.starts, self.ends, strict=True)

    @property
    def total(self) -> float:
        return float(self._prefix[-1])

    def covered(self, a: float, b: float) -> float:
        """Time within [a, b) that the set covers."""
        if b <= a or not self.starts:
            return 0.0
        first = bisect_right(self.ends, a)  # the first interval ending after a
        last = bisect_left(self.starts, b)  # intervals [first, last) start before b
        if first >= last:
            return 0.0
        inside = self._prefix[last] - self._prefix[first]
        inside -= max(0.0, a - self.starts[first])
        inside -= max(0.0, self.ends[last - 1] - b)
        return inside

    def union(self, other: IntervalSet) -> IntervalSet:
        return IntervalSet.merge([*self, *other])

    def difference(self, other: IntervalSet) -> IntervalSet:
        """This set's time that ``other`` does not cover: ``other``'s gaps within each interval, which
        come sorted and disjoint."""
        starts, ends = array("d"), array("d")
        for s, e in self:
            for gap_start, gap_end in other.gaps(s, e):
                starts.append(gap_start)
                ends.append(gap_end)
        return IntervalSet(starts, ends)

    def intersection(self, other: IntervalSet) -> IntervalSet:
        return self.difference(self.difference(other))

    def gaps(self, a: float, b: float) -> list[tuple[float, float]]:
        """The uncovered runs within [a, b), in order."""
        out: list[tuple[float, float]] = []
        cursor = a
        i = bisect_right(self.ends, a)
        while i < len(self.starts) and self.starts[i] < b:
            if self.starts[i] > cursor:
                out.append((cursor, self.starts[i]))
            cursor = max(cursor, self.ends[i])
            i += 1
        if cursor < b:
            out.append((cursor, b))
        return out

    def gap_around(self, t: float) -> tuple[float, float] | None:
        """The uncovered run that contains or starts at ``t`` (from the end of the last interval before
        it to the start of the next), or None when ``t`` is covered."""
        i = bisect_right(self.starts, t)
        if i and self.ends[i - 1] > t:
            return None
        before = self.ends[i - 1] if i else float("-inf")
        after = self.starts[i] if i < len(self.starts) else float("inf")
        return before, after
