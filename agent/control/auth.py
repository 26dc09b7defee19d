"""Bearer tokens of the control API over TCP: reading the token file, and checking a call's metadata in
constant time (interceptor.py refuses a call with it before its method runs)."""

from __future__ import annotations

import hmac
import logging
import stat
from pathlib import Path
from typing import Any

from gpuscope.common.unixfs import FileTooLargeError, read_bounded
from gpuscope.control.errors import ControlError

log = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16  # what the agent accepts; a client sends whatever its file holds
MAX_TOKEN_BYTES = 4096


def read_token(path: Path, *, what: str = "token file", agent_side: bool = False) -> str:
    """The bearer token in ``path``, surrounding whitespace dropped. ControlError (``usage``) when it
    cannot be read or is not a token; the token itself never appears in a message. The agent's own
    (``agent_side``) must be a regular file, at least MIN_TOKEN_CHARS long, and it warns when every
    user may read it; a client may read its token from a pipe (``--token-file <(vault read ...)``)."""
    try:
        raw = read_bounded(path, MAX_TOKEN_BYTES, follow_symlinks=True,  # e.g. a Kubernetes Secret
                           regular_only=agent_side)
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileTooLargeError:
        raise ControlError(f"the {what} {path} is larger than {MAX_TOKEN_BYTES} bytes", usage=True) from None
    except OSError as err:
        raise ControlError(f"cannot read the {what} {path}: {err.strerror or err}", usage=True) from None
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ControlError(f"the {what} {path} does not hold an ASCII token", usage=True) from None
    if not token or any(not c.isprintable() or c.isspace() for c in token):
        raise ControlError(f"the {what} {path} is empty or holds spaces or control characters", usage=True)
    if agent_side:
        if len(token) < MIN_TOKEN_CHARS:
            raise ControlError(f"the token in the {what} {path} is shorter than {MIN_TOKEN_CHARS} "
                               "characters; use a random one, e.g. `openssl rand -hex 32`", usage=True)
        if mode & 0o004:
            log.warning("the %s %s is readable by every user; make it 0600 or 0640", what, path)
    return token


def bearer_matches(metadata: Any, token: bytes) -> bool:
    """Whether call metadata holds ``authorization: Bearer <token>`` (constant-time comparison)."""
    for key, value in metadata or ():
        if key != "authorization":
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        scheme, _, credentials = text.strip().partition(" ")
        offered = credentials.strip().encode("utf-8", "replace")
        return scheme.lower() == "bearer" and hmac.compare_digest(offered, token)
    return False
