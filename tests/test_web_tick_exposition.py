"""/metrics rendered once per sampling tick: the snapshot's families (``per_tick``) are collected and
rendered once per tick and format and served as bytes; the registry's are rendered on every request
after them. Driven through the WSGI app (gpuscope.web.app.AgentApp) with environ dicts, and once over
a real loopback socket. Renders are counted through the per-tick collector: a collector that counts
its ``collect`` calls (and can hold the first one) wraps the SnapshotCollector."""

from __future__ import annotations

import gzip
import http.client
import threading
import zlib
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from polling import wait_until
from snapshots import FakeSource, make_full_snapshot, make_gpu, make_snapshot

from gpuscope.exporters.exposition import negotiate
from gpuscope.exporters.families import CounterMetricFamily, Metric, Registry
from gpuscope.exporters.prometheus import SnapshotCollector
from gpuscope.snapshot import Snapshot
from gpuscope.web.app import AgentApp
from gpuscope.web.server import AgentHttpServer
from gpuscope.web.tick_exposition import MAX_FORMATS_PER_TICK

TEXT = "text/plain; version=0.0.4"
OPENMETRICS = "application/openmetrics-text; version=1.0.0"
# Each negotiated format the cache keys renders by: text 0.0.4, text 1.0.0 with an escaping scheme on
# the fast path, OpenMetrics, and an escaping scheme that prometheus_client's encoders serve.
ACCEPTS = (None, TEXT, "text/plain; version=1.0.0; escaping=allow-utf-8", OPENMETRICS,
           "application/openmetrics-text; version=1.0.0; escaping=dots")


class CountingCollector:
    """The per-tick collector seen through a seam: counts ``collect`` calls; with ``hold``, the
    first call waits until ``hold`` is set."""

    def __init__(self, inner: SnapshotCollector, hold: threading.Event | None = None) -> None:
        self._inner = inner
        self._hold = hold
        self.collects = 0
        self._lock = threading.Lock()

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            self.collects += 1
        if self._hold is not None:
            assert self._hold.wait(10), "never released"
        return self._inner.collect()


class CountingSource(FakeSource):
    """A FakeSource that counts ``latest()`` calls: every /metrics request reads it once to learn the
    tick before it looks for the tick's render."""

    def __init__(self, snapshot: Snapshot | None) -> None:
        super().__init__(snapshot=snapshot)
        self.latest_calls = 0
        self._lock = threading.Lock()

    def latest(self) -> Snapshot | None:
        with self._lock:
            self.latest_calls += 1
        return super().latest()


class RequestCounter:
    """A registry collector whose value changes on every collect, as the refused-request counts do
    between ticks."""

    def __init__(self) -> None:
        self.count = 0

    def collect(self) -> Iterable[Metric]:
        self.count += 1
        return self.family(self.count)

    @staticmethod
    def family(count: int) -> list[Metric]:
        return [CounterMetricFamily("test_requests", "Requests seen, in requests.", value=count)]


def make_app(snapshot: Snapshot | None = None, *, live: bool | RequestCounter = False,
             hold: threading.Event | None = None) -> tuple[AgentApp, CountingSource, CountingCollector]:
    source = CountingSource(snapshot if snapshot is not None else make_snapshot(monotonic=1000.0))
    per_tick = CountingCollector(SnapshotCollector(source, include_cmdline=True), hold)
    registry = Registry()
    if live:
        registry.register(live if isinstance(live, RequestCounter) else RequestCounter())
    app = AgentApp(registry, source, lambda: 1000.5, per_tick=per_tick)
    return app, source, per_tick


def scrape(app: AgentApp, accept: str | None = None, encoding: str | None = None, query: str = "",
           method: str = "GET") -> tuple[dict[str, str], bytes]:
    environ: dict[str, Any] = {"REQUEST_METHOD": method, "PATH_INFO": "/metrics", "QUERY_STRING": query}
    if accept is not None:
        environ["HTTP_ACCEPT"] = accept
    if encoding is not None:
        environ["HTTP_ACCEPT_ENCODING"] = encoding
    answer: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        answer["status"], answer["headers"] = status, headers

    body = b"".join(app(environ, start_response))
    assert answer["status"] == "200 OK", (answer, body)
    return dict(answer["headers"]), body


def one_gzip_member(data: bytes) -> bytes:
    """``data`` decompressed, asserting that it is a single complete gzip member (what every client
    reads, also those that stop after the first member)."""
    decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
    plain = decompressor.decompress(data) + decompressor.flush()
    assert decompressor.eof and decompressor.unused_data == b""
    return plain


def test_scrapes_within_one_tick_get_the_same_bytes_from_one_render() -> None:
    app, _, per_tick = make_app()
    first = scrape(app)
    second = scrape(app)
    assert first == second
    assert b"gpu_power_watts{" in first[1]
    assert per_tick.collects == 1
    assert app.tick_exposition is not None and app.tick_exposition.renders == 1


def test_a_new_tick_gives_the_new_values() -> None:
    app, source, per_tick = make_app(make_snapshot(gpus=[make_gpu(0, power_watts=100.5)]))
    _, before = scrape(app)
    assert b'gpu_power_watts{gpu="0",uuid=' in before and b"} 100.5\n" in before
    source.snapshot = make_snapshot(gpus=[make_gpu(0, power_watts=222.25)])
    _, after = scrape(app)
    assert b"} 222.25\n" in after and b"} 100.5\n" not in after
    assert per_tick.collects == 2


def test_an_equal_snapshot_of_a_new_tick_is_a_new_tick() -> None:
    # Ticks are told apart by the snapshot itself, not its value: two ticks can read alike.
    snapshot = make_snapshot()
    app, source, per_tick = make_app(snapshot)
    scrape(app)
    source.snapshot = replace(snapshot)
    scrape(app)
    assert per_tick.collects == 2


def test_a_snapshot_that_turns_stale_without_a_tick_loses_its_gpu_series_at_once() -> None:
    app, source, _ = make_app()
    assert b"gpu_up{" in scrape(app)[1]
    source.stale = True
    _, body = scrape(app)
    assert b"gpu_up{" not in body and b"gpuscope_nvml_up 1.0\n" in body


def test_before_the_first_tick_then_after_it() -> None:
    source = FakeSource(snapshot=None)
    app = AgentApp(Registry(), source, lambda: 1000.5, per_tick=SnapshotCollector(source))
    _, empty = scrape(app)
    assert b"gpuscope_nvml_up 0.0\n" in empty and b"gpu_up{" not in empty
    source.snapshot = make_snapshot(monotonic=1000.0)
    assert b"gpu_up{" in scrape(app)[1]


def test_the_registry_families_are_fresh_on_every_request_after_the_ticks() -> None:
    app, _, per_tick = make_app(live=True)
    for accept in (TEXT, OPENMETRICS):
        _, first = scrape(app, accept)
        _, second = scrape(app, accept)
        assert first != second
        assert first.rsplit(b"# HELP test_requests", 1)[0] == second.rsplit(b"# HELP test_requests", 1)[0]
        assert first.index(b"gpu_up{") < first.index(b"# HELP test_requests")
    assert b"test_requests_total 4.0\n" in second
    assert second.endswith(b"test_requests_total 4.0\n# EOF\n") and second.count(b"# EOF") == 1
    assert per_tick.collects == 1  # one collect for the tick, two formats rendered from it


def test_every_format_is_what_rendering_all_the_families_at_once_writes() -> None:
    requests = RequestCounter()
    app, source, _ = make_app(make_full_snapshot(), live=requests)
    for accept in ACCEPTS:
        for encoding in (None, "gzip"):
            headers, body = scrape(app, accept, encoding)
            encode, content_type = negotiate(accept)
            assert headers["Content-Type"] == content_type
            if encoding:
                assert headers["Content-Encoding"] == "gzip"
                body = one_gzip_member(body)
            # The registry's request counter, as that scrape collected it, then the tick's families.
            expected = encode([*SnapshotCollector(source, include_cmdline=True).collect(),
                               *RequestCounter.family(requests.count)])
            assert body == expected, accept


def test_gzip_is_one_stream_of_the_same_body_and_is_compressed_once_per_tick() -> None:
    app, _, _ = make_app(live=True)
    for accept in (TEXT, OPENMETRICS):
        headers, zipped = scrape(app, accept, "gzip")
        assert headers["Content-Encoding"] == "gzip" and headers["Content-Length"] == str(len(zipped))
        _, plain = scrape(app, accept)
        unzipped = one_gzip_member(zipped)
        assert gzip.decompress(zipped) == unzipped
        # The same but for the request counter, which each request moved on by one.
        assert unzipped.rsplit(b"test_requests_total", 1)[0] == plain.rsplit(b"test_requests_total", 1)[0]
    assert app.tick_exposition is not None and app.tick_exposition.renders == 2


def test_gzip_without_a_registry_part_is_the_tick_body() -> None:
    app, _, _ = make_app()
    _, zipped = scrape(app, encoding="gzip")
    _, again = scrape(app, encoding="gzip")
    _, plain = scrape(app)
    assert one_gzip_member(zipped) == one_gzip_member(again) == plain


def test_head_announces_the_length_of_the_get_body() -> None:
    app, _, _ = make_app()
    head_headers, head_body = scrape(app, method="HEAD")
    get_headers, get_body = scrape(app)
    assert head_body == b"" and head_headers["Content-Length"] == str(len(get_body))
    assert head_headers == get_headers


def test_concurrent_first_requests_of_a_tick_wait_for_one_render() -> None:
    hold = threading.Event()
    app, source, per_tick = make_app(hold=hold)
    scrapers = 12
    bodies: list[bytes] = []
    lock = threading.Lock()

    def one() -> None:
        _, body = scrape(app, encoding="gzip")
        with lock:
            bodies.append(one_gzip_member(body))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(scrapers)]
    for thread in threads:
        thread.start()
    # The first render is held until every request has read the tick (and so found no render yet):
    # each of them either waits for the held render or renders one of its own.
    wait_until(lambda: source.latest_calls >= scrapers and per_tick.collects >= 1)
    hold.set()
    for thread in threads:
        thread.join(10)
    assert len(bodies) == scrapers and len(set(bodies)) == 1
    assert per_tick.collects == 1
    assert app.tick_exposition is not None and app.tick_exposition.renders == 1


def test_filtered_requests_render_on_demand_from_the_ticks_and_the_registry_families() -> None:
    app, _, per_tick = make_app(live=True)
    _, body = scrape(app, query="name[]=gpu_power_watts&name[]=test_requests_total")
    lines = [line for line in body.decode().splitlines() if not line.startswith("#")]
    names = {line.split("{")[0].split(" ")[0] for line in lines}
    assert names == {"gpu_power_watts", "test_requests_total"}
    headers, zipped = scrape(app, OPENMETRICS, "gzip", query="name[]=gpu_up")
    text = one_gzip_member(zipped).decode()
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert text.startswith("# HELP gpu_up ") and text.endswith("# EOF\n") and "gpu_power" not in text
    scrape(app)  # the whole body: rendered from the families the filtered requests collected
    assert per_tick.collects == 1


def test_formats_past_the_bound_are_rendered_for_their_request_alone() -> None:
    app, _, _ = make_app()
    ticks = app.tick_exposition
    assert ticks is not None
    versions = [f"1.0.{patch}" for patch in range(MAX_FORMATS_PER_TICK + 2)]
    for version in versions:
        headers, body = scrape(app, f"application/openmetrics-text; version={version}")
        assert f"version={version}" in headers["Content-Type"] and body.endswith(b"# EOF\n")
    assert ticks.renders == len(versions)
    scrape(app, f"application/openmetrics-text; version={versions[0]}")  # kept: served as it was
    assert ticks.renders == len(versions)
    scrape(app, f"application/openmetrics-text; version={versions[-1]}")  # past the bound: again
    assert ticks.renders == len(versions) + 1


def test_the_http_server_serves_the_ticks_render_over_a_socket() -> None:
    source = FakeSource(snapshot=make_snapshot(monotonic=1000.0))
    per_tick = CountingCollector(SnapshotCollector(source))
    server = AgentHttpServer("127.0.0.1:0", registry=Registry(), per_tick=per_tick, source=source,
                             clock=lambda: 1000.5)
    server.start()
    try:
        host, port = server.bound_address
        bodies = []
        for encoding in ("identity", "gzip"):
            connection = http.client.HTTPConnection(host, port, timeout=5)
            try:
                connection.request("GET", "/metrics", headers={"Accept-Encoding": encoding})
                response = connection.getresponse()
                body = response.read()
                assert response.status == 200
                bodies.append(gzip.decompress(body) if encoding == "gzip" else body)
            finally:
                connection.close()
        assert bodies[0] == bodies[1] and b"gpu_up{" in bodies[0]
        assert per_tick.collects == 1
    finally:
        server.stop()


def test_a_request_that_read_an_older_snapshot_leaves_the_newer_ticks_render_in_place() -> None:
    older = make_snapshot(monotonic=999.0, gpus=[make_gpu(0, power_watts=100.5)])
    newer = make_snapshot(monotonic=1000.0, gpus=[make_gpu(0, power_watts=222.25)])
    app, source, per_tick = make_app(newer)
    scrape(app)
    source.snapshot = older  # as a request held up across the tick's end reads it
    _, body = scrape(app)
    assert b"} 100.5\n" in body  # what it read, rendered for it alone
    source.snapshot = newer
    _, body = scrape(app)
    assert b"} 222.25\n" in body
    assert per_tick.collects == 2  # the newer tick's render was kept
