"""Fixtures shared by several test modules: real JAX jobs to capture (each takes seconds to start,
so they live for the whole session and every capture test reuses them), and a real OpenTelemetry
Collector for the OTLP tests (one per test: tests/otel_collector.py)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from capturing import Workload, require_jax, start_jax, stop, wait_ready
from hypothesis import HealthCheck, settings
from otel_collector import OtelCollector, running_collector

# Hypothesis (tests/test_fuzz_*.py, which keep no example database) caches what it learns of the code
# and of Unicode in .hypothesis/ under the working directory: in the temporary directory instead.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      os.path.join(tempfile.gettempdir(), "gpuscope-hypothesis"))
# The property-based tests' common settings (each file sets its number of examples): no example
# database (every run starts fresh, nothing is written next to the code), no deadline (a loaded
# machine is slow: a slow example is not a failure), and inputs as large and as filtered as they need.
settings.register_profile("gpuscope", deadline=None, database=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
    HealthCheck.function_scoped_fixture])
settings.load_profile("gpuscope")


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


@pytest.fixture
def otel_collector(tmp_path: Path) -> Iterator[OtelCollector]:
    """A real OpenTelemetry Collector (tests/otel_collector.py), started, its receivers on loopback;
    skips where scripts/build-otelcol has not built it."""
    with running_collector(tmp_path / "otelcol") as collector:
        yield collector
