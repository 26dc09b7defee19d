"""The layering of CONTRIBUTING.md ("What a change must keep"), checked on the import statements: the
exporters sit below the HTTP side (web/ imports them to serve /metrics), so no module under exporters/
imports gpuscope.web, nor the wiring above it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Packages above the exporters: the HTTP side and the wiring that starts everything.
ABOVE_EXPORTERS = ("gpuscope.web", "gpuscope.agent", "gpuscope.cli")


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (an import inside a function counts too)."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def test_imported_modules_sees_imports_anywhere_in_a_module(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import gpuscope.web.app\ndef f():\n    from gpuscope import web\n")
    assert {"gpuscope.web.app", "gpuscope.web"} <= imported_modules(module)


def test_no_exporter_imports_the_web_side_or_the_wiring() -> None:
    sources = sorted((ROOT / "exporters").rglob("*.py"))
    assert sources, "no exporters found"
    upward = {
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sources for module in imported_modules(path)
        if any(module == above or module.startswith(above + ".") for above in ABOVE_EXPORTERS)
    }
    assert not upward, sorted(upward)
