"""`gpuscope report`: who held how many GPU-hours, and how many of them idle, across the fleet.

    gpuscope report --prometheus http://prometheus:9090 --since 7d [--until 1d] [--by pod] [--json|--csv]
    gpuscope report --prometheus http://prometheus:9090 --since 7d --by cause [--by namespace] [--horizon 24h]

The figures come from the Prometheus (or Thanos, Mimir: the same HTTP API) that scrapes every node's
agent; docs/report.md defines each column and its PromQL. By cause, the rows come from each GPU's
latest analysed capture (report/cause_promql.py) and print through report_cause.py. Exit codes: 0
with a report, 1 when the server cannot answer or has no data in the range, 2 for wrong flags or
unreadable credential files. Errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpuscope.cli.report_cause import cause_as_csv, cause_as_json, cause_as_table
from gpuscope.common.durations import format_duration, parse_duration
from gpuscope.report.build import NoData, Report, Row, build_report
from gpuscope.report.cause_build import CauseReport, build_cause_report
from gpuscope.report.cause_promql import CAUSE, CAUSE_OWNERS, DEFAULT_HORIZON_S, CauseQueries
from gpuscope.report.client import Auth, PrometheusClient, PrometheusError, tls_context
from gpuscope.report.promql import OWNERS, RECORDED_STEP_S, Queries

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
MAX_SECRET_BYTES = 64 * 1024
MAX_STEPS = 100_000  # steps per subquery: a week at 6 s
_SPAN = re.compile(r"(\d+)(w|d|h|m|s)")
_SPAN_UNITS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_span(text: str) -> int | None:
    """Seconds of a Prometheus-style span such as 7d, 36h or 1w2d; None when ``text`` is not one."""
    parts = _SPAN.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(int(n) * _SPAN_UNITS[u] for n, u in parts)


def parse_time(text: str, now: float) -> float:
    """Unix seconds from a span back from ``now`` (7d), Unix seconds, or an RFC 3339 time."""
    text = text.strip()
    span = parse_span(text)
    if span is not None:
        return now - span
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if math.isfinite(seconds) and seconds >= 0:
            return seconds
        raise ValueError(f"{text!r} is not a time")
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"expected a span back from now (7d, 36h), Unix seconds or an RFC 3339 time "
                         f"(2024-05-01T00:00:00Z), got {text!r}") from None
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone: add Z or an offset such as +02:00")
    return moment.timestamp()


def _step(text: str) -> int:
    try:
        seconds = parse_duration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    if seconds < 1 or seconds != int(seconds):
        raise argparse.ArgumentTypeError(f"a whole number of seconds, at least 1s, got {text!r}")
    return int(seconds)


def _horizon(text: str) -> int:
    seconds = parse_span(text)
    if seconds is None or seconds < 60:
        raise argparse.ArgumentTypeError(f"a span of at least 1m such as 24h or 7d, got {text!r}")
    return seconds


def _timeout(text: str) -> float:
    try:
        seconds = parse_duration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"more than 0, got {text!r}")
    return seconds


def add_report_command(subparsers: Any) -> None:
    report = subparsers.add_parser(
        "report", help="GPU-hours held, busy and held idle, energy and alerts per owner over a time range, "
                       "from the Prometheus that scrapes the agents.")
    report.add_argument("--prometheus", required=True, metavar="URL",
                        help="Base URL of the Prometheus-compatible query API (Prometheus, Thanos Query, "
                             "Mimir's /prometheus prefix), e.g. http://prometheus:9090.")
    report.add_argument("--since", required=True, metavar="TIME",
                        help="Start of the range: a span back from now (7d, 36h, 1w), Unix seconds or an "
                             "RFC 3339 time.")
    report.add_argument("--until", metavar="TIME",
                        help="End of the range, in the same forms as --since (default now).")
    report.add_argument("--by", choices=[*OWNERS, CAUSE], action="append", metavar="{" + ",".join(
                            [*OWNERS, CAUSE]) + "}",
                        help="Who owns a row: pod (namespace and pod), namespace, user (the process's user), "
                             "node (instance) or gpu (default pod); or cause, the cause of lost step time "
                             "the GPUs' latest diagnoses name, alone or with a second --by pod, namespace, "
                             "user or node.")
    report.add_argument("--horizon", type=_horizon, metavar="SPAN",
                        help="With --by cause: a diagnosis whose capture started longer than this before a "
                             "step is too old for it, and the GPU counts as not diagnosed (default 24h).")
    report.add_argument("--step", type=_step, default=60, metavar="DURATION",
                        help="Resolution of the held and held-idle time and of alert onsets, at least the "
                             "scrape interval (default 1m; with --recorded, the rules' 1m).")
    report.add_argument("--recorded", action="store_true",
                        help="Read the series of the recording rules (gpuscope-recording-rules.yml) "
                             "instead of the raw ones: much cheaper on a large fleet.")
    output = report.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="Print the report as one JSON document.")
    output.add_argument("--csv", action="store_true", help="Print the rows as CSV with a header line.")
    auth = report.add_mutually_exclusive_group()
    auth.add_argument("--basic-auth-user", metavar="USER",
                      help="User name for HTTP basic auth (the password is read from "
                           "--basic-auth-password-file).")
    auth.add_argument("--bearer-token-file", type=Path, metavar="FILE",
                      help="File holding a bearer token sent as an Authorization header.")
    report.add_argument("--basic-auth-password-file", type=Path, metavar="FILE",
                        help="File holding the basic-auth password (a trailing newline is ignored).")
    report.add_argument("--tls-ca", type=Path, metavar="FILE",
                        help="PEM file of the CA(s) to trust for an https:// URL (default the system's).")
    report.add_argument("--insecure-skip-verify", action="store_true",
                        help="Do not verify the server's TLS certificate or name. Anyone on the path can "
                             "then read the credentials and forge the figures.")
    report.add_argument("--timeout", type=_timeout, default=120.0, metavar="DURATION",
                        help="Time to wait for each query's answer (default 2m).")


def _secret(path: Path, what: str) -> str:
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_SECRET_BYTES + 1)
    except OSError as err:
        raise ValueError(f"cannot read the {what} file {path}: {err.strerror or err}") from None
    if len(data) > MAX_SECRET_BYTES:
        raise ValueError(f"the {what} file {path} is larger than {MAX_SECRET_BYTES} bytes")
    try:
        text = data.decode().rstrip("\r\n")
    except UnicodeDecodeError:
        raise ValueError(f"the {what} file {path} is not UTF-8 text") from None
    if not text:
        raise ValueError(f"the {what} file {path} is empty")
    return text


def _auth(args: argparse.Namespace) -> Auth:
    if args.basic_auth_password_file is not None and args.basic_auth_user is None:
        raise ValueError("--basic-auth-password-file needs --basic-auth-user")
    if args.basic_auth_user is not None:
        if args.basic_auth_password_file is None:
            raise ValueError("--basic-auth-user needs --basic-auth-password-file")
        return Auth(user=args.basic_auth_user, password=_secret(args.basic_auth_password_file, "password"))
    if args.bearer_token_file is not None:
        return Auth(bearer_token=_secret(args.bearer_token_file, "bearer token"))
    return Auth()


def _range(args: argparse.Namespace, now: float) -> tuple[float, float, int]:
    """Start and end, both on a step boundary (so counters and steps cover the same time), and the step."""
    step = RECORDED_STEP_S if args.recorded else args.step
    end = parse_time(args.until, now) if args.until else now
    start = parse_time(args.since, now)
    end, start = math.floor(end / step) * step, math.floor(start / step) * step
    if start >= end:
        raise ValueError(f"the range is empty: --since ({_iso(start)}) is not before --until ({_iso(end)}) "
                         f"at a {format_duration(step)} step")
    if (end - start) / step > MAX_STEPS:
        raise ValueError(f"the range holds more than {MAX_STEPS} steps of {format_duration(step)}: "
                         f"use a larger --step")
    return start, end, step


def _grouping(args: argparse.Namespace) -> tuple[str, str | None]:
    """What --by asks for: an owner (``by``, None) or the causes (``"cause"``, an owner or None)."""
    given: list[str] = args.by or ["pod"]
    if CAUSE not in given:
        if len(given) > 1:
            raise ValueError(f"--by {' --by '.join(given)}: two --by are for cause and an owner "
                             f"(--by cause --by namespace)")
        if args.horizon is not None:
            raise ValueError("--horizon applies to --by cause")
        return given[0], None
    others = [by for by in given if by != CAUSE]
    if len(given) > 2 or len(others) != len(given) - 1 or (others and others[0] not in CAUSE_OWNERS):
        raise ValueError(f"--by {' --by '.join(given)}: --by cause combines with at most one of "
                         f"{', '.join(CAUSE_OWNERS)}")
    return CAUSE, others[0] if others else None


def run_report_command(args: argparse.Namespace, now: float | None = None) -> int:
    """Run `report`; the exit code. Errors: one line on stderr, no traceback."""
    try:
        by, owner = _grouping(args)
        start, end, step = _range(args, time.time() if now is None else now)
        auth = _auth(args)
        context = tls_context(str(args.tls_ca) if args.tls_ca else None, args.insecure_skip_verify)
        cause_queries = (CauseQueries(owner, range_s=int(end - start), step_s=step,
                                      horizon_s=args.horizon or DEFAULT_HORIZON_S, recorded=args.recorded)
                         if by == CAUSE else None)
    except ValueError as err:
        print(f"gpuscope report: {err}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as err:  # the CA file
        print(f"gpuscope report: cannot use --tls-ca {args.tls_ca}: {err.strerror or err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        client = PrometheusClient(args.prometheus, auth=auth, context=context, timeout=args.timeout)
        if cause_queries is not None:
            return _print_cause_report(args, build_cause_report(client, cause_queries, start, end))
        queries = Queries(by, range_s=int(end - start), step_s=step, recorded=args.recorded)
        report = build_report(client, queries, start, end)
    except NoData as err:
        print(f"gpuscope report: {err} ({_iso(start)} to {_iso(end)})", file=sys.stderr)
        return EXIT_FAILURE
    except PrometheusError as err:
        print(f"gpuscope report: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("gpuscope report: interrupted", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        print(json.dumps(as_json(report), indent=2))
    elif args.csv:
        sys.stdout.write(as_csv(report))
    else:
        sys.stdout.write(as_table(report))
    return EXIT_OK


def _print_cause_report(args: argparse.Namespace, report: CauseReport) -> int:
    if args.json:
        print(json.dumps(cause_as_json(report), indent=2))
    elif args.csv:
        sys.stdout.write(cause_as_csv(report))
    else:
        sys.stdout.write(cause_as_table(report))
    return EXIT_OK


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def as_json(report: Report) -> dict[str, Any]:
    return {
        "start": _iso(report.start), "end": _iso(report.end), "step_seconds": report.step_s,
        "by": report.by, "owner_labels": list(report.owner_labels), "recorded": report.recorded,
        "rows": [row.as_dict() for row in report.rows],
        "total": {k: v for k, v in report.total.as_dict().items() if k != "owner"},
        "unattributed_energy_kwh": report.idle_energy_kwh,
        "captures": {"total": sum(report.captures_by_node.values()), "by_node": report.captures_by_node,
                     "ids_exported": False},
        "notes": report.notes,
    }


_FIGURES = ("held_gpu_hours", "busy_gpu_hours", "efficiency", "held_idle_gpu_hours", "energy_kwh",
            "alerts_fired")


def as_csv(report: Report) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*report.owner_labels, *_FIGURES])
    for row in report.rows:
        figures = row.as_dict()
        writer.writerow([*row.owner.values(),
                         *("" if figures[name] is None else f"{figures[name]:.6g}" if isinstance(
                             figures[name], float) else figures[name] for name in _FIGURES)])
    return out.getvalue()


# The table's summed columns and their decimals: rounded so that the rows add up to the TOTAL.
_SUMMED = (("held_gpu_hours", 1), ("busy_gpu_hours", 1), ("held_idle_gpu_hours", 1), ("energy_kwh", 2))


def largest_remainder(values: Sequence[float], decimals: int) -> list[int]:
    """``values`` in units of 10**-decimals, rounded so that they add up to their rounded total: each is
    rounded down, and the units the total still lacks go to the largest remainders (ties: the first)."""
    scale = 10 ** decimals
    scaled = [max(0.0, v) * scale for v in values]
    floors = [math.floor(s) for s in scaled]
    missing = round(sum(scaled)) - sum(floors)
    by_remainder = sorted(range(len(scaled)), key=lambda i: (floors[i] - scaled[i], i))
    for i in by_remainder[:max(0, missing)]:
        floors[i] += 1
    return floors


def _cells(row: Row, summed: dict[str, int]) -> list[str]:
    """A row's cells; ``summed``: its summed columns, already rounded (units of their decimals)."""
    efficiency = row.efficiency
    held, busy, idle, energy = (f"{summed[name] / 10 ** decimals:.{decimals}f}" for name, decimals in _SUMMED)
    shown = "-" if efficiency is None else f"{efficiency:.0%}"
    return [held, busy, shown, idle, energy, str(row.alerts_fired)]


def as_table(report: Report) -> str:
    head = [*report.owner_labels, "HELD GPU-h", "BUSY GPU-h", "EFFICIENCY", "HELD IDLE GPU-h", "ENERGY kWh",
            "ALERTS"]
    # Largest remainder per column: the rows, as printed, add up to the TOTAL as printed, which is
    # the rounded total of the exact figures (--json and --csv give those).
    rounded = {name: largest_remainder([getattr(r, name) for r in report.rows], decimals)
               for name, decimals in _SUMMED}
    lines = [[*(value or "(none)" for value in row.owner.values()),
              *_cells(row, {name: rounded[name][i] for name, _ in _SUMMED})]
             for i, row in enumerate(report.rows)]
    total = {name: sum(rounded[name]) for name, _ in _SUMMED}
    lines.append(["TOTAL", *[""] * (len(report.owner_labels) - 1), *_cells(report.total, total)])
    widths = [max(len(line[i]) for line in [head, *lines]) for i in range(len(head))]
    owners = len(report.owner_labels)

    def render(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < owners else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    text = [f"GPU use by {report.by}, {_iso(report.start)} to {_iso(report.end)} "
            f"(step {format_duration(report.step_s)}{', recording rules' if report.recorded else ''})",
            render(head), *(render(line) for line in lines), ""]
    if report.idle_energy_kwh is not None:
        text.append(f"Energy attributed to no process (idle GPUs): {report.idle_energy_kwh:.2f} kWh")
    captures = ", ".join(f"{node} {count}" for node, count in report.captures_by_node.items() if count)
    taken = sum(report.captures_by_node.values())
    text.append(f"Captures taken: {taken}" + (f" ({captures})" if captures else ""))
    text += [f"Note: {note}" for note in report.notes]
    return "\n".join(text) + "\n"
