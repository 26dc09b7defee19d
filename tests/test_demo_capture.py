"""The demo as a new user meets it: `gpuscope run --simulate demo`, then `gpuscope capture --gpu 0`,
`gpuscope captures ls` and `gpuscope captures get`, each a real process, with the paths the user who
runs them gets by default.

* As root, with the store, control socket and Kineto trace directory in the test's directory (a test
  never writes the machine's /var/lib/gpuscope), and the Kineto daemon on the real abstract @dynolog
  when nothing else holds it.
* As an ordinary user (made for the test with useradd, removed after; only when the test runs as root
  and runuser exists), with no setting at all: the store in ~/.local/state, the sockets and traces in
  /tmp/gpuscope-<uid>, as under `su` or `runuser`, which set no XDG_RUNTIME_DIR.
* Two agents on one machine: the second never takes the first's control socket or store, says whose
  they are, and the command-line client says which agent it talks to.

The simulated GPU processes are real processes that poll the agent's Kineto daemon as PyTorch jobs
do and, when traced, work and wait as their GPU's pattern says (GPU 0 of the demo: steady at 96 %)
and write the Chrome trace of what they did.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from agent_process import free_port, http_get

from gpuscope.simulate.traced_work import INPUT_WAIT

REPO = Path(__file__).resolve().parent.parent
RUNUSER = shutil.which("runuser")
CAPTURE_S = 2.0
HELPERS = 5  # the demo's simulated processes: train-rank0..3 and eval-job


@dataclass
class Person:
    """Who runs the commands: ``prefix`` runs them as that user (runuser), ``python`` an interpreter
    that user can run, ``home`` a directory that user may write in."""

    uid: int
    python: str
    prefix: list[str]
    env: dict[str, str]
    home: Path

    def command(self, *args: str) -> list[str]:
        return [*self.prefix, self.python, "-m", "gpuscope", *args]


@dataclass
class DemoAgent:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def clean_environment(**extra: str) -> dict[str, str]:
    """This process's environment without what would choose the agent's paths."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GPUSCOPE_", "XDG_")) and k not in ("STATE_DIRECTORY", "RUNTIME_DIRECTORY")}
    return {**env, **extra}


def run_cli(person: Person, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(person.command(*args), env=person.env, cwd=person.home, capture_output=True,
                          text=True, timeout=timeout, check=False)


@contextlib.contextmanager
def demo_agent(person: Person, log: Path, *args: str) -> Iterator[DemoAgent]:
    """`gpuscope run --simulate demo` as ``person`` until the block ends, once it is healthy."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(person.command("run", "--simulate", "demo", "--web.listen-address",
                                               f"127.0.0.1:{port}", *args),
                                env=person.env, cwd=person.home, stdout=subprocess.DEVNULL, stderr=out)
    agent = DemoAgent(proc, port, log)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the agent exited with {proc.returncode}:\n{agent.text()}")
            with contextlib.suppress(OSError):
                if http_get(f"http://127.0.0.1:{port}/-/healthy", timeout=1.0)[0] == 200:
                    break
            assert time.monotonic() < deadline, f"the agent is not healthy after 60 s:\n{agent.text()}"
            time.sleep(0.1)
        yield agent
    finally:
        stop_agent(agent)


def stop_agent(agent: DemoAgent) -> None:
    if agent.proc.poll() is None:
        agent.proc.send_signal(signal.SIGTERM)  # runuser passes it on to the agent
        try:
            agent.proc.wait(15)
        except subprocess.TimeoutExpired:
            agent.proc.kill()
            agent.proc.wait()


def gpu_pids(agent: DemoAgent, index: int, timeout: float = 30.0) -> list[int]:
    """The pids on GPU ``index`` in the agent's snapshot, once it has one."""
    deadline = time.monotonic() + timeout
    while (answer := http_get(f"http://127.0.0.1:{agent.port}/api/v1/snapshot"))[0] != 200:
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)
    (gpu,) = [g for g in json.loads(answer[1])["gpus"] if g["index"] == index]
    return [p["pid"] for p in gpu["processes"]]


def wait_registered(agent: DemoAgent, pids: list[int], timeout: float = 30.0) -> None:
    """Until the agent's log says each of ``pids`` polled its Kineto daemon."""
    deadline = time.monotonic() + timeout
    while not all(f"pid {pid} registered" in agent.text() for pid in pids):
        assert agent.proc.poll() is None, agent.text()
        assert time.monotonic() < deadline, f"{pids} never registered:\n{agent.text()}"
        time.sleep(0.1)


def capture_gpu0(person: Person, agent: DemoAgent, socket_path: Path, out_dir: Path) -> dict[str, Any]:
    """`gpuscope capture --gpu 0`, `captures ls` and `captures get` as ``person``; the trace of GPU 0's
    process, checked to be what that process did while it was traced."""
    (pid,) = gpu_pids(agent, 0)
    wait_registered(agent, [pid])
    before = time.time()
    result = run_cli(person, "capture", "--gpu", "0", "--duration", f"{CAPTURE_S:g}s", "--json")
    after = time.time()
    assert result.returncode == 0, (result.stdout, result.stderr, agent.text())
    record = json.loads(result.stdout)
    assert record["outcome"] == "captured", record
    assert record["pids"] == [pid] and record["gpu"] == 0
    # Which agent answered: on stderr first, and in the JSON.
    node = "demo"  # a simulated node is named after its scenario, not after this machine
    first = result.stderr.splitlines()[0]
    assert re.fullmatch(rf"agent {re.escape(node)} \(simulating demo, pid {agent_pid(agent)}\) at "
                        rf"{re.escape(str(socket_path))}", first), result.stderr
    assert (record["agent"], record["node"]) == (str(socket_path), node)

    listing = run_cli(person, "captures", "ls", "--json")
    assert listing.returncode == 0, listing.stderr
    assert record["id"] in [r["id"] for r in json.loads(listing.stdout)]

    fetched = run_cli(person, "captures", "get", record["id"], "-o", str(out_dir))
    assert fetched.returncode == 0, fetched.stderr
    (trace_file,) = out_dir.glob("*.pt.trace.json.gz")
    document = json.loads(gzip.decompress(trace_file.read_bytes()))
    spans = [e for e in document["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "Trace"]
    # The process's own events, and the simulated GPU's kernels on device 0 (Kineto's pid for a GPU).
    assert spans and {e["pid"] for e in spans if e["cat"] != "kernel"} == {pid}
    assert {e["pid"] for e in spans if e["cat"] == "kernel"} == {0}
    names = {e["name"] for e in spans}
    assert {"compute", INPUT_WAIT, "ProfilerStep#0"} <= names, names
    # Real timestamps: every span lies within the capture command's run, and the recording covers
    # about the requested time (it ends at the capture's end; the first step may start a little late).
    base_us = document["baseTimeNanoseconds"] / 1000
    starts = [base_us + e["ts"] for e in spans]
    ends = [base_us + e["ts"] + e["dur"] for e in spans]
    assert before * 1e6 <= min(starts) and max(ends) <= after * 1e6
    assert CAPTURE_S * 0.9e6 <= max(ends) - min(starts) <= CAPTURE_S * 1.1e6
    # GPU 0 is busy 96 % of the time: the process computed most of the time, in steps of 0.1 s.
    busy = sum(e["dur"] for e in spans if e["name"] == "compute")
    assert busy >= 0.8 * CAPTURE_S * 1e6, busy
    steps = [e for e in spans if e["name"].startswith("ProfilerStep#")]
    assert 15 <= len(steps) <= 25
    assert all(e["args"]["blocks"] > 0 for e in spans if e["name"] == "compute")
    return record


def agent_pid(agent: DemoAgent) -> int:
    """The agent's own pid: the process started, or under runuser its child."""
    process = psutil.Process(agent.proc.pid)
    if process.name() != "runuser":
        return agent.proc.pid
    (child,) = process.children()
    return int(child.pid)


def dynolog_is_free() -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind("\0dynolog\0")
        except OSError:
            return False
        return True


# -- as root, or as whoever runs the tests -----------------------------------------------------------


def test_the_demo_is_capturable(tmp_path: Path) -> None:
    # Short paths of the test's own: the Kineto socket directory must fit a Unix socket address.
    short = Path(tempfile.mkdtemp(prefix="gd-", dir="/tmp"))
    try:
        socket_path = short / "control.sock"
        env = clean_environment(GPUSCOPE_CAPTURE__STORE__ROOT=str(tmp_path / "captures"),
                                GPUSCOPE_CONTROL__SOCKET=str(socket_path),
                                GPUSCOPE_CAPTURE__KINETO__TRACE_DIR=str(short / "traces"))
        if os.geteuid() == 0 and not dynolog_is_free():  # dynolog or another agent serves this host
            env["GPUSCOPE_CAPTURE__KINETO__SOCKET_DIR"] = str(short / "ipc")
        person = Person(os.geteuid(), sys.executable, [], env, tmp_path)
        with demo_agent(person, tmp_path / "agent.log") as agent:
            record = capture_gpu0(person, agent, socket_path, tmp_path / "trace")
            assert (tmp_path / "captures" / record["id"] / "capture.json").is_file()
        assert not socket_path.exists()  # removed when the agent stopped
    finally:
        shutil.rmtree(short, ignore_errors=True)


# -- as an ordinary user, with every default -----------------------------------------------------------


@dataclass
class OrdinaryUser:
    name: str
    uid: int
    home: Path


@pytest.fixture
def ordinary_user() -> Iterator[OrdinaryUser]:
    if os.geteuid() != 0 or RUNUSER is None or shutil.which("useradd") is None:
        pytest.skip("needs root, runuser and useradd to run the demo as an ordinary user")
    name = f"gpuscope-t{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", name], check=True, capture_output=True)
    try:
        uid = int(subprocess.run(["id", "-u", name], check=True, capture_output=True, text=True).stdout)
        home = Path(subprocess.run(["getent", "passwd", name], check=True, capture_output=True,
                                   text=True).stdout.split(":")[5])
        yield OrdinaryUser(name, uid, home)
    finally:
        subprocess.run(["userdel", "--remove", name], check=False, capture_output=True)
        shutil.rmtree(f"/tmp/gpuscope-{uid}", ignore_errors=True)


def python_for(user: OrdinaryUser, scratch: Path) -> str:
    """An interpreter ``user`` can run that imports gpuscope: this one, or (when it lies in a home
    only root may enter) the system's interpreter of the same version, given this environment's
    packages through a .pth file in a small virtual environment."""
    def works(python: str) -> bool:
        return subprocess.run([RUNUSER or "runuser", "-u", user.name, "--", python, "-c", "import gpuscope"],
                              cwd="/", capture_output=True, check=False).returncode == 0

    if works(sys.executable):
        return sys.executable
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    system = next((p for p in (f"/usr/bin/python{version}", f"/usr/local/bin/python{version}")
                   if os.access(p, os.X_OK)), None)
    if system is None:
        pytest.skip(f"no Python {version} that {user.name} may run")
    site_packages = next(Path(sys.prefix).glob("lib/python*/site-packages"))
    venv = scratch / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(system)
    (venv / "pyvenv.cfg").write_text(f"home = {Path(system).parent}\ninclude-system-site-packages = false\n"
                                     f"version = {version}\n")
    own = venv / "lib" / f"python{version}" / "site-packages"
    own.mkdir(parents=True)
    (own / "gpuscope-test.pth").write_text(f"import site; site.addsitedir({str(site_packages)!r})\n")
    for directory in (scratch, *(p for p in venv.rglob("*") if p.is_dir()), venv):
        directory.chmod(0o755)
    python = str(venv / "bin" / "python")
    if not works(python):
        pytest.skip(f"{user.name} cannot import gpuscope from this checkout (is it readable?)")
    return python


def test_the_demo_is_capturable_by_an_ordinary_user_with_the_default_paths(ordinary_user: OrdinaryUser,
                                                                           tmp_path: Path) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="gd-", dir="/tmp"))
    try:
        scratch.chmod(0o755)
        python = python_for(ordinary_user, scratch)
        env = clean_environment(HOME=str(ordinary_user.home))
        person = Person(ordinary_user.uid, python, [RUNUSER or "runuser", "-u", ordinary_user.name, "--"],
                        env, ordinary_user.home)
        runtime = Path(f"/tmp/gpuscope-{ordinary_user.uid}")
        out_dir = ordinary_user.home / "trace"
        with demo_agent(person, tmp_path / "agent.log") as agent:
            log = agent.text()
            assert "disabled" not in log, log  # no "captures disabled", no "control API disabled"
            record = capture_gpu0(person, agent, runtime / "control.sock", out_dir)
            store = ordinary_user.home / ".local" / "state" / "gpuscope" / "captures"
            assert (store / record["id"] / "capture.json").is_file()
            # The runtime directory is the user's alone. A simulated node's Kineto daemon listens in a
            # directory of its own: neither the node-wide @dynolog nor the socket directory that a real
            # agent of this user would take.
            info = runtime.lstat()
            assert (info.st_uid, info.st_mode & 0o777) == (ordinary_user.uid, 0o700)
            assert not (runtime / "kineto" / "ipc" / "dynolog").exists()
            sockets = [line.split()[-1] for line in Path("/proc/net/unix").read_text().splitlines()[1:]
                       if line.split()[-1].endswith("/dynolog")]
            assert any("/gpuscope-sim-kineto-" in path for path in sockets), sockets
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# -- two agents on one machine -------------------------------------------------------------------------


def test_a_second_agent_never_takes_the_first_ones_socket_or_store(tmp_path: Path) -> None:
    short = Path(tempfile.mkdtemp(prefix="gd-", dir="/tmp"))
    try:
        socket_path = short / "control.sock"
        store = tmp_path / "captures"
        env = clean_environment(GPUSCOPE_CAPTURE__STORE__ROOT=str(store),
                                GPUSCOPE_CONTROL__SOCKET=str(socket_path),
                                GPUSCOPE_CAPTURE__KINETO__TRACE_DIR=str(short / "traces"),
                                GPUSCOPE_CAPTURE__KINETO__SOCKET_DIR=str(short / "ipc"))
        person = Person(os.geteuid(), sys.executable, [], env, tmp_path)
        with demo_agent(person, tmp_path / "first.log") as first:
            with demo_agent(person, tmp_path / "second.log") as second:
                log = second.text()
                node, pid = "demo", first.proc.pid
                assert (f"control API disabled: the control socket {socket_path} is in use by another agent "
                        f"(pid {pid}, node {node}, simulating demo); set control.socket") in log, log
                assert (f"captures disabled: the capture store {store} is in use by another gpuscope agent "
                        f"(pid {pid}); set capture.store.root") in log, log
                # The client talks to the first agent, and says so.
                listing = run_cli(person, "captures", "ls")
                assert listing.returncode == 0, listing.stderr
                assert listing.stderr.splitlines()[0] == (f"agent {node} (simulating demo, pid {pid}) "
                                                          f"at {socket_path}")
            # The second agent left the first one's socket in place (its gRPC server's since the
            # second agent asked who it is), and it still answers, as the first agent.
            again = run_cli(person, "captures", "ls")
            assert again.returncode == 0, again.stderr
            assert again.stderr.splitlines()[0].endswith(f"pid {pid}) at {socket_path}")
            assert first.proc.poll() is None
    finally:
        shutil.rmtree(short, ignore_errors=True)
