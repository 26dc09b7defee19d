"""The private socket between the agent and its control API server process: the agent's end answers
calls from its methods, bounds what it reads, and the server process's end turns answers and the
agent's departure into results and status codes."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import cast

import pytest
from snapshots import FakeSource

from gpuscope.capture.model import CaptureRecord
from gpuscope.capture.service import CaptureRequest, CaptureService
from gpuscope.control import bridge
from gpuscope.control.bridge import AgentBridge, Bridge, RemoteMethods
from gpuscope.control.methods import ApiError, ControlMethods
from gpuscope.threads import start_thread


class SlowService:
    """A capture service whose captures never finish (until released)."""

    def __init__(self) -> None:
        self.submitted: list[CaptureRequest] = []
        self.futures: list[Future[CaptureRecord]] = []

    def submit(self, request: CaptureRequest) -> Future[CaptureRecord]:
        self.submitted.append(request)
        future: Future[CaptureRecord] = Future()
        self.futures.append(future)
        return future


class Ends:
    """Both ends of a bridge, the agent's served on a thread, its methods over ``service``."""

    def __init__(self, service: SlowService) -> None:
        self.service = service
        methods = ControlMethods(service=cast(CaptureService, service), store=None, snapshots=FakeSource(),
                                 alerts=None, hostname="node", info={"node_name": "node", "pid": 7})
        ours, theirs = socket.socketpair()
        self.events: list[str] = []
        self.closed = threading.Event()
        self.agent = AgentBridge(ours, methods, on_ready=lambda at: self.events.append(f"ready {at}"),
                                 on_failed=lambda message: self.events.append(f"failed {message}"),
                                 on_idle=lambda: self.events.append("idle"), on_closed=self.closed.set)
        self.thread = start_thread("test-bridge", self.agent.serve)
        self.server_end = theirs


@pytest.fixture
def ends() -> Iterator[Ends]:
    pair = Ends(SlowService())
    yield pair
    pair.agent.close()
    pair.thread.join(5)


def test_calls_are_answered_from_the_agents_methods(ends: Ends) -> None:
    remote = RemoteMethods(ends.server_end, info={"pid": 7})
    assert json.loads(remote.alerts_json()) == {"enabled": False, "alerts": []}
    with pytest.raises(ApiError) as unavailable:
        remote.snapshot_json()  # no snapshot yet
    assert unavailable.value.code == "UNAVAILABLE"
    with pytest.raises(ApiError) as invalid:
        remote.capture({"gpu": 10_000}, user="unix", context=Active())
    assert (invalid.value.code, invalid.value.message) == ("INVALID_ARGUMENT",
                                                           "gpu must be a GPU index (0 to 9999), got 10000")
    remote.send({"ready": [1, 2]})
    remote.send({"idle": True})
    remote.close()
    assert ends.closed.wait(5)
    assert ends.events == ["ready (1, 2)", "idle"]


class Active:
    def __init__(self) -> None:
        self.active = True

    def time_remaining(self) -> float | None:
        return None

    def is_active(self) -> bool:
        return self.active


def waiting_capture(ends: Ends, remote: RemoteMethods, context: Active) -> tuple[threading.Thread, list[str]]:
    """A Capture call of pid 42 on a thread, returned once the agent's service has it (it never
    finishes); the list gets the status code it ends with."""
    outcome: list[str] = []

    def capture() -> None:
        try:
            remote.capture({"pid": 42}, user="unix", context=context)
        except ApiError as err:
            outcome.append(err.code)

    caller = threading.Thread(target=capture)
    caller.start()
    while not ends.service.submitted:
        threading.Event().wait(0.01)
    return caller, outcome


def test_a_client_that_goes_away_cancels_its_wait_in_the_agent(ends: Ends) -> None:
    remote = RemoteMethods(ends.server_end, info={})
    context = Active()
    caller, outcome = waiting_capture(ends, remote, context)
    service = ends.service
    context.active = False
    caller.join(5)
    assert outcome == ["CANCELLED"]
    assert service.submitted[0].pid == 42
    # The agent's wait ended too: its slot for a waiting capture is free again (4 at most).
    for _ in range(8):
        if ends.agent._calls == {}:
            break
        threading.Event().wait(0.25)
    assert ends.agent._calls == {}


def test_the_agent_going_away_ends_waiting_calls_as_unavailable(ends: Ends) -> None:
    remote = RemoteMethods(ends.server_end, info={})
    caller, outcome = waiting_capture(ends, remote, Active())
    ends.agent.close()
    caller.join(5)
    assert outcome == ["UNAVAILABLE"]
    assert remote.closed.is_set() and remote.ended.is_set()
    with pytest.raises(ApiError, match="UNAVAILABLE"):
        remote.alerts_json()


def test_a_message_over_the_bound_is_not_read(ends: Ends, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        ends.server_end.sendall((bridge.MAX_CALL_BYTES + 1).to_bytes(4, "big"))  # and nothing after it
        assert ends.closed.wait(5)
    assert f"a message of {bridge.MAX_CALL_BYTES + 1} bytes, over the {bridge.MAX_CALL_BYTES} allowed" \
        in caplog.text


@pytest.mark.parametrize(("message", "complaint"), [
    (b"[1, 2]", "a message that is not a JSON object"),
    (b"{\"who\": 1}", "a message of no known kind (who)"),
    (b"\xff", "a message that is not JSON"),
])
def test_anything_else_closes_the_connection(ends: Ends, caplog: pytest.LogCaptureFixture, message: bytes,
                                             complaint: str) -> None:
    with caplog.at_level(logging.WARNING):
        ends.server_end.sendall(len(message).to_bytes(4, "big") + message)
        assert ends.closed.wait(5)
    assert complaint in caplog.text


def test_unknown_methods_and_calls_beyond_the_limit_are_refused(ends: Ends,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    end = Bridge(ends.server_end, max_in=1 << 20)
    end.send({"call": 1, "method": "shutdown", "args": {}})
    assert end.receive() == {"answer": 1, "error": ["UNIMPLEMENTED", "no method 'shutdown'"]}
    monkeypatch.setattr(bridge, "MAX_CALLS", 1)
    end.send({"call": 2, "method": "capture", "args": {"fields": {"pid": 1}, "user": "unix"}})
    end.send({"call": 3, "method": "alerts_json", "args": {}})
    assert end.receive() == {"answer": 3, "error": ["RESOURCE_EXHAUSTED",
                                                    "1 calls are already in progress on this agent"]}


def test_a_method_that_fails_ends_its_call(ends: Ends, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> bytes:
        raise RuntimeError("a defect")

    monkeypatch.setattr(ends.agent._methods, "alerts_json", broken)
    remote = RemoteMethods(ends.server_end, info={})
    with caplog.at_level(logging.ERROR), pytest.raises(ApiError) as failed:
        remote.alerts_json()
    assert (failed.value.code, failed.value.message) == ("INTERNAL", "RuntimeError: a defect")
    assert "control API: alerts_json failed" in caplog.text
