"""gpuscope.exporters.exposition writes exactly the bytes of prometheus_client's encoders.

Every test renders one list of collected families twice, with our encoder and with
prometheus_client's (text 0.0.4 ``generate_latest`` and ``openmetrics.exposition.generate_latest``),
and compares bytes: the agent's own snapshots, tricky label values and help texts, special floats,
families the fast path hands to prometheus_client, and seeded random families.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, Summary, generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    StateSetMetricFamily,
    UnknownMetricFamily,
)
from prometheus_client.openmetrics import exposition as openmetrics_exposition
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.samples import Exemplar, Timestamp
from snapshots import (
    CONTAINER_ID,
    FakeSource,
    make_full_snapshot,
    make_gpu,
    make_gpus,
    make_process,
    make_processes,
    make_snapshot,
)

from gpuscope.exporters import exposition
from gpuscope.exporters.exposition import negotiate, render_openmetrics, render_text, restrict_families
from gpuscope.exporters.prometheus import SnapshotCollector
from gpuscope.snapshot import Snapshot
from gpuscope.version import __version__

GOLDEN = Path(__file__).resolve().parent / "golden"
generate_openmetrics: Callable[..., bytes] = openmetrics_exposition.generate_latest  # (untyped there)

ESCAPINGS = ["underscores", "allow-utf-8", "dots", "values"]
# Label values and help texts that need escaping, or look as if they might.
TRICKY_STRINGS = [
    "", " ", '"', "\\", "\n", "\\n", '\\"', '"quoted"', "back\\slash", "two\nlines", "trailing\\",
    "tab\there", "carriage\rreturn", "{braces}", "a=b,c=d", "# HELP", "ünïcødé", "GPU-ß-😀", "日本語",
    "\u2028", "\x00nul", "'single'", "}", '",x="y',
]
SPECIAL_VALUES: list[float] = [
    math.nan, math.inf, -math.inf, 0, 0.0, -0.0, 1, -1, True, False, 0.5, 1e-9, -1e-9, 5e-324,
    1.7976931348623157e308, -1.7976931348623157e308, 123456.0, 1234567.0, 1e6, 999999.9999,
    123456789.5, 2**53, 2**53 + 1, 10**20, -(10**20), 81_559 * 1024**2, 1_717_171_717.25, 1e16,
    1e22, 0.1 + 0.2, 3.0000000000000004, -1234567.0,
]


class Fixed:
    """A collector over an already collected list of families."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def assert_same(families: Iterable[Metric], escaping: str = "underscores") -> None:
    """Both formats of ``families`` equal prometheus_client's bytes (twice: cold and warm caches)."""
    families = list(families)
    kwargs = {"escaping": escaping}
    for _ in range(2):
        expected_text = generate_latest(Fixed(families), **kwargs)
        assert render_text(families, **kwargs) == expected_text
        expected_om = generate_openmetrics(Fixed(families), **kwargs)
        assert render_openmetrics(families, **kwargs) == expected_om


def gpuscope_families(snapshot: Snapshot | None, include_cmdline: bool = False) -> list[Metric]:
    return list(SnapshotCollector(FakeSource(snapshot), include_cmdline=include_cmdline).collect())


def gauge(name: str, help_text: str, labels: dict[str, str], value: float = 1.0, unit: str = "") -> Metric:
    family = GaugeMetricFamily(name, help_text, labels=list(labels), unit=unit)
    family.add_metric(list(labels.values()), value)
    return family


@pytest.fixture(autouse=True)
def _cold_caches() -> None:
    """Each test starts with empty caches, so a cache hit never hides a first-render bug."""
    exposition._label_cache.clear()
    exposition._value_cache.clear()
    exposition._header_cache.clear()


# -- the agent's own families ------------------------------------------------------------------------

SNAPSHOTS: dict[str, Callable[[], Snapshot | None]] = {
    "none": lambda: None,
    "default": make_snapshot,
    "full": make_full_snapshot,
    "8x4": lambda: make_snapshot(gpus=make_gpus(8, processes_per_gpu=4)),
    "8x32": lambda: make_snapshot(gpus=make_gpus(8, processes_per_gpu=32)),
    "nvml_down": lambda: make_snapshot(nvml_up=False, gpus=()),
    "gpu_down": lambda: make_snapshot(gpus=(make_gpu(0), make_gpu(1, up=False, xid_errors={79: 3}))),
    "sample_errors": lambda: make_snapshot(sample_errors={"power": 2, "gpm": 7}),
}


@pytest.mark.parametrize("include_cmdline", [False, True])
@pytest.mark.parametrize("escaping", ESCAPINGS)
@pytest.mark.parametrize("name", sorted(SNAPSHOTS))
def test_agent_snapshots(name: str, escaping: str, include_cmdline: bool) -> None:
    assert_same(gpuscope_families(SNAPSHOTS[name](), include_cmdline), escaping)


@pytest.mark.parametrize(("filename", "snapshot", "openmetrics"), [
    ("full.prom", make_full_snapshot, False),
    ("full_openmetrics.prom", make_full_snapshot, True),
    ("default_8gpu.prom", lambda: make_snapshot(gpus=make_gpus(8, processes_per_gpu=4)), False),
])
def test_golden_files(filename: str, snapshot: Callable[[], Snapshot], openmetrics: bool) -> None:
    include_cmdline = filename.startswith("full")
    families = gpuscope_families(snapshot(), include_cmdline)
    body = (render_openmetrics if openmetrics else render_text)(families)
    expected = (GOLDEN / filename).read_bytes().replace(b"@VERSION@", __version__.encode())
    assert body == expected


def test_our_collector_and_process_collector_in_one_registry() -> None:
    """What the agent registers: SnapshotCollector and prometheus_client's ProcessCollector."""
    snapshot = make_snapshot(gpus=make_gpus(8, processes_per_gpu=4))
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(FakeSource(snapshot), include_cmdline=True))
    ProcessCollector(registry=registry)
    families = list(registry.collect())  # once: the process's CPU time moves between collects
    assert any(family.name.startswith("process_") for family in families)
    assert_same(families)
    assert render_text(families).startswith(b"# HELP gpuscope_build_info ")


def test_the_agents_families_take_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """No family of the agent's registry goes to prometheus_client (else the speed-up is gone). This is
    the test that fails when a prometheus_client release moves the internals the encoder reads: the
    dependency's cap in pyproject.toml moves only with it green."""
    slow: list[object] = []
    monkeypatch.setattr(exposition, "_slow_text", lambda *args: slow.append(args))
    monkeypatch.setattr(exposition, "_slow_openmetrics", lambda *args: slow.append(args))
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(FakeSource(make_full_snapshot), include_cmdline=True))
    ProcessCollector(registry=registry)
    for escaping in ("underscores", "allow-utf-8"):
        render_text(registry.collect(), escaping)
        render_openmetrics(registry.collect(), escaping)
    assert slow == []


def test_registry_with_target_info_and_client_metrics() -> None:
    """prometheus_client's own metric classes: _created samples, info, histogram, summary."""
    registry = CollectorRegistry(target_info={"cluster": 'a"b', "node": "gpu-07"})
    Counter("requests", "Requests.", ["code"], registry=registry).labels("200").inc(3)
    Gauge("temperature", "Temp.", unit="celsius", registry=registry).set(21.5)
    Histogram("latency_seconds", "Latency.", registry=registry).observe(0.3)
    Summary("size_bytes", "Size.", registry=registry).observe(512)
    Info("build", "Build.", registry=registry).info({"version": "1.2.3"})
    assert_same(registry.collect())


# -- label values, help texts, names ------------------------------------------------------------------


@pytest.mark.parametrize("value", TRICKY_STRINGS)
def test_tricky_label_value(value: str) -> None:
    assert_same([gauge("g", "Help.", {"a": value, "b": value + value})])


@pytest.mark.parametrize("value", TRICKY_STRINGS)
def test_tricky_help_text(value: str) -> None:
    assert_same([gauge("g", value, {}), CounterMetricFamily("c", value, value=1),
                 InfoMetricFamily("i", value, value={"k": value})])


@pytest.mark.parametrize("value", TRICKY_STRINGS)
def test_tricky_process_and_gpu_details(value: str) -> None:
    process = make_process(4242, name=value, user=value, container_id=value, cmdline=(value, value, "x"))
    gpu = make_gpu(0, name=value, pci_bus_id=value, processes=(process, *make_processes(0, 2)))
    snapshot = make_snapshot(gpus=(gpu,), driver_version=value, sample_errors={value: 1, "gpm": 2})
    for include_cmdline in (False, True):
        assert_same(gpuscope_families(snapshot, include_cmdline))


def test_label_order_and_shared_label_sets() -> None:
    """Labels are sorted by name whatever the dict order, and one label set is shared by families."""
    families: list[Metric] = []
    for name in ("a", "b", "c"):
        family = GaugeMetricFamily(name, "Help.", labels=["zeta", "alpha", "mid"])
        family.add_metric(["1", "2", "3"], 1)
        family.add_metric(["3", "2", "1"], 2)
        families.append(family)
    reordered = GaugeMetricFamily("d", "Help.", labels=["alpha", "mid", "zeta"])
    reordered.add_metric(["2", "3", "1"], 3)  # the same label set as the first sample above
    families.append(reordered)
    assert_same(families)
    assert b'a{alpha="2",mid="3",zeta="1"} 1.0\n' in render_text(families)
    assert b'd{alpha="2",mid="3",zeta="1"} 3.0\n' in render_text(families)


# -- values ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", SPECIAL_VALUES, ids=repr)
def test_special_value(value: float) -> None:
    counter = CounterMetricFamily("c", "Help.", labels=["gpu"])
    counter.add_metric(["0"], value)
    assert_same([gauge("g", "Help.", {}, value), gauge("h", "Help.", {"gpu": "0"}, value), counter])


def test_values_in_any_order_share_no_wrong_text() -> None:
    """The value cache: 0.0 and -0.0 (equal keys), NaNs, ints and floats of one value."""
    family = GaugeMetricFamily("g", "Help.", labels=["i"])
    for i, value in enumerate([*SPECIAL_VALUES, *reversed(SPECIAL_VALUES), -0.0, 0.0, -0.0, 1, 1.0, True]):
        family.add_metric([str(i)], value)
    assert_same([family])


def test_value_that_is_not_a_number_fails_as_in_prometheus_client() -> None:
    family = GaugeMetricFamily("g", "Help.", labels=["a"])
    family.add_metric(["x"], "not a number")  # type: ignore[arg-type]
    for ours, theirs in ((render_text, generate_latest), (render_openmetrics, generate_openmetrics)):
        with pytest.raises(ValueError) as expected:
            theirs(Fixed([family]))
        with pytest.raises(ValueError) as got:
            ours([family])
        assert got.value.args == expected.value.args


def test_label_value_that_is_not_a_string_fails_as_in_prometheus_client() -> None:
    family = GaugeMetricFamily("g", "Help.", labels=["a"])
    family.add_metric([3], 1)  # type: ignore[list-item]
    for ours, theirs in ((render_text, generate_latest), (render_openmetrics, generate_openmetrics)):
        with pytest.raises(AttributeError):
            theirs(Fixed([family]))
        with pytest.raises(AttributeError):
            ours([family])


# -- what the fast path leaves to prometheus_client --------------------------------------------------


def _unusual_families() -> dict[str, list[Metric]]:
    created = CounterMetricFamily("jobs", "Jobs.", labels=["queue"])
    created.add_metric(["a"], 3, created=1_717_171_000.5)
    created.add_metric(["b"], 4, created=1_717_171_001.0)
    timestamped = GaugeMetricFamily("t", "Timestamped.", labels=["a"])
    timestamped.add_metric(["x"], 1, timestamp=1_717_171_717.123)
    timestamped.add_metric(["y"], 2, timestamp=Timestamp(1_717_171_717, 5))
    exemplar = Metric("e", "Exemplar.", "counter")
    exemplar.add_sample("e_total", {"a": "1"}, 5, exemplar=Exemplar({"trace_id": 'x"y'}, 0.5, 1.5))
    histogram = Histogram("h_seconds", "Histogram.", ["path"], registry=None)
    histogram.labels("/x").observe(0.2)
    gauge_histogram = GaugeHistogramMetricFamily("gh", "Gauge histogram.", buckets=[("1.0", 2), ("+Inf", 3)],
                                                 gsum_value=7)
    state_set = StateSetMetricFamily("s", "State set.", value={"on": True, "off": False})
    unknown = UnknownMetricFamily("u", "Unknown \\ \n help.", labels=["a"])
    unknown.add_metric(["v"], 1.5)
    colon = gauge("job:gpu_power_watts:sum", "Recorded.", {"a": "1"})
    utf8_label = gauge("g", "UTF-8 label name.", {"gpu.index": "0", "ok": "1"})
    utf8_name = gauge("gpu.power", "UTF-8 metric name.", {"a": "1"})
    leading_digit = Metric("m", "Sample names need not be the family's.", "gauge")
    leading_digit.add_sample("1m", {}, 1)
    empty_name = Metric("m2", "An empty sample name.", "gauge")
    empty_name.add_sample("", {"a": "b"}, 1)
    info = InfoMetricFamily("build", "Build.", value={"version": "1.0", "commit": "abc"})
    return {
        "created": [created], "timestamps": [timestamped], "exemplar": [exemplar],
        "histogram": list(histogram.collect()), "gauge_histogram": [gauge_histogram],
        "state_set": [state_set], "unknown": [unknown], "colon": [colon], "utf8_label": [utf8_label],
        "utf8_name": [utf8_name], "leading_digit": [leading_digit], "empty_sample_name": [empty_name],
        "info": [info],
    }


@pytest.mark.parametrize("escaping", ESCAPINGS)
@pytest.mark.parametrize("case", sorted(_unusual_families()))
def test_unusual_family_between_ordinary_ones(case: str, escaping: str) -> None:
    ordinary = gpuscope_families(make_full_snapshot(), include_cmdline=True)
    assert_same([*ordinary[:3], *_unusual_families()[case], *ordinary[3:]], escaping)


def test_openmetrics_version_2_with_native_histogram() -> None:
    from prometheus_client.samples import BucketSpan, NativeHistogram

    native = NativeHistogram(24, 100, 0, 0.001, 4, pos_spans=(BucketSpan(0, 2),), pos_deltas=(2, 1))
    family = Metric("nh", "Native.", "histogram")
    family.add_sample("nh", {"a": "1"}, None, native_histogram=native)  # type: ignore[arg-type]
    families = [gauge("g", "Help.", {"a": "1"}), family]
    for version in ("1.0.0", "2.0.0"):
        expected = generate_openmetrics(Fixed(families), version=version)
        assert render_openmetrics(families, version=version) == expected


# -- seeded random families --------------------------------------------------------------------------


def _random_families(rng: random.Random) -> list[Metric]:
    alphabet = ["a", "Z", "0", " ", "_", '"', "\\", "\n", "é", "😀", "=", ",", "{", "}"]
    label_names = ["gpu", "uuid", "pid", "process", "user", "container_id", "reason", "le", "zz", "_x"]
    families: list[Metric] = []
    for index in range(rng.randint(1, 12)):
        kind = rng.choice(["gauge", "counter", "unknown", "info"])
        names = rng.sample(label_names, rng.randint(0, 5))
        help_text = "".join(rng.choices(alphabet, k=rng.randint(0, 20)))
        name = f"m{index}_{kind}"
        family: Metric
        if kind == "gauge":
            family = GaugeMetricFamily(name, help_text, labels=names, unit=rng.choice(["", "bytes"]))
        elif kind == "counter":
            family = CounterMetricFamily(name, help_text, labels=names, unit=rng.choice(["", "joules"]))
        elif kind == "unknown":
            family = UnknownMetricFamily(name, help_text, labels=names)
        else:
            family = InfoMetricFamily(name, help_text, labels=names)
        for _ in range(rng.randint(0, 8)):
            values = ["".join(rng.choices(alphabet, k=rng.randint(0, 6))) for _ in names]
            number = rng.choice(
                [*SPECIAL_VALUES, rng.uniform(-1e12, 1e12), rng.random(), rng.randint(0, 10**15)])
            if isinstance(family, InfoMetricFamily):
                family.add_metric(values, {"extra": rng.choice(TRICKY_STRINGS)})
            elif isinstance(family, (GaugeMetricFamily, CounterMetricFamily, UnknownMetricFamily)):
                family.add_metric(values, number)
        families.append(family)
    return families


@pytest.mark.parametrize("seed", range(40))
def test_random_families(seed: int) -> None:
    rng = random.Random(seed)
    assert_same(_random_families(rng), rng.choice(ESCAPINGS))


def test_caches_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exposition, "LABEL_CACHE_MAX_ENTRIES", 16)
    monkeypatch.setattr(exposition, "VALUE_CACHE_MAX_ENTRIES", 16)
    for pid in range(100, 140):  # processes come and go
        snapshot = make_snapshot(gpus=(make_gpu(0, processes=(make_process(pid), make_process(pid + 1000))),))
        families = gpuscope_families(snapshot)
        assert_same(families)
        assert len(exposition._label_cache) <= 16
        assert len(exposition._value_cache) <= 16


# -- negotiation and the name filter ------------------------------------------------------------------

ACCEPT_HEADERS = [
    None, "", "*/*", "text/plain", "text/plain; version=0.0.4", "text/plain;version=1.0.0",
    "text/plain;version=1.0.0;escaping=allow-utf-8", "text/plain;version=1.0.0;escaping=dots",
    "text/plain;version=1.0.0;escaping=values", "text/plain;version=1.0.0;escaping=bogus",
    "application/openmetrics-text", "application/openmetrics-text; version=1.0.0",
    "application/openmetrics-text;version=0.0.1", "application/openmetrics-text;version=2.0.0",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
    "application/openmetrics-text;version=1.0.0;escaping=values",
    # Prometheus 2.x and 3.x scrape headers.
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;"
    "version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,"
    "*/*;q=0.2",
    "application/json", "text/html, application/xhtml+xml",
]


@pytest.mark.parametrize("accept", ACCEPT_HEADERS)
def test_negotiate_is_prometheus_clients_choice(accept: str | None) -> None:
    families = [*gpuscope_families(make_full_snapshot(), include_cmdline=True),
                gauge("job:recorded", "Colon.", {"a": "1"}), gauge("gpu.power", "UTF-8.", {"a": "1"})]
    encode, content_type = negotiate(accept)
    expected_encoder, expected_type = choose_encoder(accept or "")
    assert content_type == expected_type
    assert encode(families) == expected_encoder(Fixed(families))
    assert encode(iter(families)) == expected_encoder(Fixed(families))  # a generator, as collect() is


def test_negotiate_maps_onto_the_fast_encoders() -> None:
    encode, _ = negotiate(None)
    assert isinstance(encode, functools.partial) and encode.func is render_text
    encode, _ = negotiate("application/openmetrics-text")
    assert isinstance(encode, functools.partial) and encode.func is render_openmetrics


ACCEPT_PARTS = st.one_of(
    st.sampled_from(["text/plain", "application/openmetrics-text", " text/plain ", "*/*", "TEXT/PLAIN",
                     "application/json", ""]),
    st.text(st.characters(max_codepoint=127), max_size=10))
ACCEPT_PARAMS = st.one_of(
    st.sampled_from(["version=0.0.4", "version=1.0.0", "version=2.0.0", "version=1", "version=1.0",
                     "version=1.0.0.1", "version=1.x", "version=x", "version=", "version=01.0.0",
                     "version=1_0.0", "version=2.x", " version=1.0.0", "escaping=allow-utf-8",
                     "escaping=dots", "escaping=values", "escaping=underscores", "escaping=bogus",
                     "q=0.5", "charset=utf-8"]),
    st.text(st.characters(max_codepoint=127), max_size=10))
ACCEPT_RANGES = st.builds(lambda media, params: ";".join([media, *params]), ACCEPT_PARTS,
                          st.lists(ACCEPT_PARAMS, max_size=3))


@settings(max_examples=300, deadline=None)
@given(st.lists(ACCEPT_RANGES, max_size=4).map(",".join))
def test_negotiate_chooses_as_prometheus_client_for_any_accept_header(accept: str) -> None:
    families = [gauge("a", "A.", {"x": "1"}), gauge("gpu.power", "UTF-8.", {"a": "1"})]
    encode, content_type = negotiate(accept)
    try:
        expected_encoder, expected_type = choose_encoder(accept)
    except TypeError:  # a version it cannot compare: served as without an Accept header
        expected_encoder, expected_type = choose_encoder("")
    assert content_type == expected_type
    assert encode(families) == expected_encoder(Fixed(families))


def test_restrict_families_by_family_or_sample_name() -> None:
    families = gpuscope_families(make_full_snapshot())
    kept = list(restrict_families(families, {"gpu_power_watts", "gpu_energy_joules_total", "gpu_xid_errors",
                                              "no_such_metric"}))
    assert [family.name for family in kept] == ["gpu_power_watts", "gpu_energy_joules", "gpu_xid_errors"]
    by_name = {family.name: family for family in families}
    assert kept[0] is by_name["gpu_power_watts"]
    assert kept[1].samples == by_name["gpu_energy_joules"].samples
    assert kept[1].unit == "joules" and kept[1].type == "counter"
    assert list(restrict_families(families, [])) == []
    body = render_openmetrics(kept)
    assert b"# UNIT gpu_energy_joules joules\n" in body
    assert body == generate_openmetrics(Fixed(kept))


def test_restrict_families_keeps_only_named_samples() -> None:
    counter = CounterMetricFamily("jobs", "Jobs.", labels=["queue"])
    counter.add_metric(["a"], 3, created=1_000.0)
    (kept,) = restrict_families([counter], ["jobs_created"])
    assert [sample.name for sample in kept.samples] == ["jobs_created"]
    assert [sample.name for sample in counter.samples] == ["jobs_total", "jobs_created"]  # untouched


def test_process_container_id_label_is_rendered() -> None:
    body = render_text(gpuscope_families(make_snapshot(gpus=make_gpus(1, processes_per_gpu=1))))
    assert f'container_id="{CONTAINER_ID}"'.encode() in body
