"""The agent's read side: the JSON documents it serves at both of its doors, the HTTP endpoints
(``/api/v1/snapshot``, ``/api/v1/alerts``, ``/api/v1/captures``) and the control API (``GetSnapshot``,
``ListAlerts``, ``ListCaptures``).

One builder per document (``build``) and one reading of the listing's parameters (``parameters``), so
that the two doors answer the same document for the same request and the ``processes`` settings
decide what leaves the agent in one place. The doors only carry the result: HTTP as a body, the control
API inside its messages. Imports point down: this package reads the snapshot, alert and capture
models; ``web`` and ``control`` import it, never the other way.
"""

from gpuscope.documents.build import (
    CAPTURES_PATH,
    DEFAULT_PROCESSES,
    NO_SNAPSHOT_YET,
    ProcessExposure,
    alerts_document,
    captures_document,
    encode_document,
    snapshot_document,
)
from gpuscope.documents.parameters import (
    DEFAULT_LIST_LIMIT,
    MAX_LIST_LIMIT,
    ListParameters,
    ParameterError,
    list_parameters,
)

__all__ = [
    "CAPTURES_PATH",
    "DEFAULT_LIST_LIMIT",
    "DEFAULT_PROCESSES",
    "MAX_LIST_LIMIT",
    "NO_SNAPSHOT_YET",
    "ListParameters",
    "ParameterError",
    "ProcessExposure",
    "alerts_document",
    "captures_document",
    "encode_document",
    "list_parameters",
    "snapshot_document",
]
