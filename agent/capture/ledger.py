"""The capture policy's memory across restarts: when alert and webhook captures were admitted (their
hourly budget, ``capture.hourly_budget``) and the last one on each GPU (the alert cooldown), kept in
``<store root>/.admissions.json``. A person's on-demand captures have a budget of their own, kept in
memory only (capture/policy.py says why).

The file is rewritten atomically (a new file renamed over the old one) at each admission and each
refund, so a restart, a crash loop or a rollout does not hand out a fresh budget. Times are wall
clock (Unix seconds): the policy's monotonic times do not survive a restart. A file that cannot be
read is logged and ignored; the store's captures then stand in for it (their start times).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpuscope.common.json_input import JsonInputError, load_json
from gpuscope.common.unixfs import FileTooLargeError, fsync_path, read_bounded

log = logging.getLogger(__name__)

LEDGER_FILE = ".admissions.json"
MAX_LEDGER_BYTES = 1 << 20  # 3600 admissions and a few hundred GPUs fit many times over
_VERSION = 1
_NO_GPU = "node"  # a capture tied to no GPU (by pid, or a target named by hand)


@dataclass
class Admissions:
    """Wall-clock times: every admission still inside the budget window, and the last per GPU."""

    started: list[float] = field(default_factory=list)
    last_on_gpu: dict[int | None, float] = field(default_factory=dict)


class AdmissionLedger:
    def __init__(self, path: Path) -> None:
        self.path = path

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> Admissions:
        """What the file holds; empty (logged) when it is missing, unreadable or malformed."""
        try:
            raw = load_json(read_bounded(self.path, MAX_LEDGER_BYTES), max_bytes=MAX_LEDGER_BYTES)
            return _parse(raw)
        except FileNotFoundError:
            return Admissions()
        except (OSError, FileTooLargeError, JsonInputError, ValueError) as err:
            log.warning("ignoring the capture ledger %s (%s): the budget and cooldowns start from the "
                        "captures in the store", self.path, err)
            return Admissions()

    def save(self, started: Iterable[float], last_on_gpu: Mapping[int | None, float]) -> None:
        """Replace the file; a failure is logged, never raised (captures go on without it)."""
        document = {"version": _VERSION, "started": [round(t, 3) for t in started],
                    "last_on_gpu": {(_NO_GPU if gpu is None else str(gpu)): round(t, 3)
                                    for gpu, t in last_on_gpu.items()}}
        try:
            fd, temporary = tempfile.mkstemp(prefix=".admissions.", suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as file:
                    json.dump(document, file)
                    file.flush()
                    os.fsync(file.fileno())
                os.replace(temporary, self.path)
            except BaseException:
                os.unlink(temporary)
                raise
            fsync_path(self.path.parent, directory=True)
        except OSError as err:
            log.warning("cannot write the capture ledger %s: %s; a restart would forget this hour's "
                        "captures", self.path, err.strerror or err)


def _parse(raw: object) -> Admissions:
    if not isinstance(raw, dict) or raw.get("version") != _VERSION:
        raise ValueError(f"not a version {_VERSION} ledger")
    started, last = raw.get("started"), raw.get("last_on_gpu")
    if not isinstance(started, list) or not isinstance(last, dict):
        raise ValueError("'started' must be a list and 'last_on_gpu' a mapping")
    admissions = Admissions(started=sorted(_time(t) for t in started))
    for key, value in last.items():
        if key == _NO_GPU:
            admissions.last_on_gpu[None] = _time(value)
        elif key.isascii() and key.isdigit() and len(key) < 6:
            admissions.last_on_gpu[int(key)] = _time(value)
        else:
            raise ValueError(f"{key!r} is not a GPU index")
    return admissions


def _time(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{value!r} is not a time")
    return float(value)
