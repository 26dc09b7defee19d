"""Property-based tests of the Kineto on-demand wire protocol (gpuscope.capture.kineto.protocol) and of the
daemon's handling of one received datagram (KinetoDaemon._handle, the code its receiving thread runs
for every datagram on the Unix socket; the daemon is not started, replies go to a recording socket).

Fuzzed: arbitrary bytes, receive flags and ancillary data; well-formed ``req`` and ``ctxt`` messages
as PyTorch sends them, then truncated, extended, with a header size that lies, a pid count that
lies, non-positive pids or GPUs out of range, and byte flips; sender addresses (abstract client
names, other abstract names, paths, none); sequences of datagrams from many senders.

Asserted: a parser returns exactly the fields that were encoded, or raises MalformedDatagram (nothing
else); the daemon never raises out of a datagram, counts it as a request, a context or malformed,
replies only to Kineto client sockets, and never registers more processes than ``max_clients`` or a
pid that is not positive.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from gpuscope.capture.kineto.daemon import KinetoDaemon
from gpuscope.capture.kineto.protocol import (
    CLIENT_PREFIX,
    CONTEXT,
    HEADER,
    MAX_GPUS,
    MAX_PIDS,
    REQUEST,
    TYPE_CONTEXT,
    TYPE_REQUEST,
    UCRED,
    ContextMessage,
    MalformedDatagram,
    encode_message,
    parse_context,
    parse_request,
    sender_credentials,
    split_message,
)

FUZZ = settings(max_examples=200)  # and tests/conftest.py\'s profile

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
FLAGS = st.sampled_from([0, 0, 0, socket.MSG_TRUNC, socket.MSG_CTRUNC, socket.MSG_TRUNC | socket.MSG_CTRUNC,
                         socket.MSG_EOR])


def request_body(config_type: int, job_id: int, pids: list[int]) -> bytes:
    return REQUEST.pack(config_type, len(pids), job_id) + struct.pack(f"={len(pids)}i", *pids)


REQUESTS = st.builds(request_body, INT32, INT64, st.lists(st.integers(1, 2**31 - 1), min_size=1, max_size=8))
CONTEXTS = st.builds(CONTEXT.pack, st.integers(0, MAX_GPUS - 1), st.integers(1, 2**31 - 1), INT64)
MESSAGES = st.one_of(
    st.builds(encode_message, st.just(TYPE_REQUEST), REQUESTS),
    st.builds(encode_message, st.just(TYPE_CONTEXT), CONTEXTS),
    st.builds(encode_message, st.sampled_from([b"", b"req\0junk", b"ctx", b"REQ", b"x" * 32, b"\0req"]),
              st.binary(max_size=40)),
)


@st.composite
def mutated(draw: st.DrawFn, messages: st.SearchStrategy[bytes]) -> bytes:
    """A well-formed message, then broken in one or two ways."""
    data = bytearray(draw(messages))
    for _ in range(draw(st.integers(1, 2))):
        how = draw(st.sampled_from(["truncate", "extend", "flip", "size", "count", "pid"]))
        if how == "truncate":
            del data[draw(st.integers(0, len(data))):]
        elif how == "extend":
            data += draw(st.binary(min_size=1, max_size=12))
        elif how == "flip" and data:
            at = draw(st.integers(0, len(data) - 1))
            data[at] ^= draw(st.integers(1, 255))
        elif how == "size" and len(data) >= 8:
            size = draw(st.sampled_from([0, 1, 2**64 - 1, len(data), len(data) - 41])) % 2**64
            struct.pack_into("=Q", data, 0, size)
        elif how == "count" and len(data) >= HEADER.size + 8:
            count = draw(st.sampled_from([0, -1, MAX_PIDS, MAX_PIDS + 1, 2**31 - 1]))
            struct.pack_into("=i", data, HEADER.size + 4, count)
        elif how == "pid" and len(data) >= HEADER.size + REQUEST.size + 4:
            struct.pack_into("=i", data, HEADER.size + REQUEST.size, draw(st.sampled_from([0, -1, -(2**31)])))
    return bytes(data)


DATAGRAMS = st.one_of(MESSAGES, mutated(MESSAGES), st.binary(max_size=80),
                      st.binary(min_size=HEADER.size + REQUEST.size + 4 * MAX_PIDS,
                                max_size=HEADER.size + REQUEST.size + 4 * MAX_PIDS + 2))


def parse_datagram(data: bytes, flags: int = 0) -> tuple[bytes, Any]:
    """(message type, parsed body) as the daemon reads them; MalformedDatagram otherwise."""
    kind, body = split_message(data, flags)
    if kind == TYPE_REQUEST:
        return kind, parse_request(body)
    if kind == TYPE_CONTEXT:
        return kind, parse_context(body)
    return kind, body


# -- the protocol ----------------------------------------------------------------------------------------


@FUZZ
@given(config_type=INT32, job_id=INT64,
       pids=st.lists(st.integers(1, 2**31 - 1), min_size=1, max_size=MAX_PIDS))
def test_a_request_reads_back_as_encoded(config_type: int, job_id: int, pids: list[int]) -> None:
    kind, request = parse_datagram(encode_message(TYPE_REQUEST, request_body(config_type, job_id, pids)))
    assert kind == TYPE_REQUEST
    assert (request.config_type, request.job_id, request.pids) == (config_type, job_id, tuple(pids))


@FUZZ
@given(gpu=st.integers(0, MAX_GPUS - 1), pid=st.integers(1, 2**31 - 1), job_id=INT64)
def test_a_context_message_reads_back_as_encoded(gpu: int, pid: int, job_id: int) -> None:
    assert parse_datagram(encode_message(TYPE_CONTEXT, CONTEXT.pack(gpu, pid, job_id))) == (
        TYPE_CONTEXT, ContextMessage(gpu, pid, job_id))


@FUZZ
@given(data=DATAGRAMS, flags=FLAGS)
@example(data=encode_message(TYPE_REQUEST, REQUEST.pack(3, MAX_PIDS + 1, 0)), flags=0)
@example(data=encode_message(TYPE_REQUEST, REQUEST.pack(3, -1, 0) + b"\0" * 8), flags=0)
@example(data=b"\xff" * 8 + b"req".ljust(32, b"\0"), flags=0)  # a header size of 2**64 - 1
def test_any_datagram_parses_or_is_malformed(data: bytes, flags: int) -> None:
    try:
        kind, parsed = parse_datagram(data, flags)
    except MalformedDatagram as err:
        assert str(err)
        return
    assert not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC)
    size, _ = HEADER.unpack_from(data)
    assert size == len(data) - HEADER.size
    if kind == TYPE_REQUEST:
        assert 0 < len(parsed.pids) <= MAX_PIDS and all(p > 0 for p in parsed.pids)
        assert size == REQUEST.size + 4 * len(parsed.pids)
    elif kind == TYPE_CONTEXT:
        assert parsed.pid > 0 and 0 <= parsed.gpu < MAX_GPUS and size == CONTEXT.size


ANCDATA = st.lists(st.tuples(
    st.sampled_from([socket.SOL_SOCKET, 0, 41]),
    st.sampled_from([socket.SCM_CREDENTIALS, socket.SCM_RIGHTS, 99]),
    st.one_of(st.builds(UCRED.pack, INT32, st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
              st.binary(max_size=16))), max_size=3)


@FUZZ
@given(ancdata=ANCDATA)
def test_credentials_are_the_kernels_or_none(ancdata: list[tuple[int, int, bytes]]) -> None:
    credentials = sender_credentials(ancdata)
    usable = [d for level, kind, d in ancdata if (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS)
              and len(d) >= UCRED.size]
    assert credentials == (UCRED.unpack_from(usable[0]) if usable else None)


# -- the daemon, one datagram at a time --------------------------------------------------------------------


class RecordingSocket:
    """What the daemon replies through: records (message, address); some addresses refuse."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []

    def sendto(self, message: bytes, flags: int, address: Any) -> int:
        if isinstance(address, bytes) and address.endswith(b"gone"):
            raise ConnectionRefusedError("the client's socket is gone")
        self.sent.append((message, address))
        return len(message)


CLIENT = b"\0" + CLIENT_PREFIX.encode()
ADDRESSES = st.one_of(
    st.builds(lambda tail: CLIENT + tail, st.sampled_from([b"4f1c", b"", b"gone", b"x" * 120])),
    st.sampled_from([b"\0dynolog\0", b"\0other", b"", None, "/tmp/dynoconfigclient1", "", "relative"]),
    st.binary(max_size=20), st.text(max_size=20).map(lambda t: "/" + t.replace("\0", "")),
)


@FUZZ
@given(datagrams=st.lists(st.tuples(DATAGRAMS, ANCDATA, FLAGS, ADDRESSES), min_size=1, max_size=12),
       max_clients=st.integers(1, 4))
def test_the_daemon_survives_any_datagrams_and_replies_only_to_clients(
        datagrams: list[tuple[bytes, list[tuple[int, int, bytes]], int, Any]], max_clients: int) -> None:
    now = [100.0]
    daemon = KinetoDaemon(socket_name="gpuscope-fuzz", trace_dir="/nonexistent/gpuscope-fuzz",
                          clock=lambda: now[0], max_clients=max_clients)
    sock = RecordingSocket()
    for data, ancdata, flags, address in datagrams:
        before = daemon.stats()
        daemon._handle(sock, data, ancdata, flags, address)  # type: ignore[arg-type]
        after = daemon.stats()
        counted = [after[name] - before[name] for name in ("malformed", "requests", "contexts")]
        assert sorted(counted) == [0, 0, 1], (before, after)  # one of them, once
        event(("malformed", "request", "context")[counted.index(1)])
        now[0] += 1.0
    for message, address in sock.sent:
        assert isinstance(address, bytes) and address.startswith(CLIENT) and len(address) <= 108
        kind, _ = split_message(message, 0)
        assert kind in (TYPE_REQUEST, TYPE_CONTEXT)
    registered = daemon.registered()
    assert len(registered) <= max_clients and all(pid > 0 for pid in registered)
