"""The source folders (agent/, exporters/) install as one package, gpuscope, both ways, and the built
package holds every module of the source tree, each of which imports.

The package is installed into a fresh virtual environment that does not see the base interpreter's
site-packages. Its dependencies come from the environment running the tests (a path file pointing
at its site-packages), so the check runs offline and never leans on what the machine's own Python
happens to have installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from installing import isolated_venv, source_copy, source_modules

# Modules that act when imported: `python -m gpuscope` runs the command line.
NOT_IMPORTED = {"gpuscope.__main__"}

CHECK = """
import importlib, json, pkgutil, sys
import gpuscope
skip = set(sys.argv[2:])
failed = {}
def note(name):
    failed[name] = repr(sys.exc_info()[1])
import gpuscope.exporters  # its own folder: an editable install maps it, it is not under gpuscope/
modules = sorted({"gpuscope", "gpuscope.exporters", *(
    m.name for package in (gpuscope, gpuscope.exporters)
    for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".", onerror=note))})
for name in modules:
    if name not in skip:
        try:
            importlib.import_module(name)
        except Exception as err:
            failed[name] = repr(err)
print(json.dumps({"gpuscope": gpuscope.__file__, "modules": modules, "failed": failed,
                  "scenarios": importlib.import_module("gpuscope.simulate").bundled_scenarios(),
                  "version": gpuscope.__version__, "prefix": sys.prefix}))
"""


@pytest.mark.parametrize("editable", [False, True], ids=["wheel", "editable"])
def test_install_holds_and_imports_every_module(tmp_path: Path, editable: bool) -> None:
    src = source_copy(tmp_path)
    env_dir = tmp_path / "venv"
    python = isolated_venv(env_dir)
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
               "--disable-pip-version-check"]
    built = subprocess.run([*install, *(["-e"] if editable else []), str(src)], timeout=300,
                           capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    # -I: isolated mode, so neither the current directory nor PYTHON* variables lend a module.
    done = subprocess.run([str(python), "-I", "-c", "import json,sys; exec(sys.argv[1])", CHECK,
                           *sorted(NOT_IMPORTED)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          check=False)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    where = src if editable else env_dir
    assert Path(found["gpuscope"]).resolve().is_relative_to(where.resolve()), found["gpuscope"]
    assert Path(found["prefix"]).resolve() == env_dir.resolve()
    assert set(found["modules"]) == source_modules(), "a module of the source tree is not installed"
    assert found["failed"] == {}, found["failed"]
    assert "demo" in found["scenarios"] and "bench-8x4" in found["scenarios"]  # package data shipped
    script = subprocess.run([str(env_dir / "bin" / "gpuscope"), "--version"], capture_output=True,
                            text=True, timeout=60, check=False)
    assert script.returncode == 0 and found["version"] in script.stdout, script.stderr
