"""HTTP basic authentication against bcrypt hashes, as exporter-toolkit's ``basic_auth_users``.

A bcrypt check costs tens of milliseconds (cost 10) by design, and Prometheus sends the same
credentials every scrape, so outcomes are cached: a digest of (user, hash, password) maps to the
answer, at most CACHE_ENTRIES of them. Only one bcrypt check runs at a time, so a flood of wrong
passwords costs one core, not all of them. An unknown user is checked against a fixed hash, so the
time of an answer does not tell whether a user exists.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping

CACHE_ENTRIES = 256
MAX_PASSWORD_BYTES = 72  # bcrypt reads no further; a longer password is refused, not truncated
_HASH = re.compile(r"\$2[abxy]\$(\d\d)\$[./A-Za-z0-9]{53}")
# The bcrypt hash (cost 10) of a random password nobody knows: checked for unknown users.
_DECOY_HASH = b"$2b$10$21z0Np3chooTBuU/vindQevb2Sf5CLTLerh6yVWDkGjBuAZrxNkja"


class BasicAuthConfigError(ValueError):
    """A user's hash that is not a bcrypt hash; the message names the user."""


def check_bcrypt_hash(user: str, hashed: str) -> int:
    """The cost of ``hashed``; BasicAuthConfigError when it is not a bcrypt hash."""
    match = _HASH.fullmatch(hashed)
    if match is None or not 4 <= int(match.group(1)) <= 31:
        raise BasicAuthConfigError(f"basic_auth_users.{user}: not a bcrypt hash ($2y$10$ followed by 53 "
                                   "characters); make one with `htpasswd -nBC 10 \"\" | tr -d ':\\n'`")
    import bcrypt

    # The salt's encoding is checked at the cheapest cost: a hash bcrypt cannot read fails here, at
    # start, instead of at the first scrape.
    try:
        bcrypt.checkpw(b"", (hashed[:4] + "04" + hashed[6:]).encode())
    except ValueError:
        raise BasicAuthConfigError(f"basic_auth_users.{user}: the bcrypt hash's salt is not valid") from None
    return int(match.group(1))


def parse_basic_credentials(header: str) -> tuple[str, str] | None:
    """(user, password) from an ``Authorization: Basic ...`` value; None when it is not one."""
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, colon, password = decoded.partition(":")
    return (user, password) if colon else None


class BasicAuthVerifier:
    """Checks credentials against ``users`` (name -> bcrypt hash), with a bounded outcome cache."""

    def __init__(self, users: Mapping[str, str]) -> None:
        self._users = {name: hashed.encode() for name, hashed in users.items()}
        self._cache: OrderedDict[bytes, bool] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self._users)

    def users(self) -> frozenset[str]:
        return frozenset(self._users)

    def verify(self, user: str, password: str) -> bool:
        hashed = self._users.get(user)
        key = hashlib.sha256(b"\0".join((user.encode(), hashed or b"", password.encode()))).digest()
        with self._cache_lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        ok = self._bcrypt_matches(password.encode(), hashed)
        with self._cache_lock:
            self._cache[key] = ok
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return ok

    def _bcrypt_matches(self, password: bytes, hashed: bytes | None) -> bool:
        import bcrypt

        if len(password) > MAX_PASSWORD_BYTES:
            return False
        with self._bcrypt_lock:
            try:
                matches = bcrypt.checkpw(password, hashed or _DECOY_HASH)
            except ValueError:
                return False
        return matches and hashed is not None
