"""`gpuscope capture` and `gpuscope captures` against running control servers (in-process, Unix sockets
and TLS on loopback): JSON records, downloads, errors as one line, fleet captures at a common start."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from pki import make_pki
from test_control_api import (
    PROFILER,
    FakeBackend,
    GatedBackend,
    Node,
    one_gpu_snapshot,
    running_node,
    short_dir,
    tcp_control,
    tree,
)

from gpuscope.capture.model import BackendResult, CaptureTarget, StagingArea
from gpuscope.cli.capture import add_capture_commands, run_capture_command
from gpuscope.control.errors import ControlError
from gpuscope.snapshot import GpuReading, Snapshot

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


AGENT_LINE = re.compile(r"agent \S+ \((simulating \S+, )?pid \d+\) at \S+")  # which agent answers


def one_line(err: str) -> str:
    """The one line of an error (after the line saying which agent answered, if one did)."""
    lines = err.strip().splitlines()
    if len(lines) > 1 and AGENT_LINE.fullmatch(lines[0]):
        lines = lines[1:]
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
    # Which agent answers: the first line on stderr, and the node and address in the JSON.
    assert err.splitlines()[0] == f"agent node (pid {os.getpid()}) at {sock}"
    record = json.loads(out)
    assert (record["agent"], record["node"]) == (sock, "node")
    assert set(record) >= RECORD_KEYS
    assert record["outcome"] == "captured" and record["gpu"] == 0 and record["duration_s"] == 2.0
    assert record["target"] == f"tsl {PROFILER}" and record["files"]

    code, out, _ = cli(["capture", "--target", PROFILER, "--duration", "500ms", "--socket", sock], capsys)
    assert code == 0
    second = out.splitlines()[0].split()[0]
    assert "captured" in out and f"gpuscope captures get {second} -o DIR" in out

    code, out, err = cli(["captures", "ls", "--json", "--socket", sock], capsys)
    assert code == 0 and AGENT_LINE.fullmatch(err.strip())
    listed = json.loads(out)
    assert [r["id"] for r in listed] == [second, record["id"]]
    assert {(r["agent"], r["node"]) for r in listed} == {(sock, "node")}
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
    code, _, err = cli(["captures", "ls", "--limit", "1001", "--socket", sock], capsys)
    assert code == 2
    assert "limit must be a whole number from 1 to 1000 (absent: 100), not '1001'" in one_line(err)
    assert node.backend.calls == []


def test_listing_an_agent_without_captures_says_so(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with running_node(tmp_path, with_service=False) as node:
        code, out, err = cli(["captures", "ls", "--socket", str(node.socket)], capsys)
    assert code == 1 and out == "" and "captures are disabled on this agent" in one_line(err)


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


# -- a GPU the node lacks, captures that stored nothing, progress, viewers -----------------------------------

NO_SUCH_PID = 4_194_305  # above Linux's largest pid_max: no process has it


def error_line(err: str) -> str:
    """The one error line on stderr (other lines, such as which agent answered, are not errors)."""
    errors = [line for line in err.splitlines() if line.startswith("gpuscope: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def four_gpu_snapshot() -> Snapshot:
    gpus = tuple(GpuReading(index=i, uuid=f"GPU-fake-{i}", name="Fake GPU",
                            pci_bus_id=f"00000000:0{i + 1}:00.0", up=True) for i in range(4))
    return Snapshot(timestamp=time.time(), hostname="node", nvml_up=True, driver_version="1", gpus=gpus,
                    sample_duration_seconds=0.01)


def test_a_gpu_the_node_lacks_is_named_with_the_gpus_it_has(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with running_node(tmp_path, snapshot=four_gpu_snapshot()) as node:
        sock = str(node.socket)
        code, out, err = cli(["capture", "--gpu", "9", "--socket", sock], capsys)
        assert code == 2 and out == ""
        assert error_line(err) == f"gpuscope: {sock}: GPU 9 does not exist on node: its GPUs are 0, 1, 2, 3"
        with node.client() as client, pytest.raises(ControlError) as caught:  # any client: the agent says it
            client.capture(gpu=9)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        code, out, _ = cli(["capture", "--agents", sock, "--gpu", "9", "--lead", "0s"], capsys)
        assert code == 1 and "GPU 9 does not exist on node" in out
        code, _, err = cli(["capture", "--gpu", "3", "--duration", "100ms", "--socket", sock], capsys)
        assert code == 0, err
        assert len(node.backend.calls) == 1  # only GPU 3's capture ran
    down = Snapshot(timestamp=time.time(), hostname="node", nvml_up=False, driver_version=None, gpus=(),
                    sample_duration_seconds=0.01)
    with running_node(tmp_path / "down", snapshot=down) as node:
        code, _, err = cli(["capture", "--gpu", "0", "--socket", str(node.socket)], capsys)
        assert code == 1 and "GPU 0: NVML is not available on node" in error_line(err)
        assert node.backend.calls == []


def test_a_capture_that_stored_nothing_prints_no_id_to_download(
        node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock = str(node.socket)
    code, out, err = cli(["capture", "--pid", str(NO_SUCH_PID), "--socket", sock], capsys)
    assert code == 1 and "Traceback" not in err, err
    assert out.splitlines() == [out.strip()]  # one line, no "download: ..." hint
    assert out.split()[:2] == ["-", "unreachable"] and "no profiling endpoint" in out
    code, out, _ = cli(["capture", "--pid", str(NO_SUCH_PID), "--json", "--socket", sock], capsys)
    record = json.loads(out)
    assert record["outcome"] == "unreachable" and record["files"] == []
    # Its id, from the JSON record or the agent's log: `captures get` says why there is nothing.
    code, _, err = cli(["captures", "get", record["id"], "-o", str(tmp_path / "x"), "--socket", sock], capsys)
    assert code == 1 and "only captures that reached a profiler are stored" in error_line(err)
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def _read_terminal(fd: int, *, until: str | None = None, times: int = 1, timeout: float = 30.0) -> str:
    """What the terminal shows: until ``until`` has appeared ``times`` times, or (None) until the other
    side is closed."""
    seen = b""
    deadline = time.monotonic() + timeout
    while until is None or seen.decode(errors="replace").count(until) < times:
        left = deadline - time.monotonic()
        assert left > 0, f"{until!r} not shown: {seen!r}"
        if not select.select([fd], [], [], left)[0]:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    return seen.decode(errors="replace")


def _capture_on_a_terminal(node: Node, *flags: str) -> tuple[subprocess.Popen[str], int]:
    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "gpuscope", "capture", *flags, "--socket",
                             str(node.socket)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=terminal, text=True)
    os.close(terminal)
    return proc, controller


def test_a_capture_shows_its_progress_on_a_terminal(tmp_path: Path) -> None:
    backend = GatedBackend()
    with running_node(tmp_path, backend=backend, snapshot=one_gpu_snapshot()) as node:
        proc, controller = _capture_on_a_terminal(node, "--gpu", "0", "--duration", "2s")
        try:
            shown = _read_terminal(controller, until="\rcapturing GPU 0: ", times=2)  # drawn, then redrawn
            backend.release.set()
            out, _ = proc.communicate(timeout=60)
            shown += _read_terminal(controller)
        finally:
            backend.release.set()
            os.close(controller)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, shown
    # Redrawn in place (each draw starts with \r) as the seconds pass, then erased before the record; on
    # the last line of the terminal, after any message printed whole before the capture started.
    drawn = re.fullmatch(r"((?:\rcapturing GPU 0: \d+s / 2s)+)\r( +)\r", shown.rsplit("\n", 1)[-1])
    assert drawn, repr(shown)
    seconds = [int(n) for n in re.findall(r"(\d+)s / 2s", drawn[1])]
    assert seconds[0] == 0 and len(seconds) >= 2 and seconds == sorted(set(seconds)), seconds
    assert len(drawn[2]) == len(f"capturing GPU 0: {seconds[-1]}s / 2s")
    assert " captured " in out and "\r" not in out


def test_no_progress_when_piped_or_with_json(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    proc, controller = _capture_on_a_terminal(node, "--gpu", "0", "--duration", "100ms", "--json")
    try:
        out, _ = proc.communicate(timeout=60)
        shown = _read_terminal(controller)
    finally:
        os.close(controller)
    assert proc.returncode == 0 and json.loads(out)["outcome"] == "captured"
    assert "capturing" not in shown  # a terminal, but --json: the output is for a program
    piped = subprocess.run([sys.executable, "-m", "gpuscope", "capture", "--gpu", "0", "--duration", "100ms",
                            "--socket", str(node.socket)], capture_output=True, text=True, timeout=60,
                           check=False)
    assert piped.returncode == 0 and " captured " in piped.stdout
    assert "capturing" not in piped.stderr and "\r" not in piped.stderr
    code, _, err = cli(["capture", "--agents", str(node.socket), "--duration", "100ms", "--lead", "0s"],
                       capsys)
    assert code == 0 and "capturing" not in err


class KinetoFakeBackend(FakeBackend):
    """Writes what PyTorch's Kineto backend writes: a gzipped Chrome trace named *.pt.trace.json.gz."""

    def capture(self, target: CaptureTarget, duration_s: float, staging: StagingArea, *,
                deadline_s: float) -> BackendResult:
        self.calls.append((time.time(), target.address, duration_s))
        with staging.new_file("node_4242.1700000000000", ".pt.trace.json.gz") as new:
            new.file.write(b"\x1f\x8b fake")
            return BackendResult("captured", files=(new.publish(),))


def test_captures_get_names_the_viewer_for_the_trace_format(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with running_node(tmp_path, backend=KinetoFakeBackend(), snapshot=one_gpu_snapshot()) as node:
        sock = str(node.socket)
        code, out, err = cli(["capture", "--gpu", "0", "--duration", "100ms", "--json", "--socket", sock],
                             capsys)
        assert code == 0, err
        capture_id = json.loads(out)["id"]
        code, out, err = cli(["captures", "get", capture_id, "-o", str(tmp_path / "dl"), "--socket", sock],
                             capsys)
    assert code == 0, err
    trace = tmp_path / "dl" / "node_4242.1700000000000.pt.trace.json.gz"
    assert trace.is_file()
    assert f"open {trace} in https://ui.perfetto.dev (or chrome://tracing)" in out
    assert "tensorboard" not in out


def test_viewer_hints_per_format() -> None:
    from gpuscope.cli.trace_viewers import viewer_hints

    out = Path("/tmp/dl")
    xspace = "plugins/profile/2025_01_01_00_00_00/node.xplane.pb"
    assert viewer_hints([xspace, "capture.json"], out) == [
        "view the XSpace trace: tensorboard --logdir /tmp/dl  (with the profile plugin: pip install "
        "tensorboard-plugin-profile), or xprof --logdir=/tmp/dl"]
    assert viewer_hints(["capture.json"], out) == []
    many = [f"node_{pid}.1.pt.trace.json.gz" for pid in range(5)]
    both = viewer_hints([xspace, *many, "plain.pt.trace.json"], out)
    assert len(both) == 2 and both[0].startswith("view the XSpace trace: tensorboard --logdir /tmp/dl")
    assert both[1] == ("view the PyTorch trace: open /tmp/dl/**/*.pt.trace.json* in https://ui.perfetto.dev "
                       "(or chrome://tracing)")


TRACES = Path(__file__).parent / "fixtures" / "traces"


class RecordedTraceBackend(FakeBackend):
    """Writes a real trace (a fixture of a real job), as PyTorch's Kineto backend names it."""

    def __init__(self, trace: Path) -> None:
        super().__init__()
        self.trace = trace

    def capture(self, target: CaptureTarget, duration_s: float, staging: StagingArea, *,
                deadline_s: float) -> BackendResult:
        self.calls.append((time.time(), target.address, duration_s))
        with staging.new_file("node_4242.1700000000000", ".pt.trace.json.gz") as new:
            new.file.write(self.trace.read_bytes())
            return BackendResult("captured", files=(new.publish(),))


def test_explain_and_ls_say_what_fixing_each_finding_would_buy(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`captures explain` diagnoses the stored traces: each finding's gain, and all the fixes' together;
    `captures ls` shows the verdict's gain from the record's analysis (the worker's summary of that
    report), and its --json carries the record's gains as they are."""
    from gpuscope.capture.analysis_worker import summarise

    backend = RecordedTraceBackend(TRACES / "h100" / "seg_masked_loss.pt.trace.json.gz")
    with running_node(tmp_path, backend=backend, snapshot=one_gpu_snapshot()) as node:
        sock = str(node.socket)
        ids = []
        for trace in ("h100/seg_masked_loss.pt.trace.json.gz", "h200_pytorch_input_loop.pt.trace.json.gz"):
            backend.trace = TRACES / trace
            code, out, err = cli(["capture", "--gpu", "0", "--duration", "100ms", "--json", "--socket", sock],
                                 capsys)
            assert code == 0, err
            ids.append(json.loads(out)["id"])
        masked, input_loop = ids
        code, text, err = cli(["captures", "explain", masked, "--socket", sock], capsys)
        assert code == 0, err
        code, out, err = cli(["captures", "explain", masked, "--json", "--socket", sock], capsys)
        assert code == 0, err
        report = json.loads(out)
        assert node.store is not None
        node.store.annotate(masked, summarise(report))
        code, out, err = cli(["captures", "explain", input_loop, "--json", "--socket", sock], capsys)
        assert code == 0, err
        node.store.annotate(input_loop, summarise(json.loads(out)))
        code, table, err = cli(["captures", "ls", "--socket", sock], capsys)
        assert code == 0, err
        code, out, err = cli(["captures", "ls", "--json", "--socket", sock], capsys)
        assert code == 0, err
        listed = {r["id"]: r for r in json.loads(out)}

    # explain: every finding's gain, as words and as JSON, and the fixes' together.
    (trace,) = report["traces"]
    gains = {f["kind"]: f["gain"] for f in trace["findings"]}
    assert gains["layout_conversion"]["before_s"] > gains["layout_conversion"]["after_s"] > 0
    assert gains["tensor_cores_idle"]["share"] == pytest.approx(0.34, abs=0.01)
    together = trace["gain_together"]
    assert together["after_s"] < gains["layout_conversion"]["after_s"]
    assert text.count("fixing it: ") == len(trace["findings"])
    assert "run 7.4x faster on the tensor cores" in text
    before, after = together["before_s"] * 1e3, together["after_s"] * 1e3
    assert f"fixing all of them: {before:.1f} -> {after:.1f} ms a step" in text
    # ls: the verdict's finding's gain (34% less for the tensor cores; 29% less for the host syncs).
    head, *rows = table.splitlines()
    gain_at = head.index("GAIN")
    cells = {row.split()[0]: row[gain_at:].split()[:2] for row in rows if row.split()[0] in ids}
    assert cells == {masked: ["-34%", "step"], input_loop: ["-29%", "step"]}, table
    assert rows[-1].startswith("GAIN: the step time fixing the finding saves"), table
    # ls --json: the record as stored, its gains included.
    (kept,) = [f for f in listed[masked]["analysis"]["findings"] if f["kind"] == "layout_conversion"]
    layout = gains["layout_conversion"]
    assert kept["gain"] == {**layout, "assumptions": layout["assumptions"][:4]}
    assert listed[masked]["analysis"]["gain_together"]["after_s"] == together["after_s"]
    (sync,) = [f for f in listed[input_loop]["analysis"]["findings"] if f["kind"] == "host_sync"]
    assert sync["gain"]["share"] == pytest.approx(0.29, abs=0.005)
