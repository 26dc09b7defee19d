"""The `gpuscope` command line: run, snapshot, config check."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuscope.common.config_types import ConfigError
from gpuscope.common.durations import parse_duration
from gpuscope.config import Settings, load_settings
from gpuscope.snapshot import Snapshot
from gpuscope.version import __version__

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _duration_flag(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuscope", description="Always-on per-node GPU telemetry agent.")
    parser.add_argument("--version", action="version", version=f"gpuscope {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", type=Path, metavar="FILE", help="YAML configuration file.")
        p.add_argument("--simulate", metavar="NAME|FILE",
                       help="Replace NVML with a simulated node: a bundled scenario name or a scenario file.")
        p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])

    run = sub.add_parser("run", help="Run the agent (sampler and HTTP endpoints) until SIGTERM.")
    common(run)
    run.add_argument("--web.listen-address", dest="listen_address", metavar="ADDR",
                     help="HTTP listen address (default :9847).")
    run.add_argument("--sample-interval", type=_duration_flag, metavar="SECONDS",
                     help="Seconds between samples, or a duration such as 500ms (default 1).")
    run.add_argument("--processes.cmdline", dest="cmdline", action="store_true", default=None,
                     help="Export full process command lines (off by default: they may hold secrets).")

    snap = sub.add_parser("snapshot", help="Print one snapshot of the node and exit.")
    common(snap)
    snap.add_argument("--json", action="store_true", help="Print the snapshot as JSON.")

    config = sub.add_parser("config", help="Configuration tools.")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    check = config_sub.add_parser("check", help="Validate a configuration file: exit 0, or 2 with problems.")
    check.add_argument("file", type=Path)

    sub.add_parser("scenarios", help="List the bundled simulation scenarios.")
    from gpuscope.cli.capture import add_capture_commands

    add_capture_commands(sub)
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if getattr(args, "simulate", None):
        out["simulate"] = args.simulate
    if getattr(args, "log_level", None):
        out["log_level"] = args.log_level
    if getattr(args, "listen_address", None):
        out["web"] = {"listen_address": args.listen_address}
    if getattr(args, "sample_interval", None) is not None:
        out["sample_interval"] = args.sample_interval
    if getattr(args, "cmdline", None):
        out["processes"] = {"cmdline": True}
    return out


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("capture", "captures"):
        from gpuscope.cli.capture import run_capture_command

        return run_capture_command(args)
    if args.command == "config":
        return _config_check(args.file)
    if args.command == "scenarios":
        from gpuscope.simulate import bundled_scenarios

        print("\n".join(bundled_scenarios()))
        return EXIT_OK
    try:
        settings = load_settings(args.config, _overrides(args))
    except ConfigError as err:
        print(f"gpuscope: {err}", file=sys.stderr)
        return EXIT_USAGE
    _setup_logging(settings.log_level if args.command == "run" else "error")
    try:
        if args.command == "run":
            return _run(settings)
        return _snapshot(settings, as_json=args.json)
    except _StartupError as err:
        print(f"gpuscope: {err}", file=sys.stderr)
        return EXIT_USAGE if err.usage else EXIT_FAILURE


class _StartupError(Exception):
    def __init__(self, message: str, *, usage: bool) -> None:
        super().__init__(message)
        self.usage = usage


def _build_agent(settings: Settings) -> Any:
    from gpuscope.agent import Agent

    try:
        return Agent(settings)
    except ConfigError as err:  # e.g. a scenario file that cannot be used
        raise _StartupError(str(err), usage=True) from err


def _run(settings: Settings) -> int:
    agent = _build_agent(settings)
    try:
        agent.run_until_signalled()
    except OSError as err:
        raise _StartupError(f"cannot listen on {settings.web.listen_address}: {err.strerror or err}",
                            usage=False) from err
    return EXIT_OK


def _snapshot(settings: Settings, *, as_json: bool) -> int:
    from gpuscope.host.processes import ProcessInspector
    from gpuscope.nvml.boundary import Nvml
    from gpuscope.sampler import Sampler
    from gpuscope.simulate import ScenarioError, Simulation, load_scenario

    simulation = None
    if settings.simulate:
        try:
            simulation = Simulation(load_scenario(settings.simulate))
        except ScenarioError as err:
            raise _StartupError(str(err), usage=True) from err
        simulation.install()
    sampler = Sampler(Nvml(), ProcessInspector(include_cmdline=settings.processes.cmdline),
                      interval_seconds=settings.sample_interval, hostname=settings.node_name,
                      idle_dip_threshold=settings.idle_dips.threshold)
    try:
        sampler.tick()  # primes the cursors (utilization samples, GPM) ...
        time.sleep(0.5)
        snapshot = sampler.tick()  # ... so this tick has rates over a real interval
    finally:
        sampler.stop()
        if simulation is not None:
            simulation.uninstall()
    if as_json:
        print(json.dumps(snapshot.to_json(), indent=2))
    else:
        print(format_snapshot(snapshot))
    return EXIT_OK if snapshot.nvml_up else EXIT_FAILURE


def _config_check(path: Path) -> int:
    try:
        load_settings(path)
    except ConfigError as err:
        print(f"gpuscope: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{path}: OK")
    return EXIT_OK


def _fmt(value: float | None, scale: float = 1.0, spec: str = ".0f", suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{suffix}"


def format_snapshot(snapshot: Snapshot) -> str:
    """A human table: the GPUs, then their processes."""
    if not snapshot.nvml_up:
        return f"{snapshot.hostname}: NVML is not available (no NVIDIA driver?)"
    lines = [f"{snapshot.hostname}  driver {snapshot.driver_version}  {len(snapshot.gpus)} GPU(s)", ""]
    gpu_rows = [("GPU", "NAME", "UTIL", "SM", "MEM USED/TOTAL", "POWER", "TEMP", "PROCS", "DIPS", "STATE")]
    proc_rows = [("GPU", "PID", "PROCESS", "USER", "TYPE", "GPU MEM", "SM", "CONTAINER")]
    gib = 1 / 2**30
    for g in snapshot.gpus:
        active = (g.clock_event_reasons or frozenset()) - {"gpu_idle"}
        state = ("up" + (f" ({','.join(sorted(active))})" if active else "")) if g.up else "LOST"
        gpu_rows.append((
            str(g.index), g.name or "?", _fmt(g.utilization_ratio, 100, ".0f", "%"),
            _fmt(g.sm_active_ratio, 100, ".0f", "%"),
            f"{_fmt(g.memory_used_bytes, gib, '.1f')}/{_fmt(g.memory_total_bytes, gib, '.0f')} GiB",
            _fmt(g.power_watts, 1, ".0f", " W"), _fmt(g.temperature_celsius, 1, ".0f", " C"),
            str(len(g.compute_processes)), _fmt(g.idle_dips_total, 1, "d"), state,
        ))
        for p in g.processes:
            proc_rows.append((
                str(g.index), str(p.pid), p.name or "?", p.user or "?", p.kind,
                _fmt(p.memory_used_bytes, gib, ".1f", " GiB"), _fmt(p.sm_utilization_ratio, 100, ".0f", "%"),
                (p.container_id or "-")[:12],
            ))
    lines += _table(gpu_rows)
    if len(proc_rows) > 1:
        lines += ["", *_table(proc_rows)]
    return "\n".join(lines)


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
