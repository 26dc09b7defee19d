"""Property-based tests of the control API's request handling (gpuscope.control.server's servicer, called
directly with a recording context, no sockets) and of every path a request or a reply carries.

Fuzzed: CaptureRequest messages with any selector and field values (and arbitrary bytes decoded as
one, as gRPC would), ListCaptures limits, GetCapture ids (well-formed, mutated, and hostile: ``..``,
separators, NUL, non-ASCII), bearer-token metadata, token files of any bytes; the file paths an agent
sends to the CLI (FileChunk streams with any paths, offsets and order) and the names a backend gives
the files of a capture.

Asserted: a request is refused with INVALID_ARGUMENT and the reason, or reaches the capture service
as a request it can record (a GPU index a capture id can hold, a duration within the maximum, a
finite start at most 60 s ahead); no id names anything but a direct entry of the store (else
INVALID_ARGUMENT, or NOT_FOUND); a token matches only the exact token; no path sent by an agent or
named by a backend leaves its directory, and a refused download leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from snapshots import FakeSource

from gpuscope.capture.config import MAX_DURATION_SECONDS
from gpuscope.capture.model import CaptureRecord, Trigger
from gpuscope.capture.records import CaptureIdError, check_capture_id, record_from_json
from gpuscope.capture.service import CaptureRequest, CaptureService
from gpuscope.capture.store import CaptureStore, CaptureStoreError, new_capture_id
from gpuscope.common.unixfs import safe_file_name
from gpuscope.control.auth import MIN_TOKEN_CHARS, bearer_matches, read_token
from gpuscope.control.client import safe_relative_path, write_chunks
from gpuscope.control.errors import ControlError
from gpuscope.control.methods import MAX_REASON_CHARS, MAX_START_DELAY_S, ControlMethods
from gpuscope.control.server import _Servicer
from gpuscope.documents import MAX_LIST_LIMIT
from gpuscope.generated.agent.v1 import agent_pb2

FUZZ = settings(max_examples=150)  # and tests/conftest.py\'s profile
NOW = 1_717_171_717.0
INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
TEXT = st.text(st.characters(codec="utf-8"), max_size=40)  # what a proto string can hold


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details


class Context:
    """The servicer's view of a call: abort raises, as grpc's does."""

    def abort(self, code: grpc.StatusCode, details: str) -> Any:
        raise Aborted(code, details)

    def time_remaining(self) -> float | None:
        return 5.0

    def is_active(self) -> bool:
        return True


class RecordingService:
    """A capture service that records each request and refuses it, as the real one's records are made."""

    def __init__(self) -> None:
        self.requests: list[CaptureRequest] = []

    def submit(self, request: CaptureRequest) -> Future[CaptureRecord]:
        self.requests.append(request)
        future: Future[CaptureRecord] = Future()
        future.set_result(CaptureRecord(
            id=new_capture_id(NOW, gpu=request.gpu, pid=request.pid, token="c0ffee"), trigger=request.trigger,
            gpu=request.gpu, pids=(request.pid,) if request.pid else (), targets=(), start=NOW,
            duration_s=request.duration_s or 0.0, bytes=0, outcome="refused", error="fuzz"))
        return future


def servicer(*, service: Any = None, store: CaptureStore | None = None) -> _Servicer:
    methods = ControlMethods(service=cast(CaptureService, service), store=store, snapshots=FakeSource(),
                             alerts=None, hostname="node", wall_clock=lambda: NOW)
    return _Servicer(methods, user="unix")


# -- Capture ---------------------------------------------------------------------------------------------

TARGETS = st.one_of(TEXT, st.sampled_from([
    "10.0.0.7:6009", "[fd00::7]:6009", "grpc://host:6009", "unix:/x", "dns:///h:1", "host:0", "host:65536",
    ":6009", "host", " host:1 ", "[::1]", "a" * 300 + ":1"]))


@st.composite
def capture_requests(draw: st.DrawFn) -> agent_pb2.CaptureRequest:
    fields: dict[str, Any] = {}
    selector = draw(st.sampled_from(["gpu", "pid", "target", None]))
    if selector == "gpu":
        fields["gpu"] = draw(st.one_of(st.integers(0, 16), st.sampled_from([9999, 10_000]), INT32))
    elif selector == "pid":
        fields["pid"] = draw(st.one_of(st.integers(1, 2**22), INT32))
    elif selector == "target":
        fields["target"] = draw(TARGETS)
    fields["duration_ms"] = draw(st.one_of(st.integers(0, 40_000), UINT32))
    if draw(st.booleans()):
        fields["reason"] = draw(st.one_of(
            TEXT, st.text(min_size=MAX_REASON_CHARS - 1, max_size=MAX_REASON_CHARS + 1)))
    if draw(st.booleans()):
        fields["start_at"] = draw(st.one_of(
            st.floats(), st.floats(NOW - 100, NOW + 100),
            st.sampled_from([NOW + MAX_START_DELAY_S, NOW + MAX_START_DELAY_S + 0.01])))
    return agent_pb2.CaptureRequest(**fields)


def check_capture(request: agent_pb2.CaptureRequest, with_service: bool) -> None:
    service = RecordingService()
    try:
        reply = servicer(service=service if with_service else None).Capture(request, cast(Any, Context()))
    except Aborted as aborted:
        assert aborted.code == grpc.StatusCode.INVALID_ARGUMENT and aborted.details, aborted
        event("refused: " + aborted.details.split(" ", 1)[0])
        assert service.requests == []
        return
    record = record_from_json(json.loads(reply.record_json))
    assert reply.id == record.id == check_capture_id(record.id)
    assert reply.outcome == agent_pb2.OUTCOME_REFUSED
    selector = request.WhichOneof("selector")
    event(f"accepted: {selector}")
    if with_service:
        (passed,) = service.requests
        assert passed.gpu == (request.gpu if selector == "gpu" else None)
        assert passed.pid == (request.pid if selector == "pid" else None)
        assert passed.target == (request.target.strip() if selector == "target" else None)
        assert passed.duration_s is None or 0 < passed.duration_s <= MAX_DURATION_SECONDS
        assert passed.start_at is None or (math.isfinite(passed.start_at)
                                           and passed.start_at - NOW <= MAX_START_DELAY_S)
        assert passed.trigger.kind == ("fleet" if request.HasField("start_at") else "user")
    assert record.gpu is None or 0 <= record.gpu <= 9999
    assert selector is not None
    assert not request.HasField("reason") or len(request.reason) <= MAX_REASON_CHARS


@FUZZ
@given(request=capture_requests(), with_service=st.booleans())
# 10000: no capture id held it, and even the record of the refusal ended in a traceback.
@example(request=agent_pb2.CaptureRequest(gpu=10_000), with_service=False)
@example(request=agent_pb2.CaptureRequest(gpu=2**31 - 1), with_service=True)
@example(request=agent_pb2.CaptureRequest(pid=1, start_at=math.nan), with_service=True)
@example(request=agent_pb2.CaptureRequest(pid=1, start_at=-1e308), with_service=True)
def test_a_capture_request_is_refused_with_its_reason_or_served(request: agent_pb2.CaptureRequest,
                                                                with_service: bool) -> None:
    check_capture(request, with_service)


SERIALIZED = capture_requests().map(lambda r: r.SerializeToString())


@FUZZ
@given(data=st.one_of(
    st.binary(max_size=60),
    st.lists(SERIALIZED, min_size=1, max_size=3).map(b"".join),  # merged as gRPC would: the last field wins
    SERIALIZED.flatmap(lambda b: st.builds(lambda cut, junk: b[:cut] + junk, st.integers(0, len(b)),
                                           st.binary(max_size=6)))))
def test_any_request_bytes_decode_or_are_refused_before_the_method(data: bytes) -> None:
    try:
        request = agent_pb2.CaptureRequest.FromString(data)
    except DecodeError:
        return  # gRPC answers this itself; the method never runs
    check_capture(request, with_service=True)


# -- the capture store's paths ------------------------------------------------------------------------


@contextlib.contextmanager
def store_with_one_capture() -> Iterator[tuple[CaptureStore, str]]:
    with tempfile.TemporaryDirectory(prefix="gs-fuzz-") as directory, \
            CaptureStore(Path(directory) / "captures", quota_bytes=1 << 20, clock=lambda: NOW) as store:
        staging = store.begin(gpu=0)
        with staging.new_file("node-1", ".xplane.pb", folders=("plugins", "profile", staging.run)) as new:
            new.file.write(b"x" * 100)
            relative = new.publish()
        store.commit(staging, CaptureRecord(
            id=staging.id, trigger=Trigger("user", user="unix"), gpu=0, pids=(), targets=(), start=NOW,
            duration_s=1.0, bytes=0, outcome="captured", files=(relative,)))
        # Something next to the store that an escaping id would reach.
        (Path(directory) / "secret").mkdir()
        (Path(directory) / "secret" / "capture.json").write_text("{}")
        yield store, staging.id


@pytest.fixture(scope="module")
def one_capture() -> Iterator[tuple[CaptureStore, str]]:
    with store_with_one_capture() as found:
        yield found


@st.composite
def capture_ids(draw: st.DrawFn, real: str) -> str:
    well_formed = st.builds(lambda t, who, token: new_capture_id(t, gpu=who[0], pid=who[1], token=token),
                            st.floats(0, 4e9),
                            st.sampled_from([(0, None), (None, 4242), (None, None), (9999, None)]),
                            st.from_regex(r"\A[0-9a-f]{6}\Z"))
    base = draw(st.one_of(st.just(real), well_formed))
    edit = draw(st.sampled_from(["none", "insert", "replace", "prefix", "suffix", "any"]))
    junk = draw(st.sampled_from(["/", "..", "\\", "\x00", ".", "../secret", "\n", "\xe9", "\uff10", "\u202e",
                                 "%2f"]) | st.text(max_size=3))
    at = draw(st.integers(0, len(base)))
    return {"none": base, "insert": base[:at] + junk + base[at:], "replace": base[:at] + junk + base[at + 1:],
            "prefix": junk + base, "suffix": base + junk,
            "any": draw(st.one_of(TEXT, st.sampled_from(["", "..", ".", "/", "secret", "../secret",
                                                          ".staging", ".trash", ".lock"])))}[edit]


def test_the_store_under_test_has_its_capture(one_capture: tuple[CaptureStore, str]) -> None:
    store, real = one_capture
    chunks = list(servicer(store=store).GetCapture(agent_pb2.GetCaptureRequest(id=real),
                                                   cast(Any, Context())))
    assert {c.path for c in chunks} >= {"capture.json"} and len(chunks) == 2


@FUZZ
@given(data=st.data())
def test_a_capture_id_names_a_capture_of_the_store_or_is_refused(one_capture: tuple[CaptureStore, str],
                                                                 data: st.DataObject) -> None:
    store, real = one_capture
    capture_id = data.draw(capture_ids(real))
    try:
        chunks = list(servicer(store=store).GetCapture(agent_pb2.GetCaptureRequest(id=capture_id),
                                                       cast(Any, Context())))
    except Aborted as aborted:
        event(aborted.code.name)
        if aborted.code == grpc.StatusCode.INVALID_ARGUMENT:
            with pytest.raises(CaptureIdError):
                check_capture_id(capture_id)
        else:
            assert aborted.code == grpc.StatusCode.NOT_FOUND and capture_id != real
            check_capture_id(capture_id)
        return
    assert capture_id == real and chunks
    # A well-formed id is one plain name: the store's root is its directory's parent.
    assert (store.root / capture_id).resolve().parent == store.root


@FUZZ
@given(value=st.one_of(TEXT, st.text(st.sampled_from("0123456789TZgpuidnoe-abcdef./\\\x00"), max_size=40)))
@example(value="20240531T160837Z-gpu0-c0ffee")
@example(value="20240531T160837Z-gpu0-c0ffee/..")
def test_an_accepted_capture_id_is_one_plain_file_name(value: str) -> None:
    try:
        checked = check_capture_id(value)
    except CaptureIdError as err:
        assert str(err)
        return
    root = Path("/srv/captures")
    assert checked == value and (root / value).parent == root
    assert os.path.normpath(root / value) == str(root / value)
    assert value.isascii() and value.isprintable() and not value.startswith(".")


@FUZZ
@given(limit=UINT32)
@example(limit=0)
@example(limit=MAX_LIST_LIMIT)
@example(limit=MAX_LIST_LIMIT + 1)
def test_list_captures_answers_at_most_the_limit(one_capture: tuple[CaptureStore, str], limit: int) -> None:
    """0 is proto3's absent value (the default); above the most, INVALID_ARGUMENT naming the range."""
    store, real = one_capture
    try:
        reply = servicer(store=store).ListCaptures(agent_pb2.ListCapturesRequest(limit=limit),
                                                   cast(Any, Context()))
    except Aborted as aborted:
        assert limit > MAX_LIST_LIMIT and aborted.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"limit must be a whole number from 1 to {MAX_LIST_LIMIT}" in aborted.details
        return
    assert limit <= MAX_LIST_LIMIT
    assert [c.id for c in reply.captures] == [real][:limit or 100]


PLAIN_NAMES = st.from_regex(r"\A[A-Za-z0-9_][A-Za-z0-9._-]{0,20}\Z")
NAMES = st.one_of(PLAIN_NAMES, PLAIN_NAMES, TEXT, st.sampled_from([
    "..", ".", "", "/", "../../etc", "a/b", "\x00", ".hidden", "-n", "\xe9" * 200, "node-1.example"]))


@FUZZ
@given(stem=NAMES, suffix=st.sampled_from([".xplane.pb", ".pt.trace.json.gz", "", "/x", "/../y", ".."]),
       folders=st.one_of(st.lists(PLAIN_NAMES, max_size=3), st.lists(NAMES, max_size=3)))
def test_a_backend_file_name_stays_in_its_capture(stem: str, suffix: str, folders: list[str]) -> None:
    assert safe_file_name(stem) not in ("", ".", "..") and "/" not in safe_file_name(stem)
    with tempfile.TemporaryDirectory(prefix="gs-fuzz-") as directory, \
            CaptureStore(Path(directory) / "captures", quota_bytes=1 << 20, clock=lambda: NOW) as store:
        staging = store.begin(gpu=0)
        try:
            new = staging.new_file(stem, suffix, folders=tuple(folders))
        except CaptureStoreError:
            event("refused")
            return
        with new:
            new.file.write(b"x")
            relative = new.publish()
        event("written")
        assert (staging.path / relative).resolve().is_relative_to(staging.path)
        safe_relative_path(relative)  # what a client accepts: the agent never sends it anything else


# -- the CLI's side: paths an agent sends -----------------------------------------------------------------

PATHS = st.one_of(
    st.lists(st.sampled_from(["plugins", "profile", "run", "a.pb", "capture.json", "..", ".", "", "x" * 256,
                              "\xe9"]), min_size=1, max_size=4).map("/".join),
    st.sampled_from(["/etc/passwd", "a\\b", "a\x00b", "a//b", "./a", "a/", "\n", "a" * 1025,
                     "/".join(["d"] * 18)]),
    TEXT,
)


@FUZZ
@given(value=PATHS)
def test_a_path_from_the_agent_is_plain_or_refused(value: str) -> None:
    try:
        parts = safe_relative_path(value)
    except ControlError as err:
        assert "refusing" in str(err)
        return
    out = Path("/out")
    assert "/".join(parts) == value and all(p not in ("", ".", "..") for p in parts)
    assert os.path.normpath(out.joinpath(*parts)) == str(out.joinpath(*parts))


PLAIN_PATHS = st.lists(PLAIN_NAMES.filter(lambda n: n not in (".", "..")), min_size=1,
                       max_size=3).map("/".join)


def stream(files: list[tuple[str, list[bytes]]]) -> list[agent_pb2.FileChunk]:
    """The chunks an agent sends for ``files`` (path, pieces): in order, offsets counted, last marked."""
    chunks = []
    for path, pieces in files:
        offset = 0
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            chunks.append(agent_pb2.FileChunk(path=path, offset=offset, data=piece, last=last))
            offset += len(piece)
    return chunks


@st.composite
def broken(draw: st.DrawFn, chunks: list[agent_pb2.FileChunk]) -> list[agent_pb2.FileChunk]:
    """``chunks`` with one chunk's path, offset or last flag changed, one dropped, or two swapped."""
    if not chunks:
        return chunks
    chunks = [agent_pb2.FileChunk(path=c.path, offset=c.offset, data=c.data, last=c.last) for c in chunks]
    at = draw(st.integers(0, len(chunks) - 1))
    how = draw(st.sampled_from(["path", "offset", "last", "drop", "swap"]))
    if how == "path":
        chunks[at].path = draw(PATHS)
    elif how == "offset":
        chunks[at].offset = draw(st.sampled_from([1, 2**63, 2**64 - 1]))
    elif how == "last":
        chunks[at].last = not chunks[at].last
    elif how == "drop":
        del chunks[at]
    else:
        other = draw(st.integers(0, len(chunks) - 1))
        chunks[at], chunks[other] = chunks[other], chunks[at]
    return chunks


STREAMS = st.lists(st.tuples(st.one_of(PLAIN_PATHS, PLAIN_PATHS, PATHS),
                             st.lists(st.binary(max_size=4), min_size=1, max_size=3)),
                   max_size=4, unique_by=lambda f: f[0]).map(stream)
ANY_CHUNKS = st.lists(st.builds(agent_pb2.FileChunk, path=PATHS, offset=st.sampled_from([0, 0, 1, 3, 2**63]),
                                data=st.binary(max_size=4), last=st.booleans()), max_size=6)
CHUNKS = st.one_of(STREAMS, STREAMS.flatmap(broken), ANY_CHUNKS)


@FUZZ
@given(chunks=CHUNKS)
@example(chunks=[agent_pb2.FileChunk(path="a", data=b"x", last=True),
                 agent_pb2.FileChunk(path="a/b", data=b"y", last=True)])
@example(chunks=[agent_pb2.FileChunk(path="plugins/a.pb", data=b"xy", last=False),
                 agent_pb2.FileChunk(path="plugins/a.pb", offset=2, data=b"z", last=True)])
def test_a_download_writes_inside_its_directory_or_nothing(chunks: list[agent_pb2.FileChunk]) -> None:
    with tempfile.TemporaryDirectory(prefix="gs-fuzz-") as directory:
        out = Path(directory) / "out"
        try:
            written = write_chunks(iter(chunks), out)
        except ControlError as err:
            event("refused")
            assert str(err)
            assert os.listdir(directory) == [], "a refused download leaves nothing behind, not even out/"
            return
        event("written")
        assert sorted(os.listdir(directory)) == ["out"]
        files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
        assert files == sorted(written)
        for name in written:
            assert (out / name).read_bytes() == b"".join(c.data for c in chunks if c.path == name)


# -- credentials --------------------------------------------------------------------------------------------

TOKEN = "s3cret-token-0123456789abcdef"


@FUZZ
@given(metadata=st.lists(st.tuples(
    st.sampled_from(["authorization", "Authorization", "x-other", "authorization-bin"]),
    st.one_of(st.sampled_from([f"Bearer {TOKEN}", f"bearer {TOKEN}", f"  Bearer   {TOKEN} ",
                               f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN} x", f"Basic {TOKEN}", "Bearer", TOKEN,
                               ""]),
              st.text(max_size=30), st.binary(max_size=30))), max_size=3))
def test_a_bearer_token_matches_only_itself(metadata: list[tuple[str, str | bytes]]) -> None:
    first = next((value for key, value in metadata if key == "authorization"), None)
    text = first.decode("latin-1") if isinstance(first, bytes) else first
    scheme, _, credentials = (text or "").strip().partition(" ")
    expected = scheme.lower() == "bearer" and credentials.strip() == TOKEN
    assert bearer_matches(metadata, TOKEN.encode()) == expected


@FUZZ
@given(data=st.one_of(st.binary(max_size=64), st.text(max_size=40).map(lambda t: t.encode()),
                      st.sampled_from([TOKEN.encode(), b"  " + TOKEN.encode() + b"\n", b"short\n", b"a b" * 8,
                                       b"\xff" * 20, b"x" * 5000, b""])),
       agent_side=st.booleans())
def test_a_token_file_holds_a_token_or_is_refused(data: bytes, agent_side: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="gs-fuzz-") as directory:
        path = Path(directory) / "token"
        path.write_bytes(data)
        os.chmod(path, 0o600)
        try:
            token = read_token(path, agent_side=agent_side)
        except ControlError as err:
            secret = data.strip().decode("latin-1")
            assert err.usage and str(err)
            assert len(secret) < 8 or secret not in str(err), "the token is never shown"
            return
    assert token == data.decode("ascii").strip()
    assert token.isprintable() and not any(c.isspace() for c in token)
    assert not agent_side or len(token) >= MIN_TOKEN_CHARS
