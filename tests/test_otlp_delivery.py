"""Delivery (gpuscope.otlp.delivery, transport) against a loopback receiver: what is retried and when
(Retry-After, back-off with jitter), what is refused, the bounded queue while the receiver never
answers, the flush at stop, the self-metrics, and credentials that never reach a log."""

from __future__ import annotations

import email.utils
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from otlp_receiver import otlp_receiver
from polling import wait_until
from snapshots import FakeSource, make_gpu, make_snapshot

from gpuscope.exporters.families import CounterMetricFamily
from gpuscope.health import SourceHealth
from gpuscope.otlp.config import OtlpConfig
from gpuscope.otlp.delivery import OtlpExporter
from gpuscope.otlp.encode import RequestEncoder
from gpuscope.otlp.factory import ProcessExport, SnapshotFamilies, build_otlp
from gpuscope.otlp.proto import load_protos
from gpuscope.otlp.self_metrics import OtlpCollector
from gpuscope.otlp.target import ExportTarget, resolve_target
from gpuscope.otlp.transport import HttpTransport, PushResult, payload, retry_after_seconds
from gpuscope.snapshot import Snapshot

SECRET = "Bearer s3cr3t-0tlp-t0ken"
ROOT = Path(__file__).resolve().parent.parent


def target(url: str, **changes: Any) -> ExportTarget:
    base = ExportTarget(url=url, protocol="http/protobuf", timeout_seconds=5.0, compression="none",
                        headers=())
    return replace(base, **changes)


def encoder() -> Callable[[Snapshot], bytes]:
    families = SnapshotFamilies(ProcessExport(), interval_seconds=1.0)
    encode = RequestEncoder(load_protos(), start_time=1.7e9)

    def run(snapshot: Snapshot) -> bytes:
        body: bytes = encode.encode(snapshot, families.families(snapshot)).SerializeToString()
        return body

    return run


class Ticking:
    """A source whose every latest() is a new snapshot, one second on: each push has something new."""

    def __init__(self) -> None:
        self.source = FakeSource(self.next)
        self.n = 0

    def next(self) -> Snapshot:
        self.n += 1
        return make_snapshot(gpus=(make_gpu(0),), timestamp=1.7e9 + self.n)


class Scripted:
    """A Transport answering from a list, then "sent"; records each push."""

    def __init__(self, *results: PushResult) -> None:
        self.results = list(results)
        self.pushed: list[bytes] = []

    def push(self, body: bytes, timeout: float) -> PushResult:
        self.pushed.append(body)
        return self.results.pop(0) if self.results else PushResult("sent", "200")

    def close(self) -> None:
        pass


def exporter(transport: Any, source: Any = None, **options: Any) -> OtlpExporter:
    settings: dict[str, Any] = dict(endpoint="http://receiver", interval_seconds=3600.0, timeout_seconds=5.0,
                                    max_queue=4)
    settings.update(options)
    encode = lambda s: repr(s.timestamp).encode()  # noqa: E731 - what is pushed does not matter here
    return OtlpExporter(source or Ticking().source, encode, transport, **settings)


# -- the transport -------------------------------------------------------------------------------------------


def test_http_answers_become_outcomes() -> None:
    date = email.utils.formatdate(1_000_030.0, usegmt=True)
    with otlp_receiver() as receiver:
        receiver.answers = [(503, {"Retry-After": "7"}), (429, {"Retry-After": date}), (502, {}),
                            (400, {}), (401, {}), (500, {}), (200, {})]
        gzip_target = target(receiver.url, compression="gzip", headers=(("X-Tenant", "a"),))
        transport = HttpTransport(gzip_target)
        body = payload(gzip_target, encoder()(make_snapshot()))
        results = [transport.push(body, 5.0) for _ in range(7)]
        transport.close()
    assert [(r.outcome, r.reason) for r in results] == [
        ("retry", "503"), ("retry", "429"), ("retry", "502"), ("refused", "400"), ("refused", "401"),
        ("refused", "500"), ("sent", "200")]
    assert results[0].retry_after == 7.0
    assert results[1].retry_after is not None and results[1].retry_after <= 30.0
    assert results[2].retry_after is None
    first = receiver.received[0]
    assert first.path == "/v1/metrics" and first.headers["Content-Type"] == "application/x-protobuf"
    assert first.headers["Content-Encoding"] == "gzip" and first.headers["X-Tenant"] == "a"
    assert first.request.resource_metrics[0].scope_metrics[0].metrics  # decoded after gunzip


def test_retry_after_reads_seconds_and_dates() -> None:
    assert retry_after_seconds("12") == 12.0
    assert retry_after_seconds(email.utils.formatdate(100.0, usegmt=True), now=90.0) == 10.0
    assert retry_after_seconds("99999") == 300.0  # capped
    assert retry_after_seconds("soon") is None and retry_after_seconds(None) is None


def test_a_kept_alive_connection_closed_meanwhile_is_opened_again_at_once() -> None:
    import socket

    with otlp_receiver(keep_alive=True) as receiver:
        transport = HttpTransport(target(receiver.url))
        body = encoder()(make_snapshot())
        assert transport.push(body, 5.0).outcome == "sent"
        connection = transport._connection
        assert connection is not None and connection.sock is not None  # kept alive
        connection.sock.shutdown(socket.SHUT_RDWR)  # as a receiver's idle timeout would leave it
        assert transport.push(body, 5.0).outcome == "sent"
        transport.close()
    assert receiver.count() == 2


def test_a_receiver_that_is_not_there_is_retried() -> None:
    with otlp_receiver() as receiver:
        url = receiver.url
    result = HttpTransport(target(url)).push(b"", 1.0)
    assert result.outcome == "retry" and result.reason == "connection refused"


# -- retries and refusals ------------------------------------------------------------------------------------


def test_retry_after_is_honoured_then_delivery_resumes() -> None:
    with otlp_receiver() as receiver:
        receiver.answers = [(503, {"Retry-After": "1"})]
        # A back-off of 30 s: delivery within wait_until's 10 s is the receiver's Retry-After at work.
        push = OtlpExporter(Ticking().source, encoder(), HttpTransport(target(receiver.url)),
                            endpoint=receiver.url, interval_seconds=3600.0, timeout_seconds=5.0, max_queue=4,
                            retry_initial_seconds=30.0)
        push.start()
        wait_until(lambda: push.counts()["sent"] == 1)
        assert receiver.count() == 2
        assert receiver.received[0].request == receiver.received[1].request  # the same request, again
        assert push.retries == 1 and push.queue_length() == 0 and push.last_success() is not None
        push.stop(timeout=1.0)


def test_the_delay_is_the_receivers_retry_after() -> None:
    push = exporter(Scripted(PushResult("retry", "503", retry_after=7.0)), retry_initial_seconds=1.0)
    push.enqueue_latest()
    assert push._send_head() == 7.0


def test_back_off_doubles_to_its_ceiling_with_jitter() -> None:
    failing = Scripted(*[PushResult("retry", "connection refused")] * 9)
    for jitter, scale in ((lambda: 1.0, 1.0), (lambda: 0.0, 0.5)):
        failing.results = [PushResult("retry", "connection refused")] * 9
        push = exporter(failing, jitter=jitter, retry_initial_seconds=1.0, retry_max_seconds=60.0)
        push.enqueue_latest()
        delays = [push._send_head() for _ in range(9)]
        assert delays == [scale * d for d in (1, 2, 4, 8, 16, 32, 60, 60, 60)]
        assert push.queue_length() == 1 and push.retries == 9  # kept while it is retried


def test_refusals_are_dropped_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    transport = Scripted(PushResult("refused", "400"), PushResult("refused", "400"),
                         PushResult("refused", "401"))
    push = exporter(transport)
    with caplog.at_level(logging.ERROR, logger="gpuscope.otlp"):
        for _ in range(4):
            push.enqueue_latest()
            assert push._send_head() == 0.0
    assert push.counts() == {"sent": 1, "failed": 3, "dropped": 0} and push.retries == 0
    assert push.queue_length() == 0 and len(transport.pushed) == 4
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 2 and "(400)" in refusals[0] and "(401)" in refusals[1]


def test_nothing_new_nothing_pushed() -> None:
    snapshot = make_snapshot()
    source = FakeSource(snapshot)
    push = exporter(Scripted(), source)
    assert push.enqueue_latest() is True
    assert push.enqueue_latest() is False  # the same snapshot
    source.snapshot = replace(snapshot, timestamp=snapshot.timestamp + 1)
    source.stale = True
    assert push.enqueue_latest() is False  # a stale one: the sampler is stuck
    source.snapshot = None
    assert push.enqueue_latest() is None


# -- a receiver that never answers ---------------------------------------------------------------------------


def test_the_queue_stays_bounded_while_the_receiver_never_answers() -> None:
    with otlp_receiver() as receiver:
        receiver.hang.set()
        push = OtlpExporter(Ticking().source, encoder(), HttpTransport(target(receiver.url)),
                            endpoint=receiver.url, interval_seconds=0.02, timeout_seconds=0.2, max_queue=3,
                            retry_initial_seconds=0.05, retry_max_seconds=0.1)
        lengths: list[int] = []
        push.start()
        wait_until(lambda: lengths.append(push.queue_length()) or push.counts()["dropped"] >= 5, timeout=60.0)
        assert max(lengths) <= 3 and push.retries >= 1 and push.counts()["sent"] == 0
        push.stop(timeout=0.3)
    counts = push.counts()
    assert push.queue_length() == 0 and counts["sent"] == 0
    assert counts["dropped"] >= 5 + 1  # what was queued at stop counted too


def test_stop_flushes_the_latest_snapshot() -> None:
    with otlp_receiver() as receiver:
        push = OtlpExporter(Ticking().source, encoder(), HttpTransport(target(receiver.url)),
                            endpoint=receiver.url, interval_seconds=3600.0, timeout_seconds=5.0, max_queue=4)
        push.start()
        wait_until(lambda: receiver.count() == 1)
        push.stop(timeout=2.0)
    assert receiver.count() == 2 and push.counts() == {"sent": 2, "failed": 0, "dropped": 0}


# -- credentials ---------------------------------------------------------------------------------------------


def test_header_values_from_a_file_are_sent_and_never_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text(SECRET + "\n")
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_HEADERS"):
        monkeypatch.delenv(name, raising=False)
    with otlp_receiver() as receiver, caplog.at_level(logging.DEBUG):
        receiver.answers = [(401, {}), (503, {"Retry-After": "0"})]
        config = OtlpConfig.model_validate({"enabled": True, "endpoint": receiver.url, "interval": "1s",
                                            "headers": {"Authorization": {"file": str(token)}}})
        health = SourceHealth()
        export = build_otlp(config, FakeSource(Ticking().next), processes=ProcessExport(), start_time=1.7e9,
                            health=health)
        export.exporter.start()
        wait_until(lambda: export.exporter.counts()["sent"] >= 1)
        export.exporter.stop(timeout=1.0)
        logging.getLogger("gpuscope.otlp").info("target: %r", export.target)
    assert receiver.received[0].headers["Authorization"] == SECRET
    assert export.exporter.counts()["failed"] == 1 and export.exporter.retries == 1
    assert health.runs()["otlp"].success  # the last push was accepted
    assert "refused a push (401)" in caplog.text
    assert SECRET not in caplog.text and "s3cr3t" not in caplog.text
    assert export.target.header_names == ("Authorization",)
    assert SECRET not in repr(resolve_target(config))


# -- the self-metrics ----------------------------------------------------------------------------------------


def test_the_self_metrics_render_exactly_their_catalogue_section() -> None:
    from test_exporter import CATALOGUE, CatalogueRow, _exposed_name, catalogue_section, parse_catalogue

    push = exporter(Scripted(PushResult("retry", "503")))
    push.enqueue_latest()
    push._send_head()
    push._send_head()
    families = list(OtlpCollector(push, max_queue=4).collect())
    emitted = set()
    for family in families:
        (labels,) = {frozenset(s.labels) for s in family.samples}
        emitted.add(CatalogueRow(_exposed_name(family), family.type, family.unit, labels,
                                 family.documentation))
    documented = set(parse_catalogue(catalogue_section(CATALOGUE.read_text(), "OTLP export")))
    assert emitted == documented
    (exports,) = [f for f in families
                  if isinstance(f, CounterMetricFamily) and f.name == "gpuscope_otlp_exports"]
    assert {s.labels["outcome"]: s.value for s in exports.samples} == {"sent": 1.0, "failed": 0.0,
                                                                       "dropped": 0.0}


# -- gRPC ----------------------------------------------------------------------------------------------------


def test_grpc_pushes_with_metadata_and_maps_status_codes() -> None:
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc

    from gpuscope.otlp.transport import GrpcTransport

    answers = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK]
    received: list[tuple[Any, dict[str, str]]] = []

    class Service(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            received.append((request, dict(context.invocation_metadata())))
            code = answers.pop(0)
            if code != grpc.StatusCode.OK:
                context.abort(code, "scripted")
            return metrics_service_pb2.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        transport = GrpcTransport(target(f"http://127.0.0.1:{port}", protocol="grpc", compression="gzip",
                                         headers=(("X-Tenant", "a"),)))
        body = encoder()(make_snapshot())
        results = [transport.push(body, 5.0) for _ in range(3)]
        transport.close()
    finally:
        server.stop(0)
    assert [(r.outcome, r.reason) for r in results] == [
        ("retry", "UNAVAILABLE"), ("refused", "INVALID_ARGUMENT"), ("sent", "OK")]
    request, metadata = received[-1]
    assert metadata["x-tenant"] == "a"
    assert request.resource_metrics[0].scope_metrics[0].metrics
