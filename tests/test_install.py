"""The ways to install gpuscope, each as a user would take it: a wheel and an sdist built from a clean
copy of the tree (the wheel built from the sdist, so the sdist is complete), `pipx install` of that
wheel into a private pipx home, and the training job's side (`gpuscope.workload.serve`), which needs
only grpcio and protobuf besides the job's own PyTorch.

The pipx test resolves the package's dependencies from the package index, as a user's pipx does; the
others run offline.
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from capturing import require_torch
from installing import isolated_venv, source_copy, source_modules

# Distributions of the agent that the training job's side must not need.
AGENT_ONLY = ("pydantic", "pydantic_core", "psutil", "prometheus_client", "pynvml",
              "yaml", "bcrypt")


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``python -m build``: the sdist from a copy of the tracked files, then the wheel from the sdist."""
    tmp = tmp_path_factory.mktemp("build")
    src = source_copy(tmp)
    out = tmp / "dist"
    # --no-isolation: the build backend is the one installed for the tests, so the build runs offline.
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                           capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    yield out


def only(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, found
    return found[0]


def declared_dependencies() -> list[str]:
    """The runtime dependencies of pyproject.toml, as the installation running the tests holds them."""
    return [dep for dep in importlib.metadata.requires("gpuscope") or [] if "extra ==" not in dep]


def test_the_sdist_holds_the_sources_license_and_scenarios(dist: Path) -> None:
    sdist = only(dist, "gpuscope-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for required in ("pyproject.toml", "README.md", "LICENSE", "agent/cli/main.py", "agent/workload.py",
                     "agent/simulate/scenarios/demo.yaml", "exporters/exposition.py"):
        assert required in names, f"{required} is missing from {sdist.name}"


def test_the_wheel_holds_every_module_its_metadata_and_the_license(dist: Path) -> None:
    wheel = only(dist, "gpuscope-*-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(name.split("/")[0] for name in names if name.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    modules = {name[:-3].replace("/", ".").removesuffix(".__init__") for name in names
               if name.endswith(".py") and not name.startswith(info)}
    assert modules == source_modules()
    assert "gpuscope/simulate/scenarios/demo.yaml" in names and "gpuscope/py.typed" in names
    assert any(name.startswith(info) and name.endswith("/LICENSE") for name in names), sorted(names)
    assert "Apache" in (metadata.get("License-Expression") or metadata.get("License") or "")
    runtime = [dep for dep in metadata.get_all("Requires-Dist") or [] if "extra ==" not in dep]
    assert sorted(runtime) == sorted(declared_dependencies())
    assert "gpuscope = gpuscope.cli.main:main" in entry_points


def test_pipx_installs_the_wheel_as_a_working_command(dist: Path, tmp_path: Path) -> None:
    pipx = shutil.which("pipx", path=str(Path(sys.executable).parent)) or shutil.which("pipx")
    if pipx is None:
        if os.environ.get("CI"):
            pytest.fail("pipx is not installed; it is in the test extra of pyproject.toml")
        pytest.skip("pipx is not installed (pip install -e '.[test]')")
    env = {**os.environ, "PIPX_HOME": str(tmp_path / "pipx"), "PIPX_BIN_DIR": str(tmp_path / "bin"),
           "PIPX_MAN_DIR": str(tmp_path / "man"), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("VIRTUAL_ENV", None)
    installed = subprocess.run([pipx, "install", str(only(dist, "gpuscope-*.whl"))], env=env,
                               capture_output=True, text=True, timeout=600, check=False)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    command = tmp_path / "bin" / "gpuscope"
    # The command runs from pipx's own environment: a simulated node sampled end to end.
    snapshot = subprocess.run([str(command), "snapshot", "--json", "--simulate", "demo"], cwd=tmp_path,
                              env={key: value for key, value in env.items() if key != "PYTHONPATH"},
                              capture_output=True, text=True, timeout=120, check=False)
    assert snapshot.returncode == 0, snapshot.stderr
    document = json.loads(snapshot.stdout)
    assert len(document["gpus"]) == 4
    python = Path(os.path.realpath(command)).parent / "python"
    where = subprocess.run([str(python), "-c", "import gpuscope; print(gpuscope.__file__)"],
                           capture_output=True, text=True, timeout=60, check=False).stdout.strip()
    assert Path(where).is_relative_to(tmp_path / "pipx"), where


# Run in the job's environment: the agent's own dependencies are made unimportable, then a PyTorch
# loop is served and profiled through the Profile RPC, as the agent would.
JOB_SIDE = """
import importlib.abc, sys
blocked = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not installed in the job)")
        return None

sys.meta_path.insert(0, Block())
import threading, grpc, torch
import gpuscope.workload
from gpuscope.generated.tsl import profiler_service_pb2, profiler_service_pb2_grpc
server = gpuscope.workload.serve(port=0, host="127.0.0.1")
replies = []
done = threading.Event()

def profile():  # the agent's side; the job trains in its main thread, as jobs do
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = profiler_service_pb2_grpc.ProfilerServiceStub(channel)
            replies.append(stub.Profile(profiler_service_pb2.ProfileRequest(duration_ms=300), timeout=60))
    finally:
        done.set()

client = threading.Thread(target=profile)
client.start()
x = torch.randn(64, 64)
while not done.is_set():
    x = torch.relu(x @ x).clamp(max=1.0)
    gpuscope.workload.step()  # no optimizer here: the loop says where a step ends
client.join()
server.stop()
reply = replies[0]
loaded = sorted(name for name in sys.modules if name.split(".")[0] in blocked)
print(len(reply.tool_data), reply.empty_trace, ",".join(loaded), sep="|")
"""


def test_the_job_side_needs_only_grpc_and_protobuf(dist: Path, tmp_path: Path) -> None:
    """``pip install --no-deps gpuscope-*.whl grpcio protobuf`` into a training image is enough for
    ``gpuscope.workload.serve``: the agent's own dependencies are never imported."""
    require_torch()
    python = isolated_venv(tmp_path / "job")
    wheel = only(dist, "gpuscope-*.whl")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                                "--no-deps", "--disable-pip-version-check", str(wheel)],
                               capture_output=True, text=True, timeout=300, check=False)
    assert installed.returncode == 0, installed.stderr
    done = subprocess.run([str(python), "-I", "-c", JOB_SIDE, ",".join(AGENT_ONLY)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    tool_data, empty, loaded = done.stdout.strip().splitlines()[-1].split("|")
    assert int(tool_data) >= 1 and empty == "False", done.stdout
    assert loaded == "", f"the job side imported the agent's dependencies: {loaded}"
