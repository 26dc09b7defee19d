"""The CLI's hints name the command the way the user ran it: plain `gpuscope` only where that name finds
this same program on PATH; otherwise the console script's path or `python -m gpuscope`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpuscope
from gpuscope.cli.invocation import command_name
from gpuscope.cli.local_agent import no_nvml_hints

VENV_SCRIPT = Path(sys.executable).parent / "gpuscope"


def never(_: str) -> str | None:
    return None


def test_plain_gpuscope_only_where_path_finds_this_program(tmp_path: Path) -> None:
    script = tmp_path / "bin" / "gpuscope"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    other = tmp_path / "elsewhere" / "gpuscope"
    other.parent.mkdir()
    other.write_text("#!/bin/sh\n")
    assert command_name(str(script), "python3", which=lambda _: str(script)) == "gpuscope"
    assert command_name(str(script), "python3", which=never) == str(script)
    assert command_name(str(script), "python3", which=lambda _: str(other)) == str(script), \
        "another gpuscope on PATH is not this one"
    assert command_name(".venv/bin/gpuscope", "python3", which=never) == ".venv/bin/gpuscope"
    spaced = tmp_path / "my tools" / "gpuscope"
    assert command_name(str(spaced), "python3", which=never) == f"'{spaced}'", "pasteable into a shell"


def test_python_dash_m_is_named_with_the_interpreter_as_typed_or_its_full_path() -> None:
    main = str(Path(gpuscope.__file__).parent / "__main__.py")
    assert command_name("/elsewhere/pytest/__main__.py", "python3", which=never) == "gpuscope", \
        "another program's __main__"
    assert command_name(main, ".venv/bin/python", which=never) == ".venv/bin/python -m gpuscope"
    assert command_name(main, "python3", which=lambda _: sys.executable) == "python3 -m gpuscope"
    assert command_name(main, "python3", which=never) == f"{sys.executable} -m gpuscope"


def test_a_hint_names_the_script_the_user_ran(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = tmp_path / "gpuscope"
    monkeypatch.setattr(sys, "argv", [str(script)])
    monkeypatch.setenv("PATH", "/nonexistent")
    (hint,) = no_nvml_hints(None)
    assert f"`{script} scenarios` lists them" in hint


@pytest.mark.parametrize("how", ["module", "script"])
def test_usage_lines_name_the_command_as_run(how: str) -> None:
    if how == "script" and not VENV_SCRIPT.exists():
        pytest.skip("no gpuscope console script beside this interpreter")
    argv = [sys.executable, "-m", "gpuscope"] if how == "module" else [str(VENV_SCRIPT)]
    # PATH without the virtualenv: `gpuscope` would not run this program.
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    result = subprocess.run([*argv, "captures"], capture_output=True, text=True, env=env, timeout=60,
                            check=False)
    assert result.returncode == 2
    expected = f"{sys.executable} -m gpuscope" if how == "module" else str(VENV_SCRIPT)
    assert result.stderr.startswith(f"usage: {expected} captures"), result.stderr
