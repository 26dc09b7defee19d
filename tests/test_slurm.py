"""Slurm job steps from /proc/<pid>/cgroup, over one fixture per layout of Slurm's cgroup plugins."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuscope.host.cgroup import container_id_from_cgroup
from gpuscope.host.slurm import slurm_job_from_cgroup
from gpuscope.snapshot import SlurmJob

FIXTURES = Path(__file__).parent / "fixtures" / "slurm"
CONTAINER_FIXTURES = Path(__file__).parent / "fixtures" / "cgroup"

EXPECTED: dict[str, SlurmJob | None] = {
    # cgroup/v1: the path names the uid too
    "v1_task.txt": SlurmJob("4242", "0", 1000),
    "v1_batch.txt": SlurmJob("4243", "batch", 1000),
    "v1_multiple_slurmd.txt": SlurmJob("4244", "2", 1000),
    # a controller that shows only the job comes first: the line naming the step wins
    "v1_job_before_step.txt": SlurmJob("4245", "extern", 1000),
    "v1_root_job.txt": SlurmJob("17", "0", 0),
    # hybrid host: the unified 0:: line shows slurmd's cgroup, the v1 lines the step
    "v1_hybrid.txt": SlurmJob("4242", "0", 1000),
    # cgroup/v2: no uid in the path
    "v2_task.txt": SlurmJob("4242", "0"),
    "v2_batch.txt": SlurmJob("4243", "batch"),
    "v2_extern.txt": SlurmJob("4245", "extern"),
    "v2_interactive.txt": SlurmJob("4246", "interactive"),
    "v2_multiple_slurmd.txt": SlurmJob("4244", "2"),
    "v2_stepd.txt": SlurmJob("4242", "0"),  # the step's slurmstepd: in the step, outside its tasks
    "v2_foreign_cgroupns.txt": SlurmJob("4242", "0"),  # seen from another cgroup namespace
    # not a job
    "none_stepd_daemon_v2.txt": None,
    "none_slurmd_v2.txt": None,
    "none_lookalike_job_v2.txt": None,
    "none_lookalike_uid_v1.txt": None,
    "none_lookalike_slurm_root_v1.txt": None,
}


def test_every_fixture_has_an_expectation() -> None:
    assert {path.name for path in FIXTURES.glob("*.txt")} == set(EXPECTED)


@pytest.mark.parametrize(("fixture", "expected"), sorted(EXPECTED.items()))
def test_slurm_job_from_fixture(fixture: str, expected: SlurmJob | None) -> None:
    assert slurm_job_from_cgroup((FIXTURES / fixture).read_text()) == expected


@pytest.mark.parametrize("fixture", sorted(path.name for path in CONTAINER_FIXTURES.glob("*.txt")))
def test_container_layouts_are_no_job(fixture: str) -> None:
    assert slurm_job_from_cgroup((CONTAINER_FIXTURES / fixture).read_text()) is None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "garbage without colons\n",
        "0::\n",
        "0:/system.slice/slurmstepd.scope/job_1/step_0\n",  # two fields only: not a cgroup line
        "0::/job_1/step_0\n",  # a job segment with no parent at all
        "0::/system.slice/slurmstepd.scope/job_12345678901/step_0\n",  # longer than a 32-bit id
        "0::/system.slice/slurmstepd.scope/job_x1/step_0\n",
    ],
)
def test_malformed_content_is_none(text: str) -> None:
    assert slurm_job_from_cgroup(text) is None


def test_job_without_step_segment_has_empty_step() -> None:
    assert slurm_job_from_cgroup("0::/system.slice/slurmstepd.scope/job_9\n") == SlurmJob("9", "")


def test_unknown_step_name_is_empty_step() -> None:
    text = "0::/system.slice/slurmstepd.scope/job_9/step_weird/user/task_0\n"
    assert slurm_job_from_cgroup(text) == SlurmJob("9", "")


def test_crlf_line_endings() -> None:
    assert slurm_job_from_cgroup("0::/system.slice/slurmstepd.scope/job_9/step_1/user/task_0\r\n") == \
        SlurmJob("9", "1")


def test_job_inside_a_container_keeps_the_container_too() -> None:
    # A container started in a step (enroot, Apptainer) stays in the step's cgroup.
    container = "d548c5b83fa61d8e3bd86ad42a7ffea9b7c86e3f9d8095c1577d3e1270bb9420"
    text = f"0::/system.slice/slurmstepd.scope/job_9/step_0/user/task_0/docker/{container}\n"
    assert slurm_job_from_cgroup(text) == SlurmJob("9", "0")
    assert container_id_from_cgroup(text) == container


_SEGMENTS = st.sampled_from(["slurm", "slurm_n1", "uid_1000", "uid_", "job_7", "job_", "step_0", "step_batch",
                             "slurmstepd.scope", "x_slurmstepd.scope", "user", "task_0", "..", "", ":"])


@given(st.lists(st.lists(_SEGMENTS, max_size=8).map("/".join), max_size=4), st.text(max_size=40))
def test_never_raises_and_names_a_numeric_job(paths: list[str], noise: str) -> None:
    text = "".join(f"{n}::/{path}\n" for n, path in enumerate(paths)) + noise
    job = slurm_job_from_cgroup(text)
    assert job is None or job.job_id.isdigit()
