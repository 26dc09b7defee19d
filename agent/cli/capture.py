"""`gpuscope capture` and `gpuscope captures`: profiler captures through the agent's control API.

    gpuscope capture --gpu 0 --duration 2s [--json]             # the local agent (Unix socket)
    gpuscope capture --pid 1234 --agent node7:9848 --token-file T --tls-ca CA
    gpuscope capture --agents node1:9848,node2:9848 --duration 2s --token-file T --tls-ca CA
    gpuscope captures ls [--all] [--json]
    gpuscope captures get ID -o DIR

A fleet capture (``--agents``) asks every agent, in parallel, to start at the same wall-clock time (now
plus ``--lead``), so the traces of a multi-node job overlap; each node's outcome is reported. Exit codes:
0 when every capture was taken ("captured"), 1 otherwise (the records say why) or when an agent cannot
be reached, 2 for a request that is wrong in itself (bad flags, an invalid id). Errors are one line on
stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuscope.capture.config import MAX_DURATION_SECONDS
from gpuscope.capture.record_gains import gain_short, verdict_finding
from gpuscope.capture.records import CaptureIdError, check_capture_id
from gpuscope.capture.refusals import next_allowed
from gpuscope.cli.invocation import command_name
from gpuscope.cli.progress import progress_line
from gpuscope.cli.trace_viewers import viewer_hints
from gpuscope.common.durations import format_duration, parse_duration
from gpuscope.common.lazy_import import lazy_module
from gpuscope.common.sizes import format_size
from gpuscope.control.config import DEFAULT_SOCKET
from gpuscope.control.errors import ControlError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
DEFAULT_LEAD_S = 2.0  # a fleet capture starts this long after the command: time to reach every agent
MAX_LEAD_S = 60.0  # agents refuse a start time further ahead
MAX_FLEET = 256
if TYPE_CHECKING:
    import grpc

    from gpuscope.control import client as _control_client
    from gpuscope.control.client import ControlClient
else:  # gRPC is loaded by the commands that talk to an agent, not by `gpuscope run` building its parser
    grpc = lazy_module("grpc")
    _control_client = lazy_module("gpuscope.control.client")

SOCKET_ENV = "GPUSCOPE_CONTROL__SOCKET"  # the agent's control.socket, as its configuration names it


def _capture_duration(text: str) -> float:
    try:
        seconds = parse_duration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    if not 0 < seconds <= MAX_DURATION_SECONDS:
        raise argparse.ArgumentTypeError(f"a capture lasts more than 0 and at most "
                                         f"{format_duration(MAX_DURATION_SECONDS)}, got {text!r}")
    return seconds


def _lead(text: str) -> float:
    try:
        seconds = parse_duration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    if seconds > MAX_LEAD_S:
        raise argparse.ArgumentTypeError(f"at most {format_duration(MAX_LEAD_S)}, got {text!r}")
    return seconds


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected 1 or more, got 0")
    return value


def _connection_flags(parser: argparse.ArgumentParser, *, fleet: bool) -> None:
    group = parser.add_argument_group("agent connection")
    where = group.add_mutually_exclusive_group()
    where.add_argument("--socket", type=Path, metavar="PATH",
                       help=f"The local agent's control socket (default ${SOCKET_ENV}, else the socket of "
                            f"an agent this user runs, else the node's, {DEFAULT_SOCKET}).")
    where.add_argument("--agent", metavar="HOST:PORT",
                       help="A remote agent's control API over TCP (TLS with a bearer token).")
    if fleet:
        where.add_argument("--agents", metavar="A,B,...",
                           help="Fleet capture: several agents (HOST:PORT or socket paths, comma-separated) "
                                "capture at the same start time.")
    group.add_argument("--token-file", type=Path, metavar="FILE", help="Bearer token for TCP agents.")
    group.add_argument("--tls-ca", type=Path, metavar="FILE",
                       help="CA bundle (PEM) that TCP agents' certificates chain to (default: system CAs).")
    group.add_argument("--tls-cert", type=Path, metavar="FILE", help="Client certificate (PEM), for mTLS.")
    group.add_argument("--tls-key", type=Path, metavar="FILE", help="Client private key (PEM), for mTLS.")
    group.add_argument("--tls-server-name", metavar="NAME",
                       help="Expect this name in the agents' certificates instead of the host dialled.")


def add_capture_commands(subparsers: Any) -> None:
    """Add `capture` and `captures` to the `gpuscope` sub-command parsers."""
    capture = subparsers.add_parser(
        "capture", help="Take a profiler capture through the agent (or several agents at once).",
        description="Capture a profile of the processes on a GPU, of one process, or of one profiler "
                    "endpoint, and print its record.")
    what = capture.add_mutually_exclusive_group()
    what.add_argument("--gpu", type=_non_negative, metavar="N", help="Every profilable process on GPU N.")
    what.add_argument("--pid", type=_positive, metavar="PID", help="One process (host PID).")
    what.add_argument("--target", metavar="HOST:PORT", help="One TensorFlow/JAX profiler server.")
    capture.add_argument("--duration", type=_capture_duration, metavar="DURATION",
                         help="Capture length, e.g. 2s or 500ms (at most "
                              f"{format_duration(MAX_DURATION_SECONDS)}; default: the agent's "
                              "capture.duration).")
    capture.add_argument("--reason", help="Why (logged by the agent).")
    capture.add_argument("--lead", type=_lead, default=DEFAULT_LEAD_S, metavar="DURATION",
                         help="Fleet capture: start this long from now on every node (default 2s).")
    capture.add_argument("--json", action="store_true", help="Print the capture record(s) as JSON.")
    _connection_flags(capture, fleet=True)

    captures = subparsers.add_parser("captures", help="List or download the agent's stored captures.")
    sub = captures.add_subparsers(dest="captures_command", required=True, metavar="SUBCOMMAND",
                                  help="What to do with the stored captures.")
    ls = sub.add_parser("ls", help="List the stored captures, newest first.")
    ls.add_argument("--limit", type=_non_negative, default=0, metavar="N",
                    help="At most N captures, 1 to 1000 (default: the agent's page size, 100).")
    ls.add_argument("--all", action="store_true",
                    help="Also list the capture triggers the agent refused lately (the alert cooldown, the "
                         "hourly budget, the store's quota, another capture in flight ...), with the reason "
                         "and when a capture is allowed again.")
    ls.add_argument("--json", action="store_true",
                    help="Print the capture records as JSON (with --all: an object with \"captures\" and "
                         "\"refused\").")
    _connection_flags(ls, fleet=False)
    get = sub.add_parser("get", help="Download a capture's files into a directory (a TensorBoard logdir).")
    get.add_argument("id", help="The capture id, as `gpuscope captures ls` shows it.")
    get.add_argument("-o", "--output", type=Path, required=True, metavar="DIR",
                     help="Where to write the files (created if missing; existing files are never "
                          "overwritten).")
    _connection_flags(get, fleet=False)
    explain = sub.add_parser("explain", help="Diagnose a stored capture: where its steps' time went.",
                             description="Download a capture's traces and diagnose them as `gpuscope "
                                         "explain` does: the verdict first, then the evidence.")
    explain.add_argument("id", help="The capture id, as `gpuscope captures ls` shows it.")
    explain.add_argument("--json", action="store_true", help="Print the diagnoses as JSON.")
    _connection_flags(explain, fleet=False)


def run_capture_command(args: argparse.Namespace) -> int:
    """Run `capture` or `captures ...`; the exit code. Errors: one line on stderr, no traceback."""
    try:
        if args.command == "capture":
            if getattr(args, "agents", None):
                return _fleet(args)
            return _capture(args)
        if args.captures_command == "ls":
            return _list(args)
        if args.captures_command == "explain":
            return _explain(args)
        return _get(args)
    except ControlError as err:
        print(f"gpuscope: {err}", file=sys.stderr)
        return EXIT_USAGE if err.usage else EXIT_FAILURE
    except KeyboardInterrupt:
        print("gpuscope: interrupted", file=sys.stderr)
        return 130


# -- commands ---------------------------------------------------------------------------------------------


def _client(args: argparse.Namespace, address: str | Path | None = None) -> ControlClient:
    if address is None:  # None left: the local agent this user would talk to (ControlClient's default)
        address = args.agent or args.socket or (Path(os.environ[SOCKET_ENV]) if os.environ.get(SOCKET_ENV)
                                                else None)
    client: ControlClient = _control_client.ControlClient(
        address, tls_ca=args.tls_ca, token_file=args.token_file, tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_server_name=args.tls_server_name)
    return client


def _which_agent(client: ControlClient) -> dict[str, Any]:
    """Say on stderr which agent answers (node name, pid, socket); its address and node, for --json."""
    info = client.agent_info()
    if info is None:
        print(f"agent at {client.where} (an older gpuscope, which does not say its node name)",
              file=sys.stderr)
        return {"agent": client.where, "node": None}
    print(info.describe(client.where), file=sys.stderr)
    return {"agent": client.where, "node": info.node_name}


def _selector(args: argparse.Namespace) -> dict[str, Any]:
    return {"gpu": args.gpu, "pid": args.pid, "target": args.target}


def _what(args: argparse.Namespace) -> str:
    if args.gpu is not None:
        return f"GPU {args.gpu}"
    return f"pid {args.pid}" if args.pid is not None else str(args.target)


def _capture(args: argparse.Namespace) -> int:
    if args.gpu is None and args.pid is None and args.target is None:
        raise ControlError("capture: name what to capture: --gpu N, --pid PID or --target HOST:PORT "
                           "(or --agents for a fleet capture)", usage=True)
    with _client(args) as client:
        who = _which_agent(client)
        with progress_line(f"capturing {_what(args)}", args.duration, enabled=not args.json):
            record = client.capture(**_selector(args), duration_s=args.duration, reason=args.reason)
    if args.json:
        print(json.dumps({**who, **record}, indent=2))
    else:
        print(format_record(record))
        if record.get("outcome") == "captured":
            print(f"download: {command_name()} captures get {record.get('id')} -o DIR")
        if record.get("notice"):  # what it cost the alert captures (their shared budget)
            print(f"note: {record['notice']}")
    return EXIT_OK if record.get("outcome") == "captured" else EXIT_FAILURE


def _fleet(args: argparse.Namespace) -> int:
    agents = [a.strip() for a in args.agents.split(",") if a.strip()]
    if not agents:
        raise ControlError("--agents: name at least one agent (HOST:PORT,...)", usage=True)
    if len(set(agents)) != len(agents):
        raise ControlError("--agents: an agent is listed twice", usage=True)
    if len(agents) > MAX_FLEET:
        raise ControlError(f"--agents: at most {MAX_FLEET} agents", usage=True)
    selector = _selector(args)
    if all(v is None for v in selector.values()):
        selector["gpu"] = 0  # a multi-node job's local rank 0 runs on GPU 0 of each node
    clients: dict[str, ControlClient | ControlError] = {}
    try:
        for agent in agents:
            try:
                clients[agent] = _client(args, agent)
            except ControlError as err:
                if err.usage:
                    raise
                clients[agent] = err  # e.g. no socket at that path: that node's result
        start_at = time.time() + args.lead

        def one(agent: str) -> dict[str, Any]:
            client = clients[agent]
            try:
                if isinstance(client, ControlError):
                    raise client
                record = client.capture(**selector, duration_s=args.duration, start_at=start_at,
                                        reason=args.reason)
            except ControlError as err:
                record = _failed_record(err, selector)
            return {"agent": agent, **record}

        total = None if args.duration is None else args.lead + args.duration
        with ThreadPoolExecutor(max_workers=min(32, len(agents)), thread_name_prefix="fleet") as pool, \
                progress_line(f"capturing on {len(agents)} agent(s)", total, enabled=not args.json):
            records = list(pool.map(one, agents))
    finally:
        for client in clients.values():
            if not isinstance(client, ControlError):
                client.close()
    if args.json:
        print(json.dumps(records, indent=2))
    else:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(start_at))
        stamp += f".{int(start_at % 1 * 1000):03d}Z"
        print(f"fleet capture on {len(agents)} agent(s), starting at {stamp}")
        width = max(len(a) for a in agents)
        for record in records:
            print(f"{record['agent']:<{width}}  {format_record(record)}")
    captured = sum(r.get("outcome") == "captured" for r in records)
    if not args.json:
        print(f"{captured}/{len(records)} captured")
    return EXIT_OK if captured == len(records) else EXIT_FAILURE


def _failed_record(err: ControlError, selector: dict[str, Any]) -> dict[str, Any]:
    """A node that gave no record: the same shape, with the outcome its error amounts to."""
    if err.code in (None, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        outcome = "unreachable"
    elif err.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                      grpc.StatusCode.RESOURCE_EXHAUSTED):
        outcome = "refused"
    else:
        outcome = "failed"
    pid = selector.get("pid")
    return {"id": None, "outcome": outcome, "error": str(err), "gpu": selector.get("gpu"),
            "pids": [] if pid is None else [pid], "target": selector.get("target"), "files": [], "bytes": 0}


def _list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        who = _which_agent(client)
        listing = client.capture_listing(limit=args.limit, include_refused=args.all)
    if not listing.enabled:  # the listing says so; an older agent answered FAILED_PRECONDITION
        raise ControlError("captures are disabled on this agent (capture.enabled: false, or its capture "
                           "store could not be opened)")
    records = listing.captures
    if args.json:
        captures = [{**who, **r} for r in records]
        if args.all:
            print(json.dumps({**who, "captures": captures, "refused_count": listing.refused_count,
                              "refused": listing.refused}, indent=2))
        else:
            print(json.dumps(captures, indent=2))
        return EXIT_OK
    if not records:
        print("no captures stored")
    else:
        _print_captures(records)
    if args.all:
        _print_refused(listing.refused, listing.refused_count)
    elif listing.refused_count:
        print(f"{listing.refused_count} capture trigger(s) refused since the agent started; "
              f"`{command_name()} captures ls --all` lists them with the reason")
    return EXIT_OK


def _print_captures(records: list[dict[str, Any]]) -> None:
    rows = [("ID", "STARTED (UTC)", "OUTCOME", "TRIGGER", "GPU", "PIDS", "SIZE", "FINDING", "GAIN", "TARGET")]
    for r in records:
        trigger = r.get("trigger") or {}
        kind = str(trigger.get("kind") or "-")
        if trigger.get("alertname"):
            kind += f":{trigger['alertname']}"
        rows.append((str(r.get("id")), _time(r.get("start")), str(r.get("outcome")), kind,
                     "-" if r.get("gpu") is None else str(r["gpu"]),
                     ",".join(map(str, r.get("pids") or ())) or "-", format_size(int(r.get("bytes") or 0)),
                     _finding(r.get("analysis")), _gain(r.get("analysis")), str(r.get("target") or "-")))
    _print_table(rows)
    if any(row[8] != "-" for row in rows[1:]):  # what the column estimates, and where its assumptions are
        print(f"GAIN: the step time fixing the finding saves, as a replay of the trace estimates it "
              f"(n/e: not estimated); `{command_name()} captures explain ID` says what it assumes")


def _print_refused(refused: list[dict[str, Any]], count: int | None) -> None:
    """The refused triggers, newest first: when, the trigger, the GPU, the reason, when a trigger like
    it is allowed again, and the agent's message."""
    print()
    if count is None:
        print("this agent does not keep refused capture triggers (an older gpuscope)")
        return
    if not refused:
        print("no capture trigger refused since the agent started")
        return
    kept = f" (the newest {len(refused)} are kept)" if count > len(refused) else ""
    print(f"refused capture triggers: {count}{kept}")
    rows = [("REFUSED (UTC)", "TRIGGER", "GPU", "REASON", "NEXT ALLOWED", "MESSAGE")]
    now = time.time()
    for r in refused:
        trigger = r.get("trigger") or {}
        kind = str(trigger.get("kind") or "-")
        if trigger.get("alertname"):
            kind += f":{trigger['alertname']}"
        rows.append((_time(r.get("at")), kind, "-" if r.get("gpu") is None else str(r["gpu"]),
                     str(r.get("reason") or "-"), _allowed_in(r.get("allowed_at"), now),
                     " ".join(str(r.get("message") or "").split())))
    _print_table(rows)


def _allowed_in(allowed_at: Any, now: float) -> str:
    """When a refused trigger's kind is allowed again, as the refusal's message says it (the same
    function, the same time): "at 14:07:12 UTC (in 14m10s)", "now", "-" (unknown)."""
    if isinstance(allowed_at, bool) or not isinstance(allowed_at, (int, float)):
        return "-"
    if not math.isfinite(allowed_at):
        return "-"
    return next_allowed(float(allowed_at), now)


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _get(args: argparse.Namespace) -> int:
    written = _download(args, args.output)
    print(f"{len(written)} file(s) of capture {args.id} written to {args.output}")
    for line in viewer_hints(written, args.output):
        print(line)
    return EXIT_OK


def _download(args: argparse.Namespace, output: Path) -> list[str]:
    """Capture ``args.id``'s files written into ``output``."""
    try:
        check_capture_id(args.id)  # before connecting: a malformed id is the caller's mistake (exit 2)
    except CaptureIdError as err:
        raise ControlError(str(err), usage=True) from None
    with _client(args) as client:
        _which_agent(client)
        try:
            return client.get_capture(args.id, output)
        except ControlError as err:
            if err.code == grpc.StatusCode.NOT_FOUND:
                raise ControlError(f"{err}; only captures that reached a profiler are stored (a refused "
                                   "one, or one that found no profiler, is not): "
                                   f"`{command_name()} captures ls` lists them", code=err.code) from None
            raise


def _explain(args: argparse.Namespace) -> int:
    """The capture's traces, downloaded into a private temporary directory, diagnosed there."""
    from gpuscope.cli.explain import explain_path

    with tempfile.TemporaryDirectory(prefix="gpuscope-explain-") as directory:
        _download(args, Path(directory) / args.id)
        return explain_path(Path(directory) / args.id, as_json=args.json, shown_as=f"capture {args.id}")


# -- formatting -------------------------------------------------------------------------------------------


def format_record(record: dict[str, Any]) -> str:
    """One line: id, outcome, what was captured, the files, and the error if any. The id is shown only
    for a capture that stored a trace: another record's id names nothing `captures get` could download
    (refusals and captures that found no profiler are not stored at all)."""
    stored_trace = bool(record.get("files"))
    parts = [str(record.get("id") or "-") if stored_trace else "-", str(record.get("outcome"))]
    if record.get("gpu") is not None:
        parts.append(f"GPU {record['gpu']}")
    pids = record.get("pids") or ()
    if pids:
        parts.append("pids " + ",".join(map(str, pids)))
    if record.get("target"):
        parts.append(str(record["target"]))
    files = record.get("files") or ()
    if files:
        parts.append(f"{len(files)} file(s), {format_size(int(record.get('bytes') or 0))}")
    line = "  ".join(parts)
    if record.get("error"):
        line += f"  ({' '.join(str(record['error']).split())})"
    return line


def _finding(analysis: Any) -> str:
    """The top finding of a capture's analysis: its kind, "healthy", "skipped" (too large, stopped by
    its limits), or "-" (no trace, or not analysed yet)."""
    if not isinstance(analysis, dict):
        return "-"
    verdict = analysis.get("verdict")
    return str(verdict) if verdict else "skipped"


def _gain(analysis: Any) -> str:
    """What fixing the verdict's finding would save of the step time: "-25% step", "n/e" (not
    estimated), or "-" (no finding, or a record analysed before gains were estimated)."""
    finding = verdict_finding(analysis if isinstance(analysis, dict) else None)
    return "-" if finding is None else gain_short(finding.get("gain"))


def _time(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(value))


