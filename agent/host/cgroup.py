"""The container a process runs in, read from its ``/proc/<pid>/cgroup``.

Container runtimes put every container in a cgroup whose name embeds the 64-hex container id. The
layouts recognised (cgroup v1 ``N:controllers:/path`` lines and v2 ``0::/path``, both drivers):

==========================  ==========================================================
docker, systemd driver       ``.../docker-<id>.scope``
docker, cgroupfs driver      ``/docker/<id>``
containerd (Kubernetes)      ``.../cri-containerd-<id>.scope`` (systemd) or
                             ``/kubepods/<qos>/pod<uid>/<id>`` (cgroupfs)
cri-o                        ``.../crio-<id>.scope`` (systemd) or ``.../pod<uid>/crio-<id>``
podman / libpod              ``.../libpod-<id>.scope[/container]`` or ``/libpod_parent/libpod-<id>``
==========================  ==========================================================

A bare 64-hex segment is trusted only directly under ``docker`` or under a Kubernetes pod cgroup
(``kubepods/.../pod<uid>``): elsewhere (a custom ``--cgroup-parent``, a unit that happens to carry
a hash) it is not taken for a container, because a wrong id is worse than none. The monitor
processes ``crio-conmon-<id>`` and ``libpod-conmon-<id>`` sit beside the container, not in it, so
they yield None.

Nesting (docker-in-docker, kind nodes whose pods run inside a node container): the *innermost* id
is returned. That is the container the workload itself runs in, and the one the pod resolver can
find through the runtime; the outer ids name infrastructure (the kind node, the dind daemon).

Paths are read as the agent's cgroup namespace shows them; a process outside it appears as
``/../../kubepods.slice/...``, which still parses, since only segment names are matched.
"""

from __future__ import annotations

import re
from pathlib import Path

_HEX_ID = r"[0-9a-f]{64}"

# One path segment naming a container by runtime prefix. fullmatch on a whole segment, so that
# "crio-conmon-<id>.scope" (the monitor) and ids of the wrong length are rejected.
_PREFIXED = re.compile(rf"(?:docker|cri-containerd|crio|libpod)-(?P<id>{_HEX_ID})(?:\.scope)?")
_BARE = re.compile(_HEX_ID)
# Kubernetes pod cgroup in the cgroupfs layout: "pod" + the pod uid (a UUID, or a 32-hex hash for
# static pods). The systemd layout never holds a bare id, so its "-pod<uid>.slice" is not needed.
_POD = re.compile(r"pod[0-9a-f][0-9a-f_-]*")


def container_id_from_cgroup(text: str) -> str | None:
    """The innermost container id in the content of a ``/proc/<pid>/cgroup`` file, else None.

    On cgroup v1 every controller has a line, and they can disagree: on hybrid hosts the unified
    ``0::`` line of a cgroupfs-driver docker container still shows ``containerd.service``, and an
    undelegated controller can show a shallower path. The line that shows the deepest container
    nesting wins; among equals the first line in the file.
    """
    best: list[str] = []
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue  # not a cgroup line; the kernel never writes one, so tolerate rather than fail
        ids = _container_ids_in_path(fields[2])
        if len(ids) > len(best):
            best = ids
    return best[-1] if best else None


def read_cgroup_file(pid: int, procfs: Path = Path("/proc")) -> str | None:
    """The content of ``/proc/<pid>/cgroup``, or None when it cannot be read."""
    try:
        return (procfs / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:  # the process exited, or /proc is hidden from us (hidepid)
        return None


def read_container_id(pid: int, procfs: Path = Path("/proc")) -> str | None:
    """The container id of process ``pid``, or None for a host process or an unreadable file."""
    text = read_cgroup_file(pid, procfs)
    return None if text is None else container_id_from_cgroup(text)


def _container_ids_in_path(path: str) -> list[str]:
    """Every container id named along ``path``, outermost first."""
    segments = [segment for segment in path.split("/") if segment]
    ids: list[str] = []
    for index, segment in enumerate(segments):
        prefixed = _PREFIXED.fullmatch(segment)
        if prefixed is not None:
            ids.append(prefixed["id"])
        elif _BARE.fullmatch(segment) is not None and _bare_id_allowed(segments, index):
            ids.append(segment)
    return ids


def _bare_id_allowed(segments: list[str], index: int) -> bool:
    """Whether a bare 64-hex segment sits where a runtime puts one, not just anywhere."""
    if index == 0:
        return False
    parent = segments[index - 1]
    if parent == "docker":
        return True
    return _POD.fullmatch(parent) is not None and "kubepods" in segments[: index - 1]
