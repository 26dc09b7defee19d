"""The `gpuscope` command line: the parser, and the agent's own commands (run, config check, scenarios)."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from gpuscope.cli.invocation import command_name
from gpuscope.common.config_types import ConfigError
from gpuscope.common.durations import parse_duration
from gpuscope.common.suggestions import close_matches, did_you_mean
from gpuscope.config import Settings, load_settings
from gpuscope.version import __version__

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
# The reader of the output went away (`gpuscope explain --json … | head`): the status a command killed
# by SIGPIPE has, so that a shell's pipefail sees it, and no traceback.
EXIT_CLOSED_PIPE = 128 + 13
SNAPSHOT_LOG_LEVEL = "error"  # `snapshot` logs only errors unless --log-level says otherwise


def _duration_flag(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with "did you mean" for a mistyped subcommand (an invalid choice)."""

    def error(self, message: str) -> NoReturn:
        invalid = re.fullmatch(r"(.*invalid choice: '([^']*)') \(choose from (.*)\)", message, re.S)
        if invalid is not None:
            hint = did_you_mean(invalid.group(2), re.findall(r"'([^']*)'", invalid.group(3)))
            if hint:
                message = f"{invalid.group(1)}{hint}"
        super().error(message)


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> str:
    """argparse's "unrecognized arguments" message, with the options of the (sub)command run that are
    closest to each mistyped one."""
    options: list[str] = []
    current: argparse.ArgumentParser | None = parser
    while current is not None:
        options += [o for action in current._actions for o in action.option_strings]
        subcommands = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subcommands[0].dest, None) if subcommands else None
        current = subcommands[0].choices.get(chosen) if subcommands and chosen else None
    message = f"unrecognized arguments: {' '.join(extras)}"
    closest = {typed: matches[0] for typed in (e.split("=", 1)[0] for e in extras if e.startswith("-"))
               for matches in [close_matches(typed, options)] if matches}
    if len(closest) == 1:
        message += f" (did you mean {next(iter(closest.values()))}?)"
    elif closest:
        message += f" (did you mean {', '.join(f'{match} for {typed}' for typed, match in closest.items())}?)"
    return message


def build_parser() -> argparse.ArgumentParser:
    # prog: usage lines and errors name the command as the user ran it (`.venv/bin/gpuscope`, `python -m
    # gpuscope`) where plain `gpuscope` would not find this program.
    parser = _Parser(prog=command_name(),
                                     description="Always-on per-node GPU telemetry agent.")
    parser.add_argument("--version", action="version", version=f"gpuscope {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="What to do (`gpuscope COMMAND -h` describes each).")

    def common(p: argparse.ArgumentParser, *, default_level: str) -> None:
        p.add_argument("--config", type=Path, metavar="FILE", help="YAML configuration file.")
        p.add_argument("--simulate", metavar="NAME|FILE",
                       help="Replace NVML with a simulated node: a bundled scenario name or a scenario file.")
        p.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                       help=f"Log messages to stderr from this level up (default {default_level}).")

    run = sub.add_parser("run", help="Run the agent (sampler and HTTP endpoints) until SIGTERM.")
    common(run, default_level="info, or log_level in the configuration")
    run.add_argument("--web.listen-address", dest="listen_address", metavar="ADDR",
                     help="HTTP listen address (default :9847).")
    run.add_argument("--web.config.file", dest="config_file", type=Path, metavar="FILE",
                     help="Web configuration (TLS, basic auth) in Prometheus exporter-toolkit's format.")
    run.add_argument("--sample-interval", type=_duration_flag, metavar="SECONDS",
                     help="Seconds between samples, or a duration such as 500ms (default 1).")
    run.add_argument("--processes.cmdline", dest="cmdline", action="store_true", default=None,
                     help="Export full process command lines (off by default: they may hold secrets).")

    snap = sub.add_parser("snapshot", help="Print one snapshot of the node and exit.")
    common(snap, default_level=f"{SNAPSHOT_LOG_LEVEL}: the snapshot itself is the output")
    snap.add_argument("--json", action="store_true", help="Print the snapshot as JSON.")

    config = sub.add_parser("config", help="Configuration tools.")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND",
                                       help="The configuration tool to run.")
    check = config_sub.add_parser("check", help="Validate a configuration file: exit 0, or 2 with problems.")
    check.add_argument("file", type=Path, help="The YAML configuration file to check.")

    scenarios = sub.add_parser("scenarios", help="List the bundled simulation scenarios, each with what it "
                                                 "shows (for --simulate NAME).")
    scenarios.add_argument("--json", action="store_true",
                           help="Print a JSON list of {name, description} objects.")
    from gpuscope.cli.capture import add_capture_commands

    add_capture_commands(sub)
    from gpuscope.cli.report import add_report_command

    add_report_command(sub)
    from gpuscope.cli.explain import add_explain_command

    add_explain_command(sub)
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if getattr(args, "simulate", None):
        out["simulate"] = args.simulate
    if getattr(args, "log_level", None):
        out["log_level"] = args.log_level
    web = {key: getattr(args, key) for key in ("listen_address", "config_file") if getattr(args, key, None)}
    if web:
        out["web"] = web
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
    try:
        status = _command(argv)
        sys.stdout.flush()  # here, not at exit, where a closed pipe would print a traceback
    except BrokenPipeError:
        # Whatever is still buffered cannot be written: point stdout at /dev/null so that the flush at
        # exit has nowhere to fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_CLOSED_PIPE
    return status


def _command(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # as parse_args would refuse them, with the closest options named
        parser.error(_unrecognized(parser, args, extras))
    if args.command in ("capture", "captures"):
        from gpuscope.cli.capture import run_capture_command

        return run_capture_command(args)
    if args.command == "report":
        from gpuscope.cli.report import run_report_command

        return run_report_command(args)
    if args.command == "explain":
        from gpuscope.cli.explain import run_explain_command

        return run_explain_command(args)
    if args.command == "config":
        return _config_check(args.file)
    if args.command == "scenarios":
        from gpuscope.cli.scenarios import print_scenarios

        return print_scenarios(as_json=args.json)
    try:
        settings = load_settings(args.config, _overrides(args))
    except ConfigError as err:
        print(f"gpuscope: {err}", file=sys.stderr)
        return EXIT_USAGE
    _setup_logging(settings.log_level if args.command == "run" else args.log_level or SNAPSHOT_LOG_LEVEL)
    try:
        if args.command == "run":
            return _run(settings)
        from gpuscope.cli.snapshot import print_snapshot

        return print_snapshot(settings, as_json=args.json)
    except ConfigError as err:  # a scenario that cannot be used
        print(f"gpuscope: {err}", file=sys.stderr)
        return EXIT_USAGE


def _run(settings: Settings) -> int:
    from gpuscope.agent import Agent
    from gpuscope.common.memory import tune_allocator
    from gpuscope.web.server import ListenError

    tune_allocator()  # before the agent's threads: captures must not ratchet its RSS up
    try:
        Agent(settings).run_until_signalled()
    except ListenError as err:  # it names the address and the reason
        print(f"gpuscope: {err.strerror or err}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as err:  # the node refused something the agent needs at start (a file, a socket)
        print(f"gpuscope: cannot start: {err}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def _config_check(path: Path) -> int:
    try:
        settings = load_settings(path)
        if settings.web.config_file is not None:
            from gpuscope.web.web_config import load_web_config

            load_web_config(settings.web.config_file)
    except ConfigError as err:
        print(f"gpuscope: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{path}: OK")
    return EXIT_OK
