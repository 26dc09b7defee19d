"""The bearer-token check of the control API's TCP listener, as a gRPC server interceptor."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from gpuscope.control.auth import bearer_matches

log = logging.getLogger(__name__)

_REFUSALS_LOGGED_EVERY_S = 10.0


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Lets a call through only with the right bearer token; UNAUTHENTICATED before the method runs.
    Refusals are logged at most every 10 s, with their count."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self._lock = threading.Lock()
        self._refused = 0
        self._logged_at = -math.inf

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or bearer_matches(details.invocation_metadata, self._token):
            return handler
        self._note_refusal(details.method)

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong bearer token: send 'authorization: Bearer <token>' with the "
                          "token of the agent's control.tcp.token_file")

        if handler.response_streaming:
            def deny_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                deny(request, context)
                yield from ()

            return grpc.unary_stream_rpc_method_handler(deny_stream)
        return grpc.unary_unary_rpc_method_handler(deny)

    def _note_refusal(self, method: str) -> None:
        with self._lock:
            self._refused += 1
            now = time.monotonic()
            if now - self._logged_at < _REFUSALS_LOGGED_EVERY_S:
                return
            self._logged_at, count, self._refused = now, self._refused, 0
        log.warning("control API: refused %d call(s) without a valid bearer token (latest: %s)",
                    count, method)
