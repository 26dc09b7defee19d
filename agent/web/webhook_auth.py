"""The credentials of Alertmanager's webhook: a bearer token read from a file, or basic auth by
users of the web configuration, which is what Alertmanager's ``http_config`` can send
(``authorization.credentials_file`` or ``basic_auth``).

The token file is read on each webhook request (they are rare: one per alert group notification), so
a rotated Secret applies at once. A file that cannot be read refuses every request and says why in
the log, at most every 10 s.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from gpuscope.control.auth import bearer_matches, read_token
from gpuscope.control.errors import ControlError
from gpuscope.web.basic_auth import parse_basic_credentials
from gpuscope.web.web_config import WebSecurity

log = logging.getLogger(__name__)

_ERRORS_LOGGED_EVERY_S = 10.0


class WebhookAuth:
    """Whether a request's Authorization header carries the webhook's credentials."""

    def __init__(self, *, token_file: Path | None, users: Collection[str],
                 security: Callable[[], WebSecurity]) -> None:
        self._token_file = token_file
        self._users = frozenset(users)
        self._security = security
        self._lock = threading.Lock()
        self._logged_at = -math.inf

    def challenge(self) -> str:
        """The WWW-Authenticate value of a 401: the schemes this webhook accepts."""
        schemes = (["Bearer"] if self._token_file is not None else []) + (
            ['Basic realm="gpuscope webhook"'] if self._users else [])
        return ", ".join(schemes)

    def check_token_file(self) -> None:
        """At start: ControlError (usage) when the token file cannot be used."""
        if self._token_file is not None:
            read_token(self._token_file, what="webhook token file", agent_side=True)

    def allows(self, authorization: str) -> bool:
        scheme = authorization.strip().partition(" ")[0].lower()
        if scheme == "bearer" and self._token_file is not None:
            try:
                token = read_token(self._token_file, what="webhook token file", agent_side=True)
            except ControlError as err:
                self._log_error(str(err))
                return False
            return bearer_matches([("authorization", authorization)], token.encode())
        if scheme == "basic" and self._users:
            credentials = parse_basic_credentials(authorization)
            if credentials is None or credentials[0] not in self._users:
                return False
            return self._security().users.verify(*credentials)
        return False

    def _log_error(self, message: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._logged_at < _ERRORS_LOGGED_EVERY_S:
                return
            self._logged_at = now
        log.error("webhook refused: %s", message)
