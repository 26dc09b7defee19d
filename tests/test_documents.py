"""The read side (gpuscope.documents): one builder per document and one reading of the listing's
parameters, so that HTTP's /api/v1/* and the control API answer the same documents. The two doors are
compared on a running simulated node (`gpuscope run --simulate demo`) under each combination of the
``processes`` settings, and a bad limit is refused alike at both."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from agent_process import RunningAgent, free_port, run_agent
from prometheus_client import CollectorRegistry
from snapshots import FakeSource, make_full_snapshot
from test_status_page import add_capture

from gpuscope.capture.model import Trigger
from gpuscope.capture.refusals import RefusalLog, RefusedTrigger
from gpuscope.capture.store import CaptureStore
from gpuscope.control.client import ControlClient
from gpuscope.control.methods import ApiError, ControlMethods
from gpuscope.documents import (
    DEFAULT_LIST_LIMIT,
    MAX_LIST_LIMIT,
    ListParameters,
    ParameterError,
    ProcessExposure,
    captures_document,
    encode_document,
    list_parameters,
    snapshot_document,
)
from gpuscope.generated.agent.v1 import agent_pb2, agent_pb2_grpc
from gpuscope.web.app import AgentApp

# -- the parameters ----------------------------------------------------------------------------------------


def test_absent_parameters_take_their_documented_defaults() -> None:
    assert list_parameters() == ListParameters(limit=DEFAULT_LIST_LIMIT, include_refused=False)
    assert DEFAULT_LIST_LIMIT == 100 and MAX_LIST_LIMIT == 1000
    assert list_parameters("1", "1") == ListParameters(1, True)
    assert list_parameters(MAX_LIST_LIMIT, False) == ListParameters(MAX_LIST_LIMIT, False)
    assert list_parameters(include_refused="true").include_refused
    assert not list_parameters(include_refused="0").include_refused


@pytest.mark.parametrize("limit", [0, -1, MAX_LIST_LIMIT + 1, 10**9, "0", "1001", "ten", "1e3", "-5", " 5",
                                   "", "\u0665", True, 2.0])
def test_a_limit_out_of_range_is_an_error_naming_the_range(limit: Any) -> None:
    with pytest.raises(ParameterError) as caught:
        list_parameters(limit=limit)
    assert str(caught.value).startswith(f"limit must be a whole number from 1 to {MAX_LIST_LIMIT} (absent: "
                                        f"{DEFAULT_LIST_LIMIT}), not ")


@pytest.mark.parametrize("flag", ["yes", "2", "", "TRUE", "x" * 100])
def test_a_bad_include_refused_names_what_it_allows(flag: str) -> None:
    with pytest.raises(ParameterError, match=r"^include_refused must be one of 0, 1, false, true, not '"):
        list_parameters(include_refused=flag)
    with pytest.raises(ParameterError) as caught:
        list_parameters(include_refused=flag)
    assert len(str(caught.value)) < 120  # a long value is quoted back cut short


# -- the builders ------------------------------------------------------------------------------------------


def _processes(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [process for gpu in document["gpus"] for process in gpu["processes"]]


def _parsed(document: dict[str, Any]) -> Any:
    return json.loads(encode_document(document))


def test_the_snapshot_document_applies_each_processes_setting() -> None:
    snapshot = make_full_snapshot()
    full = _parsed(snapshot.to_json())
    assert any(p["cmdline"] for p in _processes(full)) and any(p["user"] for p in _processes(full))

    shown = _parsed(snapshot_document(snapshot, ProcessExposure(export=True, cmdline=True, user=True)))
    assert shown == full  # everything opted in: the snapshot's own serialisation
    default = _parsed(snapshot_document(snapshot, ProcessExposure()))
    assert all(p["cmdline"] is None for p in _processes(default))
    assert [p["user"] for p in _processes(default)] == [p["user"] for p in _processes(full)]
    no_users = _parsed(snapshot_document(snapshot, ProcessExposure(user=False)))
    assert all(p["user"] is None for p in _processes(no_users))
    assert [p["pid"] for p in _processes(no_users)] == [p["pid"] for p in _processes(full)]
    hidden = _parsed(snapshot_document(snapshot, ProcessExposure(export=False, cmdline=True)))
    assert _processes(hidden) == []
    # Only the processes go: every other field is the snapshot's own.
    for gpu in full["gpus"]:
        gpu["processes"] = []
    assert hidden == full


# The stored capture's analysis, as the analysis worker keeps it: each finding's gain (or why there is
# none) and all the fixes' together travel with the record through both doors.
ANALYSIS = {"verdict": "input_bound", "headline": "input_bound: 25% waits", "traces": 1,
            "findings": [{"kind": "input_bound", "severity": "high", "share": 0.25, "per_step": None,
                          "summary": "25% waits", "evidence": "", "site": "", "trace": "t",
                          "gain": {"before_s": 0.072, "after_s": 0.0544, "share": 0.2444,
                                   "assumptions": ["the next batch is ready"]}},
                         {"kind": "costly_op", "severity": "moderate", "share": 0.1, "per_step": None,
                          "summary": "s", "evidence": "", "site": "", "trace": "t",
                          "gain": {"not_estimated": "no model"}}],
            "gain_together": {"before_s": 0.072, "after_s": 0.05, "share": 0.3056, "assumptions": []}}


def test_the_capture_listing_hides_pids_without_export(tmp_path: Path) -> None:
    refusals = RefusalLog()
    refusals.add(RefusedTrigger(at=1.0, trigger=Trigger("user", user="unix"), gpu=None, reason="duration",
                                message="too long", pid=4242))
    with CaptureStore(tmp_path / "captures", quota_bytes=1 << 24) as store:
        record = add_capture(store, gpu=0, trace=b"t")
        parameters = ListParameters(include_refused=True)
        shown = _parsed(captures_document(store, refusals, parameters, ProcessExposure(), downloads=True))
        hidden = _parsed(captures_document(store, refusals, parameters, ProcessExposure(export=False),
                                           downloads=True))
    (entry,) = shown["captures"]
    assert entry["pids"] == [4242] and entry["download"] == f"/api/v1/captures/{record.id}"
    assert shown["refused"][0]["pid"] == 4242
    assert "4242" not in json.dumps(hidden)
    assert hidden["captures"][0]["id"] == record.id and hidden["refused"][0]["reason"] == "duration"
    assert shown["enabled"] and shown["downloads"] and shown["refused_count"] == 1
    off = captures_document(None, None, parameters, ProcessExposure(), downloads=True)
    assert off == {"enabled": False, "downloads": False, "captures": [], "refused_count": 0, "refused": []}


def test_the_capture_listing_carries_each_records_analysis_with_its_gains(tmp_path: Path) -> None:
    with CaptureStore(tmp_path / "captures", quota_bytes=1 << 24) as store:
        analysed = store.annotate(add_capture(store, gpu=0, trace=b"t").id, ANALYSIS)
        add_capture(store, gpu=1, trace=b"t")  # not analysed yet
        listing = _parsed(captures_document(store, None, ListParameters(), ProcessExposure(export=False),
                                            downloads=False))
    assert {c["id"]: c["analysis"] for c in listing["captures"]}[analysed.id] == ANALYSIS
    assert sorted(c["analysis"] is None for c in listing["captures"]) == [False, True]


def test_a_value_json_cannot_carry_becomes_null() -> None:
    assert json.loads(encode_document({"a": [float("nan"), {"b": float("inf")}, 1.5]})) == {
        "a": [None, {"b": None}, 1.5]}


def test_before_the_first_tick_both_doors_say_why_in_the_same_words() -> None:
    methods = ControlMethods(service=None, store=None, snapshots=FakeSource(), alerts=None, hostname="node")
    with pytest.raises(ApiError) as caught:
        methods.snapshot_json()
    answered: list[str] = []
    app = AgentApp(CollectorRegistry(), FakeSource(), time.monotonic)
    body = b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": "/api/v1/snapshot"},
                        lambda status, headers: answered.append(status)))
    assert answered == ["503 Service Unavailable"] and caught.value.code == "UNAVAILABLE"
    assert json.loads(body) == {"error": caught.value.message}
    assert "first sampling tick" in caught.value.message


# -- both doors on a simulated node ------------------------------------------------------------------------

MAX_DURATION = "1s"  # a capture asked for longer is refused, with its pid: a refused trigger to list


@contextmanager
def simulated_node(export: bool, cmdline: bool, user: bool) -> Iterator[tuple[RunningAgent, ControlClient]]:
    """`gpuscope run --simulate demo` with these ``processes`` settings and one stored capture (of pid
    4242), and a control API client on its socket (a short path: a socket address holds 107 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="gs-doc-", dir="/tmp"))
    try:
        port = free_port()
        with CaptureStore(folder / f"captures-{port}", quota_bytes=1 << 24) as store:
            store.annotate(add_capture(store, gpu=0, trace=b"trace").id, ANALYSIS)
        env = {"GPUSCOPE_PROCESSES__EXPORT": str(export).lower(),
               "GPUSCOPE_PROCESSES__CMDLINE": str(cmdline).lower(),
               "GPUSCOPE_PROCESSES__USER": str(user).lower(),
               "GPUSCOPE_CAPTURE__DURATION": "500ms", "GPUSCOPE_CAPTURE__MAX_DURATION": MAX_DURATION}
        # A tick every 2 s: both doors are read between two ticks, most times at the first try.
        arguments = ("--simulate", "demo", "--sample-interval", "2s")
        with run_agent(folder, *arguments, env=env, port=port) as agent, \
                ControlClient(folder / f"control-{port}.sock") as client:
            agent.wait_for("/api/v1/snapshot", '"processes": [{' if export else '"gpus": [{')
            yield agent, client
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _http(agent: RunningAgent, path: str) -> dict[str, Any]:
    status, body = agent.get(path)
    assert status == 200, body
    document: dict[str, Any] = json.loads(body)
    return document


def _both_doors(agent: RunningAgent, client: ControlClient) -> list[tuple[str, Any, Any]]:
    """(name, HTTP's document, the control API's) for every document, all read within one tick."""
    for _attempt in range(10):
        before = _http(agent, "/api/v1/snapshot")
        pairs = [
            ("alerts", _http(agent, "/api/v1/alerts"), client.list_alerts()),
            ("captures", _http(agent, "/api/v1/captures"), client.capture_listing().document),
            ("captures, refused, limit 1", _http(agent, "/api/v1/captures?include_refused=1&limit=1"),
             client.capture_listing(1, include_refused=True).document),
            ("snapshot", _http(agent, "/api/v1/snapshot"), client.get_snapshot()),
        ]
        if pairs[-1][1]["timestamp"] == before["timestamp"]:  # no tick in between: the same state
            return pairs
    raise AssertionError("a sampling tick fell between the two doors' reads ten times running")


@pytest.mark.parametrize(("export", "cmdline", "user"), list(itertools.product([True, False], repeat=3)))
def test_both_doors_serve_the_same_documents(export: bool, cmdline: bool, user: bool) -> None:
    with simulated_node(export, cmdline, user) as (agent, client):
        refused = client.capture(pid=os.getpid(), duration_s=2)  # over capture.max_duration
        assert refused["outcome"] == "refused", refused
        pairs = _both_doors(agent, client)
    for name, by_http, by_control in pairs:
        assert by_control == by_http, name
    documents = {name: by_http for name, by_http, _ in pairs}
    processes = _processes(documents["snapshot"])
    assert bool(processes) == export  # the demo node runs processes; without export none is listed
    assert all((p["cmdline"] is not None) == cmdline for p in processes)
    assert all((p["user"] is not None) == user for p in processes if p["host_visible"])
    listing = documents["captures, refused, limit 1"]
    (stored,) = listing["captures"]
    (refusal,) = listing["refused"]
    assert refusal["reason"] == "duration" and listing["refused_count"] == 1
    assert ("pids" in stored, "pid" in refusal) == (export, export)
    assert (str(os.getpid()) in json.dumps(listing)) == export
    assert listing["enabled"] and not listing["downloads"]  # no web configuration: no downloads over HTTP
    assert stored["analysis"] == ANALYSIS  # the gains as the record keeps them


def test_a_bad_limit_is_refused_alike_at_both_doors() -> None:
    with simulated_node(export=True, cmdline=False, user=True) as (agent, client):
        for limit in (MAX_LIST_LIMIT + 1, 10**6):
            status, body = agent.get(f"/api/v1/captures?limit={limit}")
            channel = grpc.insecure_channel(f"unix:{client.where}")
            with channel, pytest.raises(grpc.RpcError) as caught:
                agent_pb2_grpc.AgentStub(channel).ListCaptures(agent_pb2.ListCapturesRequest(limit=limit),
                                                               timeout=10)
            assert status == 400 and caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            message = json.loads(body)["error"]
            assert message == caught.value.details()
            assert message == (f"limit must be a whole number from 1 to {MAX_LIST_LIMIT} (absent: "
                               f"{DEFAULT_LIST_LIMIT}), not '{limit}'")
        # The largest limit is no error at either door; an absent one is the default at both.
        assert _http(agent, f"/api/v1/captures?limit={MAX_LIST_LIMIT}")["enabled"]
        assert client.capture_listing(MAX_LIST_LIMIT).enabled
        assert len(_http(agent, "/api/v1/captures")["captures"]) == len(client.list_captures()) == 1
    # Text that is no number at all (HTTP's query) gets the same sentence.
    with pytest.raises(ParameterError, match=f"^limit must be a whole number from 1 to {MAX_LIST_LIMIT} "):
        list_parameters(limit="ten")
