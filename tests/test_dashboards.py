"""The Grafana dashboards (dashboards/*.json): lint rules, PromQL, and data from a real Prometheus.

Static rules (the dashboard-linter's, checked here): every panel, target, annotation and query variable
uses the `datasource` variable; every panel sets a unit; rate() and irate() use `$__rate_interval`
(increase() that or `$__range`); every selector of an agent metric matches `job=~"$job"` and
`instance=~"$instance"`; every metric is in docs/metrics.md. `promtool check rules` parses every query.

End to end: `gpuscope run` on a simulated node that shows every pattern the panels chart (a busy
power-capped GPU with an Xid and a pending row remap, NVLink, an input-bound GPU, a shared GPU, a GPU with no
job, a GPU in MIG mode) is scraped by a real
Prometheus (Debian's package, as in test_e2e_prometheus.py); every panel query and annotation, with the
template variables substituted as Grafana would, must return data. The capture panels need profiler
captures: a real JAX job (tests/workloads/jax_workload.py, on the CPU) "runs" on GPU 2 under its real
pid, and the agent captures it through its control API (see Live.recent_capture for the time windows).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_process import RunningAgent, http_get, run_agent
from capturing import Workload
from test_e2e_prometheus import PROMTOOL, Prometheus, require, run_prometheus, scrape_config

from gpuscope.control.client import ControlClient
from gpuscope.control.errors import ControlError

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "dashboards").glob("*.json"))}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str  # the panel's title, or "annotation"
    ref: str  # the target's refId, or the annotation's name
    expr: str
    instant: bool

    @property
    def id(self) -> str:
        return f"{self.dashboard}:{self.panel}:{self.ref}"


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def queries() -> list[Query]:
    out = []
    for name, dashboard in DASHBOARDS.items():
        for panel in panels(dashboard):
            out += [Query(name, panel["title"], t["refId"], t["expr"], bool(t.get("instant")))
                    for t in panel.get("targets", [])]
        out += [Query(name, "annotation", a["name"], a["expr"], False)
                for a in dashboard["annotations"]["list"] if not a.get("builtIn")]
    return out


QUERIES = queries()


def test_the_two_dashboards_exist_in_grafana_classic_json() -> None:
    assert set(DASHBOARDS) == {"gpu-node", "gpu-fleet"}
    for name, dashboard in DASHBOARDS.items():
        assert dashboard["schemaVersion"] == 42, name
        assert dashboard["uid"] == f"gpuscope-{name}" and dashboard["title"]
        assert dashboard["id"] is None  # provisioning assigns it
        assert "${DS_" not in json.dumps(dashboard)  # an export's input placeholders break provisioning
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"


def test_panels_fit_the_grid_without_overlapping() -> None:
    for name, dashboard in DASHBOARDS.items():
        cells: dict[tuple[int, int], int] = {}
        for panel in dashboard["panels"]:
            g = panel["gridPos"]
            assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, f"{name}: {panel['title']}"
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    other = cells.setdefault((x, y), panel["id"])
                    assert other == panel["id"], f"{name}: panel {panel['id']} overlaps panel {other}"


def test_every_panel_uses_the_datasource_variable_and_sets_a_unit() -> None:
    for name, dashboard in DASHBOARDS.items():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        ds = variables["datasource"]
        assert ds["type"] == "datasource" and ds["query"] == "prometheus", name
        for var in variables.values():
            if var["type"] == "query":
                assert var["datasource"] == DATASOURCE, f"{name}: variable {var['name']}"
        for panel in panels(dashboard):
            where = f"{name}: panel {panel['title']!r}"
            assert panel["datasource"] == DATASOURCE, where
            assert panel["targets"], where
            assert all(t["datasource"] == DATASOURCE for t in panel["targets"]), where
            assert panel["fieldConfig"]["defaults"].get("unit"), f"{where} sets no unit"
            assert panel.get("description"), f"{where} has no description"
        for annotation in dashboard["annotations"]["list"]:
            if not annotation.get("builtIn"):
                assert annotation["datasource"] == DATASOURCE, f"{name}: annotation {annotation['name']}"


def test_job_and_instance_variables_come_from_the_agent() -> None:
    for name, dashboard in DASHBOARDS.items():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert variables["job"]["definition"] == "label_values(gpuscope_build_info, job)", name
        instance = 'label_values(gpuscope_build_info{job=~"$job"}, instance)'
        assert variables["instance"]["definition"] == instance, name
        assert variables["job"]["multi"] and variables["job"]["includeAll"]
    assert not {v["name"]: v for v in DASHBOARDS["gpu-node"]["templating"]["list"]}["instance"]["multi"]
    assert {v["name"]: v for v in DASHBOARDS["gpu-fleet"]["templating"]["list"]}["instance"]["multi"]


def _strings(expr: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(r'"(?:[^"\\]|\\.)*"', expr)]


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric, matcher block) of every selector of an agent metric (gpu_*, gpuscope_*)."""
    strings = _strings(expr)
    out = []
    for m in re.finditer(r"\b(gpu(?:scope)?_\w+)\s*(\{[^}]*\})?", expr):
        if not any(a <= m.start() < b for a, b in strings):
            out.append((m.group(1), m.group(2) or ""))
    return out


def call_arguments(expr: str, function: str) -> list[str]:
    """The argument text of every call of `function` in expr."""
    out = []
    for m in re.finditer(rf"\b{function}\s*\(", expr):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            i += 1
        out.append(expr[m.end():i - 1].strip())
    return out


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: q.id)
def test_query_follows_the_linter_rules(query: Query) -> None:
    found = selectors(query.expr)
    assert found, "no agent metric"
    for metric, block in found:
        normal = re.sub(r"\s+", "", block)
        assert 'job=~"$job"' in normal and 'instance=~"$instance"' in normal, f"{metric}{block}"
    for function in ("rate", "irate"):
        for argument in call_arguments(query.expr, function):
            assert argument.endswith("[$__rate_interval]"), f"{function}({argument})"
    for argument in call_arguments(query.expr, "increase"):
        assert argument.endswith(("[$__rate_interval]", "[$__range]")), f"increase({argument})"


def catalogue() -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `([a-z0-9_:]+)` \|", text, flags=re.MULTILINE))


def test_dashboards_use_only_catalogued_metrics_and_cover_the_node_and_fleet_views() -> None:
    known = catalogue()
    used: dict[str, set[str]] = {name: set() for name in DASHBOARDS}
    for query in QUERIES:
        used[query.dashboard] |= {metric for metric, _ in selectors(query.expr)}
    for name, metrics in used.items():
        assert metrics <= known, f"{name}: not in docs/metrics.md: {sorted(metrics - known)}"
    # What each dashboard must show: the node dashboard's metrics, then the fleet's.
    # Utilization over time from the busy-time counters (rate()), never from a gauge sampled at scrapes.
    assert used["gpu-node"] >= {
        "gpu_busy_seconds_total", "gpu_idle_dips_total", "gpu_sm_active_seconds_total",
        "gpu_tensor_active_seconds_total", "gpu_memory_used_bytes", "gpu_power_watts",
        "gpu_energy_joules_total", "gpu_temperature_celsius", "gpu_sm_clock_hertz", "gpu_clock_event_active",
        "gpu_pcie_tx_bytes_total", "gpu_pcie_rx_bytes_total", "gpu_xid_errors_total",
        "gpu_process_memory_used_bytes", "gpu_process_busy_seconds_total", "gpu_process_energy_joules_total",
        "gpuscope_alert_firing", "gpuscope_captures_total",
        # hardware health, NVLink, MIG instances, engines
        "gpu_health", "gpu_remapped_rows_total", "gpu_row_remap_pending", "gpu_row_remap_failed",
        "gpu_ecc_corrected_errors_total", "gpu_pcie_replays_total", "gpu_pcie_errors_total",
        "gpu_memory_temperature_celsius", "gpu_clock_throttle_seconds_total",
        "gpu_nvlink_transmit_bytes_total",
        "gpu_nvlink_receive_bytes_total", "gpu_nvlink_errors_total", "gpu_nvlink_active_links",
        "gpu_mig_memory_used_bytes", "gpu_mig_memory_total_bytes", "gpu_mig_busy_seconds_total",
        "gpu_mig_sm_active_ratio", "gpu_mig_tensor_active_ratio", "gpu_mig_pod_info",
        "gpu_encoder_utilization_ratio", "gpu_decoder_utilization_ratio", "gpu_fp16_active_ratio",
        "gpu_fp32_active_ratio", "gpu_fp64_active_ratio"}
    assert used["gpu-fleet"] >= {
        "gpu_busy_seconds_total", "gpu_processes", "gpu_power_watts", "gpu_pod_info", "gpuscope_alert_firing",
        "gpuscope_captures_total", "gpu_health", "gpu_clock_throttle_seconds_total"}
    for metric in ("gpu_utilization_ratio", "gpu_sm_active_ratio", "gpu_tensor_active_ratio",
                   "gpu_process_sm_utilization_ratio"):
        assert not any(metric in q.expr for q in QUERIES), f"{metric}: chart the rate of its counter instead"
    titles = {p["title"] for p in panels(DASHBOARDS["gpu-fleet"])}
    assert {"Utilization by node and GPU", "Busy vs idle GPU hours", "Energy spent on idle GPUs",
            "Utilization skew per node", "Top pods by wasted GPU time"} <= titles
    assert any(p["type"] == "heatmap" for p in panels(DASHBOARDS["gpu-fleet"]))
    processes = next(p for p in panels(DASHBOARDS["gpu-node"]) if p["title"] == "GPU processes")
    order = processes["transformations"][1]["options"]["indexByName"]
    assert {"pid", "process", "user", "pod", "Value #A", "Value #B"} <= set(order)


def test_the_variable_substitution_covers_every_variable() -> None:
    """Every $name is one of substitute()'s; a label_replace() replacement's group ($1) names no variable,
    and Grafana leaves it as it is."""
    for query in QUERIES:
        assert not re.search(r"\$(?!\d)", substitute(query.expr, "127.0.0.1:9847")), query.id


# --------------------------------------------------------------------------- PromQL and live data

RATE_INTERVAL = "5s"  # what Grafana computes for a 1 s scrape interval: max(4 x scrape, interval + scrape)
RANGE_SECONDS = 30


def substitute(expr: str, instance: str) -> str:
    """The query as Grafana sends it, with "All" GPUs and the test's job and instance selected."""
    values = {
        "$__rate_interval": RATE_INTERVAL, "$__range": f"{RANGE_SECONDS}s", "$__interval_ms": "1000",
        "$__interval": "1s", "$job": "gpuscope", "$instance": instance, "$gpu": "(0|1|2|3|4)",
    }
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(name, values[name])
    return expr


def test_promtool_parses_every_query(tmp_path: Path) -> None:
    promtool = require(PROMTOOL, "promtool")
    rules = {"groups": [{"name": "dashboards", "rules": [
        {"record": f"gpuscope_dashboard:query{i}", "expr": substitute(q.expr, "127.0.0.1:9847")}
        for i, q in enumerate(QUERIES)]}]}
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


# GPU 0: busy, power-capped (sw_power_cap), GPM, an Xid 63 at 2 s and the row remap it recorded pending
# (gpu_health reset_required), NVLink with replays, a video encoder. GPU 1: input-bound (idle dips), NVLink.
# GPU 2: shared by two processes; the first is the real JAX job when there is one (see scenario()).
# GPU 3: no job. GPU 4: MIG mode, a pod's job on one of its two MIG devices.
SCENARIO = """
name: dashboards
duration: 10m
gpus:
  - utilization: {level: 0.96, noise: 0.02}
    power: {limit_w: 450}
    processes: [{name: train-rank0, spawn: true, memory: 60GiB}]
    xid: [{at: 2s, code: 63}]
    pods: [{namespace: research, pod: llm-pretrain-0, container: trainer}]
    health: {remapped_rows_uncorrectable: 1, row_remap_pending: true, ecc_corrected: 12, pcie_replays: 3,
             pcie_errors: {correctable: 5}, encoder: true}
    nvlink: {links: 18, errors: {replay: 2, crc_flit: 40}}
  - utilization: {pattern: steps, period: 1s, busy_fraction: 0.5, busy_level: 0.97, idle_level: 0.0}
    processes: [{name: train-rank1, spawn: true, memory: 58GiB}]
    pods: [{namespace: research, pod: llm-pretrain-1, container: trainer}]
    nvlink: {links: 18}
  - utilization: {level: 0.6, noise: 0.03}
    processes:
      - {name: train-rank2, spawn: true, memory: 40GiB, sm_share: 0.8}
      - {name: eval-job, spawn: true, memory: 10GiB, sm_share: 0.2}
    pods: [{namespace: research, pod: llm-pretrain-2, container: trainer}]
  - utilization: 0
  - mig: enabled
    mig_devices:
      - profile: 3g.40gb
        utilization: {level: 0.5, noise: 0.05}
        pods: [{namespace: research, pod: eval-mig-0, container: eval}]
      - profile: 2g.20gb
    processes: [{name: eval-mig, spawn: true, memory: 12GiB, mig_device: 0}]
"""
CONFIG = """
sample_interval: 500ms
alerting:
  rules:
    GpuSharedByProcesses: {for: 1s}
"""
CAPTURE_GPU = 2
CAPTURE_SECONDS = 0.5  # the JAX job runs thousands of steps a second: never an empty trace
CAPTURE_METRICS = {"gpuscope_captures_total", "gpuscope_capture_last_timestamp_seconds"}
# A capture query runs only after Prometheus has seen a captured increment in the last this many
# seconds (see Live.recent_capture): the increment must lie in the queries' RANGE_SECONDS, and the
# other 10 s cover the query that follows the check and the scrape's lag.
CAPTURE_FRESH_SECONDS = 20


def scenario(jax_pid: int) -> str:
    """SCENARIO, with the JAX job's real pid in place of GPU 2's spawned train-rank2."""
    document = yaml.safe_load(SCENARIO)
    document["gpus"][CAPTURE_GPU]["processes"][0] = {"name": "jax-job", "pid": jax_pid, "memory": "40GiB",
                                                     "sm_share": 0.8}
    return yaml.safe_dump(document, sort_keys=False)


def config(jax_port: int) -> str:
    """CONFIG, with captures of the JAX job's profiler server. The hourly budget (6 by default) is raised
    for Live.recent_capture, which may capture more than 6 times on a very slow run."""
    return CONFIG + (f"capture:\n  profiler_ports: [{jax_port}]\n  hourly_budget: 100\n"
                     "  user_hourly_budget: 100\n")


def reads_captures(query: Query) -> bool:
    return bool(CAPTURE_METRICS & {metric for metric, _ in selectors(query.expr)})


@dataclass
class Live:
    prometheus: Prometheus
    agent: RunningAgent
    control: Path  # the agent's control API socket (run_agent's GPUSCOPE_CONTROL__SOCKET)
    jax: Workload  # the JAX job on GPU 2

    @property
    def instance(self) -> str:
        return f"127.0.0.1:{self.agent.port}"

    def api(self, path: str, **params: str) -> Any:
        status, body = http_get(f"{self.prometheus.base}{path}?{urllib.parse.urlencode(params)}")
        assert status == 200, body
        data = json.loads(body)
        assert data["status"] == "success", data
        return data["data"]

    def capture(self, timeout: float = 60.0) -> dict[str, Any]:
        """A user capture of GPU 2 through the control API (what `gpuscope capture --gpu 2` does), retried
        until one is `captured`: the control socket may not be up yet, and an alert's capture in flight
        would make the node busy (none of the alerts that fire here captures by default, but a very slow
        run could reach GpuFrequentIdleDips on GPU 1: a 1-minute window, then `for: 1m`).

        Not the agent's own alert: the rule that captures on GPU 2's 0.6 utilization, GpuLowUtilization,
        judges a 2-minute window and then waits `for: 2m`, and once an alert or webhook trigger has
        captured on a GPU, the next ones are refused for capture.cooldown (15 min). A user capture is
        immediate, passes no rule and no cooldown, and can be repeated (recent_capture needs that)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with ControlClient(self.control, timeout=10.0) as client:
                    record = client.capture(gpu=CAPTURE_GPU, duration_s=CAPTURE_SECONDS,
                                            reason="test_dashboards",
                                            timeout=max(5.0, deadline - time.monotonic()))
                if record["outcome"] == "captured":
                    return record
                last = f"outcome {record['outcome']}: {record.get('error')}"
            except ControlError as err:
                last = str(err)
            if time.monotonic() > deadline:
                raise AssertionError(f"no capture after {timeout} s; last: {last}\n"
                                     f"{self.agent.stderr()[-4000:]}")
            time.sleep(0.2)

    def recent_capture(self) -> None:
        """Make sure that Prometheus saw gpuscope_captures_total{outcome="captured"} go up in the last
        CAPTURE_FRESH_SECONDS; if it did not, capture now and wait (bounded) until it has scraped that.

        Why: the capture panels ask whether a capture happened in the time range (increase(...[$__range])
        at now, increase(...[$__rate_interval]) > 0 over the last RANGE_SECONDS), so an increment must
        lie within the last 30 s when each query runs, however long the tests before it took (a loaded
        machine, or -k picking only these). Widening the range for these queries would no longer test
        what Grafana sends, and relying on the test order would break with the first slow run. Also, the
        fixture's capture usually lands before Prometheus's first scrape (which comes seconds after it is
        ready), so Prometheus first sees the counter at 1 and increase() sees no increment until a later
        sample is higher: the first capture query then takes a second capture. That one normally serves
        all six queries (they run within a second or two): about 2 s in all."""
        selector = f'gpuscope_captures_total{{instance="{self.instance}", outcome="captured"}}'
        if self.prometheus.query(f"increase({selector}[{CAPTURE_FRESH_SECONDS}s]) > 0"):
            return
        (before,) = self.prometheus.query(f"sum({selector})")  # the fixture waited for the series
        self.capture()
        # A sample above the last one scraped before the capture: both are in Prometheus now.
        self.prometheus.wait_for(f"sum({selector}) > {before['value'][1]}", timeout=30)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, jax_job: Workload) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("dashboards")
    jax = jax_job
    with ExitStack() as stack:
        (tmp / "scenario.yaml").write_text(scenario(jax.pid))
        (tmp / "gpuscope.yml").write_text(config(jax.port))
        args = ("--config", str(tmp / "gpuscope.yml"), "--simulate", str(tmp / "scenario.yaml"))
        agent = stack.enter_context(run_agent(tmp, *args))
        prometheus = stack.enter_context(run_prometheus(tmp / "prometheus", scrape_config(agent)))
        live = Live(prometheus, agent, tmp / f"control-{agent.port}.sock", jax)
        # The first capture (the slowest: the job's profiler starts up) while the history grows.
        record = live.capture()
        assert record["gpu"] == CAPTURE_GPU and jax.pid in record["pids"], record
        # Enough history for rates over RATE_INTERVAL, the Xid, and both alerts firing.
        prometheus.wait_for("count_over_time(gpu_energy_joules_total[1m]) >= 8", count=4)
        prometheus.wait_for("gpu_xid_errors_total")
        prometheus.wait_for("gpuscope_alert_firing", count=2)
        prometheus.wait_for('gpuscope_captures_total{outcome="captured"}', timeout=30)
        prometheus.wait_for("gpuscope_capture_last_timestamp_seconds", timeout=30)
        yield live


@pytest.mark.e2e
def test_the_variables_list_the_simulated_node(live: Live) -> None:
    def label_values(label: str, match: str) -> list[str]:
        values: list[str] = live.api(f"/api/v1/label/{label}/values", **{"match[]": match})
        return values

    assert label_values("job", "gpuscope_build_info") == ["gpuscope"]
    assert label_values("instance", 'gpuscope_build_info{job=~"gpuscope"}') == [live.instance]
    gpus = label_values("gpu", f'gpu_info{{job=~"gpuscope", instance=~"{live.instance}"}}')
    assert gpus == ["0", "1", "2", "3", "4"]


@pytest.mark.e2e
@pytest.mark.parametrize("query", QUERIES, ids=lambda q: q.id)
def test_query_returns_data_from_a_real_prometheus(live: Live, query: Query) -> None:
    if reads_captures(query):
        live.recent_capture()
    expr = substitute(query.expr, live.instance)
    now = time.time()
    if query.instant:
        result = live.api("/api/v1/query", query=expr, time=f"{now:.3f}")["result"]
    else:
        result = live.api("/api/v1/query_range", query=expr, start=f"{now - RANGE_SECONDS:.3f}",
                          end=f"{now:.3f}", step="1")["result"]
    assert result, f"no data for {expr}"
