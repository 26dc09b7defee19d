"""The Slurm job step a process runs in, read from its ``/proc/<pid>/cgroup``.

Slurm's cgroup plugins put every task of a job step in a cgroup named after the job and the step:

==================================  =============================================================
cgroup v1 (``cgroup/v1`` plugin)     ``/slurm/uid_<uid>/job_<id>/step_<step>/task_<n>``; with several
                                     slurmd daemons on one host, ``/slurm_<nodename>/uid_<uid>/...``
cgroup v2 (``cgroup/v2`` plugin)     ``/system.slice/slurmstepd.scope/job_<id>/step_<step>/user/task_<n>``
                                     (the step's slurmstepd itself in ``.../step_<step>/slurm``); with
                                     several slurmd daemons, ``<nodename>_slurmstepd.scope``
==================================  =============================================================

``<step>`` is a step number, ``batch`` (the batch script), ``extern`` (processes adopted into the
job, e.g. through ``pam_slurm_adopt``) or ``interactive`` (``salloc``'s shell). The job cgroup is
only recognised under Slurm's own parent (``slurm``/``slurm_<name>`` then ``uid_<uid>``, or a
``slurmstepd.scope``): a ``job_<n>`` segment elsewhere is some other program's, and a wrong job is
worse than none.

Only segment names are matched, so a path seen from another cgroup namespace
(``/../../system.slice/...``) still parses. Containers started inside a step (enroot, Apptainer)
stay in the step's cgroup, so a process can have both a Slurm job and a container id.
"""

from __future__ import annotations

import re

from gpuscope.snapshot import SlurmJob

_V1_ROOT = re.compile(r"slurm(?:_[^/]+)?")
_V1_UID = re.compile(r"uid_(?P<uid>[0-9]{1,10})")
_V2_SCOPE = re.compile(r"(?:[^/]+_)?slurmstepd\.scope")
# Bounded lengths keep label values short whatever a path holds; Slurm's ids are 32-bit.
_JOB = re.compile(r"job_(?P<id>[0-9]{1,10})")
_STEP = re.compile(r"step_(?P<step>[0-9]{1,10}|batch|extern|interactive)")


def slurm_job_from_cgroup(text: str) -> SlurmJob | None:
    """The Slurm job step in the content of a ``/proc/<pid>/cgroup`` file, else None.

    On cgroup v1 every controller has a line; one that names the step is preferred over one that
    names only the job (a controller Slurm does not constrain can show a shallower path), and among
    equals the first line in the file wins.
    """
    found: SlurmJob | None = None
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue  # not a cgroup line; tolerated, as in cgroup.py
        job = _job_in_path(fields[2])
        if job is None:
            continue
        if job.step:
            return job
        if found is None:
            found = job
    return found


def _job_in_path(path: str) -> SlurmJob | None:
    segments = [segment for segment in path.strip().split("/") if segment]
    for index, segment in enumerate(segments):
        job = _JOB.fullmatch(segment)
        if job is None or index == 0:
            continue
        uid = _uid_under_slurm_root(segments, index)
        if uid is None and _V2_SCOPE.fullmatch(segments[index - 1]) is None:
            continue  # a job_<n> cgroup that is not Slurm's
        step = _STEP.fullmatch(segments[index + 1]) if index + 1 < len(segments) else None
        return SlurmJob(job_id=job["id"], step=step["step"] if step else "", uid=uid)
    return None


def _uid_under_slurm_root(segments: list[str], job_index: int) -> int | None:
    """The uid of the v1 layout (``slurm[_<node>]/uid_<uid>/job_<id>``); None for any other parent."""
    if job_index < 2 or _V1_ROOT.fullmatch(segments[job_index - 2]) is None:
        return None
    parent = _V1_UID.fullmatch(segments[job_index - 1])
    return None if parent is None else int(parent["uid"])
