"""Modules imported when first used, not when their user is imported.

gRPC and the generated protobuf modules cost the agent some 20 MiB and seven threads; a node that never
takes a capture, has no kubelet and whose control API nobody calls should not pay for them. A module
that needs them names them through ``lazy_module`` (and imports them for real under TYPE_CHECKING, so
the type checker still sees them); the first attribute read imports the module.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _LazyModule:
    __slots__ = ("_module", "_name")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attribute: str) -> Any:
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attribute)

    def __repr__(self) -> str:
        state = "imported" if self._module is not None else "not imported yet"
        return f"<lazy module {self._name!r}, {state}>"


def lazy_module(name: str) -> Any:
    """A stand-in for ``import name`` that imports it at the first attribute read."""
    return _LazyModule(name)
