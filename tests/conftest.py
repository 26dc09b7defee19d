"""Fixtures shared by several test modules: real JAX jobs to capture (each takes seconds to start,
so they live for the whole session and every capture test reuses them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from capturing import Workload, require_jax, start_jax, stop, wait_ready


@pytest.fixture(scope="session")
def jax_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workload]:
    """A JAX job running jitted matmuls on the CPU, its profiler server on ``jax_job.port``."""
    require_jax()
    workload = start_jax(tmp_path_factory.mktemp("jax-busy"))
    try:
        wait_ready(workload)
        yield workload
    finally:
        stop(workload)


@pytest.fixture(scope="session")
def idle_jax_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workload]:
    """A JAX job that serves the profiler and runs nothing."""
    require_jax()
    workload = start_jax(tmp_path_factory.mktemp("jax-idle"), idle=True)
    try:
        wait_ready(workload)
        yield workload
    finally:
        stop(workload)
