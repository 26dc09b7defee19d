"""Bearer tokens of the control API: the agent's token file and a client's (gpuscope.control.auth)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from gpuscope.control.auth import MAX_TOKEN_BYTES, bearer_matches, read_token
from gpuscope.control.errors import ControlError

TOKEN = "0123456789abcdef0123"


def test_the_agents_token_file_must_be_a_long_enough_regular_file(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    path.chmod(0o600)
    assert read_token(path, agent_side=True) == TOKEN
    path.write_text("short")
    with pytest.raises(ControlError, match="shorter than 16 characters"):
        read_token(path, agent_side=True)
    assert read_token(path) == "short"  # a client sends what its file holds
    path.write_text(TOKEN)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="gpuscope.control.auth"):
        read_token(path)
        assert caplog.records == []  # the client says nothing about its own file's mode
        read_token(path, agent_side=True)
    assert "readable by every user" in caplog.text


@pytest.mark.parametrize(("content", "message"), [
    (b"", "empty or holds spaces"), (b"two words", "empty or holds spaces"),
    ("t\u00f6ken-0123456789abcdef".encode(), "does not hold an ASCII token"),
    (b"x" * (MAX_TOKEN_BYTES + 1), f"larger than {MAX_TOKEN_BYTES} bytes"),
])
def test_what_is_not_a_token_is_named_never_shown(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "token"
    path.write_bytes(content)
    with pytest.raises(ControlError, match=message) as caught:
        read_token(path, what="token file")
    assert caught.value.usage and (not content or content.decode(errors="replace") not in str(caught.value))
    assert str(caught.value).count(str(path)) == 1


def test_a_client_reads_its_token_from_a_pipe_the_agent_does_not(tmp_path: Path) -> None:
    """`gpuscope capture --token-file <(vault read ...)`: a pipe, not a file."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "w") as pipe:
            pipe.write(TOKEN + "\n")

    writer = threading.Thread(target=write)
    writer.start()
    assert read_token(fifo) == TOKEN
    writer.join(timeout=5)
    with pytest.raises(ControlError, match="not a regular file"):
        read_token(fifo, agent_side=True)  # never blocks the agent on a pipe


def test_bearer_matches_in_constant_time_and_only_the_bearer_scheme() -> None:
    token = TOKEN.encode()
    assert bearer_matches([("authorization", f"Bearer {TOKEN}")], token)
    assert bearer_matches([("authorization", f"bearer {TOKEN}")], token)
    assert not bearer_matches([("authorization", f"Basic {TOKEN}")], token)
    assert not bearer_matches([("authorization", "Bearer wrong")], token)
    assert not bearer_matches([], token) and not bearer_matches(None, token)
