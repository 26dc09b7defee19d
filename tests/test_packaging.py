"""The brief's folders (agent/, exporters/) install as one package, gpuscope, both ways."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHECK = """
import json, gpuscope, gpuscope.exporters.prometheus, gpuscope.simulate
print(json.dumps({"gpuscope": gpuscope.__file__, "exporters": gpuscope.exporters.__file__,
                  "scenarios": gpuscope.simulate.bundled_scenarios(), "version": gpuscope.__version__}))
"""


def source_copy(tmp_path: Path) -> Path:
    """The tracked files only, so the build sees what a fresh clone has."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    dest = tmp_path / "src"
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        source = ROOT / name
        if source.is_file():
            target.write_bytes(source.read_bytes())
    return dest


@pytest.mark.parametrize("editable", [False, True], ids=["wheel", "editable"])
def test_install_imports_gpuscope_and_its_exporters(tmp_path: Path, editable: bool) -> None:
    src = source_copy(tmp_path)
    env_dir = tmp_path / "venv"
    # System site-packages provide the dependencies offline; the package itself comes from src.
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    python = env_dir / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
               "--disable-pip-version-check"]
    built = subprocess.run([*install, *(["-e"] if editable else []), str(src)], timeout=300,
                           capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    out = subprocess.run([str(python), "-c", "import json,sys; exec(sys.argv[1])", CHECK], check=True,
                         capture_output=True, text=True, timeout=60, cwd=tmp_path).stdout
    found = json.loads(out)
    where = src if editable else env_dir
    assert Path(found["gpuscope"]).resolve().is_relative_to(where.resolve()), found
    assert Path(found["exporters"]).resolve().is_relative_to(where.resolve()), found
    assert "demo" in found["scenarios"] and "bench-8x4" in found["scenarios"]  # package data shipped
    script = subprocess.run([str(env_dir / "bin" / "gpuscope"), "--version"], capture_output=True,
                            text=True, timeout=60, check=False)
    assert script.returncode == 0 and found["version"] in script.stdout
