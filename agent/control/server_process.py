"""The control API's server process: gpuscope.v1.Agent's gRPC server, for the agent that started it.

gRPC and protobuf cost a Python process some 20 MiB that it never gives back, and a control API is
called now and then: ``gpuscope capture`` once in a while, a fleet capture, a script's ListCaptures. So
the agent holds its control socket itself (``gpuscope.control.on_demand``) and, when a client comes,
starts this process, which takes the socket over at the same path in one rename, serves the calls by
asking the agent over a private socket (``gpuscope.control.bridge``), and exits once nobody has called
for ``control.idle_timeout``: the agent takes the socket back first, so a client never finds none.

It ignores SIGINT (a Ctrl-C on a foreground agent reaches the whole process group: the agent decides
when its server stops) and stops when the agent closes the private socket, or goes away.

Run by the agent as ``python -m gpuscope.control.server_process ARGS``, ARGS a JSON object: ``socket``,
``mode``, ``replacing`` (the identity of the agent's socket to take over), ``bridge_fd``,
``idle_timeout_s``, ``info`` (GetAgentInfo's fields) and ``log_level``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gpuscope.control.bridge import RemoteMethods
from gpuscope.control.config import ControlConfig
from gpuscope.control.errors import ControlServerError
from gpuscope.control.server import CallActivity, ControlServer

log = logging.getLogger(__name__)

GRACE_S = 30.0  # calls in progress when the agent takes the socket back may finish within this


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = json.loads((sys.argv[1:] if argv is None else argv)[0])
    logging.basicConfig(level=args.get("log_level", "WARNING"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    remote = RemoteMethods(socket.socket(fileno=int(args["bridge_fd"])), info=args["info"])
    config = ControlConfig.model_validate({"socket": Path(args["socket"]), "socket_mode": args["mode"]})
    activity = CallActivity()
    server = ControlServer(config, remote, activity=activity)
    try:
        server.start(replacing=tuple(args["replacing"]))
    except ControlServerError as err:
        remote.send({"failed": str(err)})
        remote.close()
        return 1
    remote.send({"ready": list(server.socket_identity or (0, 0))})
    idle_timeout = float(args["idle_timeout_s"])
    told_at = -math.inf
    while not remote.ended.wait(min(1.0, idle_timeout / 4)):
        # Told again after each idle time: an agent that could not take its socket back tries again.
        if activity.idle_for() >= idle_timeout and time.monotonic() - told_at >= idle_timeout:
            remote.send({"idle": True})  # the agent takes the socket back and answers "release"
            told_at = time.monotonic()
    # Released: calls still in progress finish (they still reach the agent). Closed: the agent is gone
    # or stopping, and its calls fail at once.
    server.stop(GRACE_S if remote.released.is_set() else 0.5)
    remote.close()
    return 0


if __name__ == "__main__":
    status = main()
    logging.shutdown()
    os._exit(status)  # at once: gRPC's threads need no orderly interpreter shutdown, the agent is waiting
