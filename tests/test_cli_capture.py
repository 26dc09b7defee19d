"""`gpuscope capture` and `gpuscope captures` against running control servers (in-process, Unix sockets
and TLS on loopback): JSON records, downloads, errors as one line, fleet captures at a common start."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pki import make_pki
from test_control_api import (
    PROFILER,
    FakeBackend,
    Node,
    one_gpu_snapshot,
    running_node,
    short_dir,
    tcp_control,
    tree,
)

from gpuscope.cli.capture import add_capture_commands, run_capture_command

RECORD_KEYS = {"id", "outcome", "gpu", "pids", "target", "files"}


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Parse and run like `gpuscope` does (the same sub-parsers), capturing stdout and stderr."""
    parser = argparse.ArgumentParser(prog="gpuscope")
    sub = parser.add_subparsers(dest="command", required=True)
    add_capture_commands(sub)
    try:
        code = run_capture_command(parser.parse_args(argv))
    except SystemExit as exit_:  # argparse: usage errors
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with running_node(tmp_path, snapshot=one_gpu_snapshot()) as running:
        yield running


def test_capture_ls_get(node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock = str(node.socket)
    code, out, err = cli(["capture", "--gpu", "0", "--duration", "2s", "--json", "--socket", sock], capsys)
    assert code == 0, err
    record = json.loads(out)
    assert set(record) >= RECORD_KEYS
    assert record["outcome"] == "captured" and record["gpu"] == 0 and record["duration_s"] == 2.0
    assert record["target"] == f"tsl {PROFILER}" and record["files"]

    code, out, _ = cli(["capture", "--target", PROFILER, "--duration", "500ms", "--socket", sock], capsys)
    assert code == 0
    second = out.splitlines()[0].split()[0]
    assert "captured" in out and f"gpuscope captures get {second} -o DIR" in out

    code, out, _ = cli(["captures", "ls", "--json", "--socket", sock], capsys)
    assert code == 0
    listed = json.loads(out)
    assert [r["id"] for r in listed] == [second, record["id"]]
    assert all(set(r) >= RECORD_KEYS for r in listed)
    code, out, _ = cli(["captures", "ls", "--socket", sock], capsys)
    assert code == 0 and out.splitlines()[0].split()[:3] == ["ID", "STARTED", "(UTC)"]
    assert record["id"] in out and "user" in out

    target = tmp_path / "dl"
    code, out, err = cli(["captures", "get", record["id"], "-o", str(target), "--socket", sock], capsys)
    assert code == 0, err
    assert "tensorboard --logdir" in out
    assert node.store is not None
    assert tree(target) == {f.relative: f.path.read_bytes() for f in node.store.files(record["id"])}
    before = tree(target)
    code, out, err = cli(["captures", "get", record["id"], "-o", str(target), "--socket", sock], capsys)
    assert code == 1 and "already exists; refusing to overwrite" in one_line(err)
    assert tree(target) == before


def test_outcomes_other_than_captured_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with running_node(tmp_path, backend=FakeBackend(outcome="busy")) as node:
        code, out, _ = cli(["capture", "--target", PROFILER, "--json", "--socket", str(node.socket)], capsys)
        assert code == 1 and json.loads(out)["outcome"] == "busy"
    with running_node(tmp_path / "off", capture={"enabled": False}) as node:
        code, out, _ = cli(["capture", "--gpu", "0", "--socket", str(node.socket)], capsys)
        assert code == 1 and "refused" in out and "capture.enabled" in out


def test_errors_are_one_line(node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock = str(node.socket)
    code, _, err = cli(["capture", "--gpu", "0", "--socket", str(tmp_path / "none.sock")], capsys)
    assert code == 1 and "is the agent running" in one_line(err)
    code, _, err = cli(["captures", "get", "../etc", "-o", str(tmp_path / "x"), "--socket", sock], capsys)
    assert code == 2 and "path separator" in one_line(err)
    assert not (tmp_path / "x").exists()
    code, _, err = cli(["captures", "get", "20250101T000000Z-gpu0-abcdef", "-o", str(tmp_path / "x"),
                        "--socket", sock], capsys)
    assert code == 1 and "no capture" in one_line(err)
    code, _, err = cli(["capture", "--socket", sock], capsys)
    assert code == 2 and "name what to capture" in one_line(err)
    for bad in (["--duration", "31s"], ["--duration", "0s"], ["--duration", "soon"]):
        code, _, err = cli(["capture", "--gpu", "0", *bad, "--socket", sock], capsys)
        assert code == 2 and "duration" in err
    code, _, err = cli(["capture", "--gpu", "0", "--agent", "127.0.0.1:1"], capsys)
    assert code == 2 and "--token-file" in one_line(err)
    code, _, err = cli(["capture", "--gpu", "0", "--socket", sock, "--agent", "h:1"], capsys)
    assert code == 2  # argparse: not allowed together
    assert node.backend.calls == []


def test_a_tls_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pki = make_pki(tmp_path / "pki")
    with running_node(tmp_path, control=tcp_control(pki, tmp_path / "token"),
                      snapshot=one_gpu_snapshot()) as node:
        agent = f"127.0.0.1:{node.server.tcp_port}"
        tls = ["--agent", agent, "--tls-ca", str(pki.ca)]
        code, out, err = cli(["capture", "--gpu", "0", "--duration", "100ms", "--json", *tls,
                              "--token-file", str(tmp_path / "token")], capsys)
        assert code == 0, err
        assert json.loads(out)["trigger"]["user"] == "token"
        (tmp_path / "bad").write_text("a-wrong-token-0123456789")
        code, out, err = cli(["captures", "ls", *tls, "--token-file", str(tmp_path / "bad")], capsys)
        assert code == 1 and "refused the credentials" in one_line(err) and out == ""
        assert len(node.backend.calls) == 1


@contextlib.contextmanager
def two_nodes(tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    with running_node(tmp_path / "a", snapshot=one_gpu_snapshot()) as a, \
            running_node(tmp_path / "b", snapshot=one_gpu_snapshot()) as b:
        yield a, b


def test_fleet_capture_starts_together(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with two_nodes(tmp_path) as (a, b):
        agents = f"{a.socket},{b.socket}"
        before = time.time()
        code, out, err = cli(["capture", "--agents", agents, "--duration", "300ms", "--lead", "1s", "--json"],
                             capsys)
        assert code == 0, err
        records = json.loads(out)
        assert [r["agent"] for r in records] == [str(a.socket), str(b.socket)]
        assert all(r["outcome"] == "captured" and set(r) >= RECORD_KEYS for r in records)
        assert all(r["trigger"]["kind"] == "fleet" and r["gpu"] == 0 for r in records)  # GPU 0 by default
        starts = [a.backend.calls[0][0], b.backend.calls[0][0]]
        assert all(s >= before + 0.9 for s in starts), (before, starts)  # waited for the common start
        assert abs(starts[0] - starts[1]) < 0.25, starts
        assert abs(records[0]["start"] - records[1]["start"]) < 0.25

        code, out, err = cli(["capture", "--agents", f"{a.socket},{tmp_path / 'gone.sock'}", "--target",
                              PROFILER, "--lead", "0s"], capsys)
        assert code == 1 and err == ""
        lines = out.splitlines()
        assert lines[0].startswith("fleet capture on 2 agent(s), starting at ")
        assert lines[1].startswith(str(a.socket)) and " captured " in lines[1]
        assert lines[2].startswith(str(tmp_path / "gone.sock")) and " unreachable " in lines[2]
        assert "is the agent running" in lines[2]
        assert lines[3] == "1/2 captured"


def test_fleet_over_tls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pki = make_pki(tmp_path / "pki")
    control = tcp_control(pki, tmp_path / "token")
    with running_node(tmp_path / "a", control=control, snapshot=one_gpu_snapshot()) as a, \
            running_node(tmp_path / "b", control=control, snapshot=one_gpu_snapshot()) as b:
        agents = f"127.0.0.1:{a.server.tcp_port},127.0.0.1:{b.server.tcp_port}"
        code, out, err = cli(["capture", "--agents", agents, "--gpu", "0", "--duration", "100ms", "--lead",
                              "500ms", "--tls-ca", str(pki.ca), "--token-file", str(tmp_path / "token"),
                              "--json"], capsys)
        assert code == 0, err
        assert [r["outcome"] for r in json.loads(out)] == ["captured", "captured"]
        (tmp_path / "bad").write_text("a-wrong-token-0123456789")
        code, out, err = cli(["capture", "--agents", agents, "--lead", "0s", "--tls-ca", str(pki.ca),
                              "--token-file", str(tmp_path / "bad"), "--json"], capsys)
        assert code == 1
        assert [r["outcome"] for r in json.loads(out)] == ["refused", "refused"]
        assert len(a.backend.calls) == len(b.backend.calls) == 1


def test_the_gpuscope_command(node: Node, tmp_path: Path) -> None:
    """The installed entry point has both command groups, and they work end to end."""
    from gpuscope.cli import main as gpuscope_cli

    choices: dict[str, Any] = {}
    for action in gpuscope_cli.build_parser()._actions:
        choices.update(getattr(action, "choices", None) or {})
    assert {"capture", "captures"} <= set(choices)
    env = {**os.environ, "GPUSCOPE_CONTROL__SOCKET": str(node.socket)}
    done = subprocess.run([sys.executable, "-m", "gpuscope", "capture", "--gpu", "0", "--duration", "200ms",
                           "--json"], capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 0, done.stderr
    capture_id = json.loads(done.stdout)["id"]
    with short_dir() as folder:
        done = subprocess.run([sys.executable, "-m", "gpuscope", "captures", "get", capture_id, "-o",
                               str(folder / "out")], capture_output=True, text=True, timeout=60, env=env,
                              check=False)
        assert done.returncode == 0, done.stderr
        assert (folder / "out" / "capture.json").is_file()
    done = subprocess.run([sys.executable, "-m", "gpuscope", "captures", "get", "../../x", "-o",
                           str(tmp_path / "y")], capture_output=True, text=True, timeout=60, env=env,
                          check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1
