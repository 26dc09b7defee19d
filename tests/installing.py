"""What the install tests share: a copy of the tracked source tree, the modules it should install,
and virtual environments that do not see the base interpreter's site-packages."""

from __future__ import annotations

import subprocess
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def source_modules() -> set[str]:
    """Every module of the source tree, as it is named once installed."""
    names = set()
    for folder, package in ((ROOT / "agent", "gpuscope"), (ROOT / "exporters", "gpuscope.exporters")):
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.add(".".join((package, *parts)))
    return names


def isolated_venv(env_dir: Path) -> Path:
    """A virtual environment without the base interpreter's site-packages; the dependencies of the
    package are those of the environment running this test."""
    venv.create(env_dir, system_site_packages=False, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site) / "test-dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
    return python
