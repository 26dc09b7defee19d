"""The /metrics body of the current sampling tick, rendered once per format and served as bytes.

Every scraper of a tick asks for the same families: rendering them for each request made a scrape's
cost grow with the number of scrapers (50 at once queued behind 50 renders, one at a time under
Python's lock). The families split in two:

* **the tick's**: those of the collector whose families are a function of the sampler's latest
  Snapshot and of whether it is stale (``SnapshotCollector``: the ``gpu_*`` and per-process series
  and the sampler's own ``gpuscope_*`` families, the bulk of the body). They are collected once per
  tick, on the first request that needs them, and rendered once per negotiated format (Content-Type:
  text 0.0.4, OpenMetrics, each escaping scheme) on the first request for that format; the bytes and,
  on the first request that accepts gzip, their gzip are served to every request until the next tick.
  A tick is the snapshot (by identity) and its staleness: a snapshot that turns stale without a new
  tick starts a new one, so frozen ``gpu_*`` values are never served from the cache.
* **the rest**: what changes between ticks (requests refused, the agent's CPU and memory, the health
  of sources other than the sampler, captures, alerts). They are collected and rendered on every
  request and appended after the tick's (a few hundred bytes): they are never stale.

Concurrent first requests of a tick wait for one render rather than each rendering (a lock per tick:
rendering is CPU work under Python's lock, so rendering in parallel would gain nothing). Only the
current tick is kept, with at most ``MAX_FORMATS_PER_TICK`` formats; a request for one more format
(an Accept header can name any OpenMetrics version) is rendered for that request alone.

gzip: the tick's part is deflated once, ending with a sync flush (on a byte boundary, its last block
not final); each request deflates only its own part, as the final blocks after it, and the body is
one gzip member (one header, one CRC-32 and length of the whole), as any client expects. Nothing of
the compressor is kept between requests (a deflate state is some 256 KiB).
"""

from __future__ import annotations

import struct
import threading
import zlib
from dataclasses import dataclass, field

from gpuscope.exporters.exposition import Encoder, is_openmetrics, without_eof
from gpuscope.exporters.families import Collector, Metric
from gpuscope.snapshot import Snapshot, SnapshotSource

MAX_FORMATS_PER_TICK = 8  # text 0.0.4, OpenMetrics and a few escaping schemes; more is a client's oddity
# gzip's member header (RFC 1952): deflate, no flags, no modification time, no extra flags, OS unknown.
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
_TAIL_WINDOW_BITS = 12  # the per-request part is a few hundred bytes: a 4 KiB window is plenty


class TickRender:
    """One format's render of the tick's families: the bytes, and their deflate once gzip is asked for."""

    def __init__(self, body: bytes, gzip_level: int) -> None:
        self.body = body
        self._gzip_level = gzip_level
        self._lock = threading.Lock()
        self._deflated: tuple[bytes, int] | None = None  # the body's deflate blocks and its CRC-32

    def plain(self, rest: bytes) -> bytes:
        """The body with ``rest`` (the per-request part) after the tick's."""
        return self.body + rest

    def gzip(self, rest: bytes) -> bytes:
        """The gzip of ``plain(rest)``, one member: the tick's deflate blocks (compressed once, ending
        on a byte boundary and not final), then ``rest`` compressed on its own as the final blocks, with
        the CRC-32 and length of the whole."""
        deflated, crc = self._deflate()
        tail = zlib.compressobj(self._gzip_level, zlib.DEFLATED, -_TAIL_WINDOW_BITS)
        size = (len(self.body) + len(rest)) & 0xFFFFFFFF
        return b"".join((_GZIP_HEADER, deflated, tail.compress(rest), tail.flush(),
                         struct.pack("<II", zlib.crc32(rest, crc), size)))

    def _deflate(self) -> tuple[bytes, int]:
        deflated = self._deflated
        if deflated is None:
            with self._lock:  # the first gzip request compresses, any other at the same time waits
                deflated = self._deflated
                if deflated is None:
                    compressor = zlib.compressobj(self._gzip_level, zlib.DEFLATED, -zlib.MAX_WBITS)
                    # A sync flush ends the blocks on a byte boundary without marking the last one final.
                    blocks = compressor.compress(self.body) + compressor.flush(zlib.Z_SYNC_FLUSH)
                    deflated = self._deflated = (blocks, zlib.crc32(self.body))
        return deflated


@dataclass
class _Tick:
    snapshot: Snapshot | None
    stale: bool
    lock: threading.Lock = field(default_factory=threading.Lock)
    families: list[Metric] | None = None
    renders: dict[str, TickRender] = field(default_factory=dict)


class TickExposition:
    """The tick's families of ``per_tick`` (see the module's docstring), collected and rendered once
    per tick of ``source``. ``renders`` counts the renders made, for the benchmark and tests."""

    def __init__(self, per_tick: Collector, source: SnapshotSource, *, gzip_level: int) -> None:
        self._per_tick = per_tick
        self._source = source
        self._gzip_level = gzip_level
        self._lock = threading.Lock()
        self._tick = _Tick(snapshot=None, stale=False)  # before the first tick: no snapshot yet
        self.renders = 0

    def render(self, content_type: str, encode: Encoder) -> TickRender:
        """The tick's families in the format ``encode`` writes (named by ``content_type``), without
        the OpenMetrics ``# EOF`` line: the per-request part after it ends the body."""
        tick = self._current()
        render = tick.renders.get(content_type)
        if render is not None:
            return render
        with tick.lock:
            render = tick.renders.get(content_type)
            if render is not None:  # rendered while this request waited
                return render
            render = TickRender(self._encode(tick, content_type, encode), self._gzip_level)
            if len(tick.renders) < MAX_FORMATS_PER_TICK:
                tick.renders[content_type] = render
            return render

    def families(self) -> list[Metric]:
        """The tick's families (collected once per tick); for the filtered requests, which render
        on demand. The families are shared: a caller copies before it changes one."""
        tick = self._current()
        with tick.lock:
            return self._families(tick)

    def _encode(self, tick: _Tick, content_type: str, encode: Encoder) -> bytes:
        body = encode(self._families(tick))
        with self._lock:
            self.renders += 1
        return without_eof(body) if is_openmetrics(content_type) else body

    def _families(self, tick: _Tick) -> list[Metric]:
        """(Called holding ``tick.lock``.)"""
        if tick.families is None:
            tick.families = list(self._per_tick.collect())
        return tick.families

    def _current(self) -> _Tick:
        """The current tick's entry; a new one (the last one's renders dropped) when the snapshot or
        its staleness changed. A request that read the snapshot before the one already kept (it was
        held up while a tick ended) gets an entry of its own, so that it cannot evict the newer tick's."""
        snapshot = self._source.latest()
        stale = self._source.snapshot_is_stale()
        with self._lock:
            tick = self._tick
            if tick.snapshot is snapshot and tick.stale == stale:
                return tick
            kept = tick.snapshot
            if snapshot is not None and kept is not None and snapshot.monotonic < kept.monotonic:
                return _Tick(snapshot=snapshot, stale=stale)
            tick = self._tick = _Tick(snapshot=snapshot, stale=stale)
            return tick

