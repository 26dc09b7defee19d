"""`gpuscope report` without a Prometheus: flags, times, credentials, the queries, and every failure of
the HTTP API as one line on stderr (a tiny stand-in server on loopback plays the failing server)."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest

from gpuscope.cli.main import main
from gpuscope.cli.report import as_table, largest_remainder, parse_span, parse_time
from gpuscope.report.build import Report, Row, build_report
from gpuscope.report.client import Auth, PrometheusClient, PrometheusError
from gpuscope.report.promql import OWNERS, Queries

NOW = 1_704_672_000.0  # 2024-01-08T00:00:00Z


def test_spans_and_times() -> None:
    assert parse_span("7d") == 7 * 86400
    assert parse_span("1w2d3h") == 9 * 86400 + 3 * 3600
    assert parse_span("7 days") is None
    assert parse_time("7d", NOW) == NOW - 7 * 86400
    assert parse_time("1704067200", NOW) == 1_704_067_200
    assert parse_time("2024-01-01T00:00:00Z", NOW) == 1_704_067_200
    assert parse_time("2024-01-01T02:00:00+02:00", NOW) == 1_704_067_200
    for wrong in ("2024-01-01T00:00:00", "yesterday", "-5", "nan"):
        with pytest.raises(ValueError):
            parse_time(wrong, NOW)


@pytest.mark.parametrize("by", list(OWNERS))
def test_every_query_sums_by_the_owner_and_reads_counters_with_increase(by: str) -> None:
    for recorded in (False, True):
        columns = Queries(by, range_s=604800, step_s=60, recorded=recorded).columns()
        for promql in columns.values():
            assert promql.startswith(f"sum by ({', '.join(OWNERS[by])}) (")
    raw = Queries(by, range_s=604800, step_s=60).columns()
    assert "increase(" in raw["busy"] and "increase(" in raw["energy"]
    assert "[604800s:60s]" in raw["held"] and "rate(gpu_busy_seconds_total[60s]) < 0.05" in raw["held_idle"]


def test_a_step_under_a_minute_reads_idleness_over_the_last_minute() -> None:
    """rate() over a window as short as the scrape interval holds one sample and is empty: a held GPU
    would then never count as idle. The step's subquery keeps its resolution; the rate's range does not
    go under a minute."""
    short = Queries("pod", range_s=3600, step_s=15).columns()["held_idle"]
    assert "rate(gpu_busy_seconds_total[60s]) < 0.05" in short and "[3600s:15s]" in short
    long = Queries("pod", range_s=3600, step_s=300).columns()["held_idle"]
    assert "rate(gpu_busy_seconds_total[300s]) < 0.05" in long


class _Handler(BaseHTTPRequestHandler):
    answer: tuple[int, bytes] = (200, b"")
    seen: list[tuple[str, dict[str, list[str]]]] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        self.seen.append((self.headers.get("Authorization", ""), parse_qs(self.rfile.read(length).decode())))
        status, body = self.answer
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def server(status: int, body: Any) -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("Handler", (_Handler,), {"answer": (status, json.dumps(body).encode()
                                                        if not isinstance(body, bytes) else body),
                                            "seen": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def run(capsys: pytest.CaptureFixture[str], url: str, *args: str) -> tuple[int, str]:
    code = main(["report", "--prometheus", url, "--since", "7d", *args])
    return code, capsys.readouterr().err


EMPTY = {"status": "success", "data": {"resultType": "vector", "result": []}}


def test_an_empty_range_says_there_is_no_data(capsys: pytest.CaptureFixture[str]) -> None:
    with server(200, EMPTY) as (url, _):
        code = main(["report", "--prometheus", url, "--since", "2024-01-01T00:00:00Z",
                     "--until", "2024-01-08T00:00:00Z"])
        err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("gpuscope report: no GPU process data in the range")
    assert "2024-01-01T00:00:00Z to 2024-01-08T00:00:00Z" in err


def test_basic_auth_is_sent_and_a_401_names_the_credentials(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    with server(401, b"Unauthorized") as (url, handler):
        code, err = run(capsys, url, "--basic-auth-user", "report",
                        "--basic-auth-password-file", str(password))
    assert code == 1
    assert handler.seen[0][0] == "Basic " + base64.b64encode(b"report:s3cret").decode()
    assert "answered HTTP 401: the credentials given were refused" in err


def test_a_rejected_query_quotes_the_servers_reason(capsys: pytest.CaptureFixture[str]) -> None:
    body = {"status": "error", "errorType": "bad_data", "error": "1:5: parse error: unexpected"}
    with server(400, body) as (url, _):
        code, err = run(capsys, url)
    assert code == 1
    assert "rejected the query (HTTP 400): 1:5: parse error: unexpected" in err


def test_an_unreachable_server_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with server(200, EMPTY) as (url, _):
        pass  # closed: nothing listens there any more
    code, err = run(capsys, url)
    assert code == 1
    assert err == f"gpuscope report: cannot reach {url}: connection refused\n"


def test_a_non_prometheus_answer_and_an_oversized_one(capsys: pytest.CaptureFixture[str]) -> None:
    with server(200, b"<html>login</html>") as (url, _):
        code, err = run(capsys, url)
    assert code == 1 and "did not answer with Prometheus API JSON" in err
    big = {"status": "success", "data": {"resultType": "vector", "result": ["x" * 5000]}}
    with server(200, big) as (url, _), pytest.raises(PrometheusError, match="larger than the 1000 bytes"):
        PrometheusClient(url, max_bytes=1000).query("up", NOW)


def test_the_credentials_and_the_query_reach_the_server() -> None:
    with server(200, EMPTY) as (url, handler):
        PrometheusClient(url, auth=Auth(bearer_token="abc123")).query("up", NOW)
        PrometheusClient(url, auth=Auth(user="u", password="p")).query("up", NOW)
    (bearer, form), (basic, _) = handler.seen
    assert bearer == "Bearer abc123" and form == {"query": ["up"], "time": [f"{NOW:.3f}"]}
    assert basic == "Basic " + base64.b64encode(b"u:p").decode()


@pytest.mark.parametrize(("args", "message"), [
    (["--basic-auth-user", "u"], "--basic-auth-user needs --basic-auth-password-file"),
    (["--basic-auth-password-file", "/nonexistent"], "--basic-auth-password-file needs --basic-auth-user"),
    (["--bearer-token-file", "/nonexistent/token"], "cannot read the bearer token file /nonexistent/token"),
    (["--until", "8d"], "the range is empty"),
])
def test_wrong_flags_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], args: list[str],
                                          message: str) -> None:
    code, err = run(capsys, "http://127.0.0.1:9", *args)
    assert code == 2
    assert message in err and err.count("\n") == 1


def test_an_url_that_is_not_http_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(capsys, "prometheus:9090")
    assert code == 1 and "is not an http:// or https:// URL" in err


# -- the table's rounding ----------------------------------------------------------------------------------


def table_report(rows: list[Row]) -> Report:
    total = Row(owner={"user": ""}, **{name: sum(getattr(r, name) for r in rows) for name in (
        "held_gpu_hours", "busy_gpu_hours", "held_idle_gpu_hours", "energy_kwh", "alerts_fired")})
    return Report(by="user", owner_labels=("user",), start=NOW - 3600, end=NOW, step_s=60, recorded=False,
                  rows=rows, total=total, idle_energy_kwh=None, captures_by_node={})


def test_the_rows_as_printed_add_up_to_the_total_as_printed() -> None:
    rows = [Row(owner={"user": name}, held_gpu_hours=1.04, busy_gpu_hours=0.33, held_idle_gpu_hours=0.26,
                energy_kwh=0.1234) for name in ("alice", "bob", "carol")]
    table = as_table(table_report(rows)).splitlines()
    cells = [line.split() for line in table[2:6]]
    assert [c[0] for c in cells] == ["alice", "bob", "carol", "TOTAL"]
    for column in (1, 2, 4, 5):  # held, busy, held idle, energy
        printed = [float(c[column]) for c in cells]
        assert round(sum(printed[:3]), 2) == printed[3], (column, printed)
    # The TOTAL is the exact total, rounded: 3.12 GPU-h held, 0.99 busy, 0.78 idle, 0.3702 kWh.
    assert cells[3][1:6] == ["3.1", "1.0", "32%", "0.8", "0.37"]
    # The largest remainders get the missing units; equal ones go to the rows listed first.
    assert [c[1] for c in cells[:3]] == ["1.1", "1.0", "1.0"]
    assert [c[2] for c in cells[:3]] == ["0.4", "0.3", "0.3"]


def test_largest_remainder() -> None:
    assert largest_remainder([0.26, 0.26, 0.26], 1) == [3, 3, 2]
    assert largest_remainder([0.04, 0.04, 0.04, 0.04], 1) == [1, 1, 0, 0]  # 0.16 -> 0.2
    assert largest_remainder([], 1) == [] and largest_remainder([2.0], 2) == [200]


# -- GPUs time-sliced between pods ---------------------------------------------------------------------


def series(value: float, **labels: str) -> dict[str, Any]:
    return {"metric": labels, "value": [NOW, str(value)]}


class CannedPrometheus:
    """Answers each query with what it was given for exactly that query (else nothing)."""

    def __init__(self, answers: dict[str, list[dict[str, Any]]]) -> None:
        self.answers = answers

    def query(self, promql: str, at: float) -> list[dict[str, Any]]:
        return self.answers.get(promql, [])


@pytest.mark.parametrize("by", ["pod", "namespace"])
def test_a_time_sliced_gpus_processes_are_shared_among_its_pods(by: str) -> None:
    """The demo's GPU 2, time-sliced between llm-pretrain-2 and eval-nightly: its processes carry no
    pod labels, so without the pods of gpu_pod_info they would make one row of no owner."""
    queries = Queries(by, 3600, 60)
    split = replace(queries, by_gpu_too=True)
    gpu0 = {"instance": "demo:9847", "gpu": "0", "uuid": "GPU-0"}
    gpu2 = {"instance": "demo:9847", "gpu": "2", "uuid": "GPU-2"}
    owner = {"pod": {"namespace": "research", "pod": "llm-pretrain-0"},
             "namespace": {"namespace": "research"}}[by]
    nobody = {label: "" for label in queries.owner_labels}
    answers = {
        queries.held_seconds(): [series(3600, **owner), series(3600, **nobody)],
        queries.busy_seconds(): [series(3456, **owner), series(3168, **nobody)],
        queries.energy_joules(): [series(1.8e6, **owner), series(1.8e6, **nobody)],
        queries.alerts_fired(): [series(1, **nobody)],
        split.held_seconds(): [series(3600, **gpu0, **owner), series(3600, **gpu2, **nobody)],
        split.busy_seconds(): [series(3456, **gpu0, **owner), series(3168, **gpu2, **nobody)],
        split.energy_joules(): [series(1.8e6, **gpu0, **owner), series(1.8e6, **gpu2, **nobody)],
        split.alerts_fired(): [series(1, **gpu2, **nobody)],
        queries.pods_of_gpus(): [
            series(1, **gpu0, namespace="research", pod="llm-pretrain-0"),
            series(1, **gpu2, namespace="research", pod="llm-pretrain-2"),
            series(1, **gpu2, namespace="research", pod="eval-nightly")],
    }
    report = build_report(CannedPrometheus(answers), queries, NOW - 3600, NOW)  # type: ignore[arg-type]
    rows = {tuple(r.owner.values()): r for r in report.rows}
    assert ("",) * len(queries.owner_labels) not in rows, "no row of no owner is left"
    if by == "pod":
        sliced = [rows["research", "llm-pretrain-2"], rows["research", "eval-nightly"]]
        assert [(r.held_gpu_hours, r.busy_gpu_hours, r.alerts_fired) for r in sliced] == [(0.5, 0.44, 1)] * 2
        assert rows["research", "llm-pretrain-0"].busy_gpu_hours == 0.96
    else:
        (research,) = rows.values()  # both shares, and the namespace's own pod
        assert (research.held_gpu_hours, round(research.busy_gpu_hours, 6)) == (2.0, 1.84)
    assert report.total.held_gpu_hours == 2.0 and round(report.total.energy_kwh, 6) == 1.0
    assert report.total.alerts_fired == (2 if by == "pod" else 1), "an alert counts for each pod"
    assert any("time-sliced between pods" in note for note in report.notes)
