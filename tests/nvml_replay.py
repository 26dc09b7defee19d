"""Play back an NVML recording (``bench/nvml_record.py``) under the real pynvml.

``ReplayLibrary`` stands where pynvml keeps the loaded library (``pynvml.nvmlLib``) and answers each
C function with what the real library answered when a call with the same arguments was recorded:
it writes the recorded bytes into the buffers passed by reference and returns the recorded code.
Calls are matched by function name and the arguments as the recorder describes them (its
``describe_argument``: values passed by value, sizes of those passed by reference); recorded
answers to the same call are given in their order, the last one again once they run out. A function
never recorded does not exist (pynvml raises FUNCTION_NOT_FOUND, as with an older driver), and a
recorded function called with arguments never recorded answers NVML_ERROR_UNKNOWN and is listed in
``unmatched``, for the test to show.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pynvml

FIXTURES = Path(__file__).parent / "fixtures" / "nvml"


def load_recording(name: str) -> dict[str, Any]:
    recording: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    return recording


def load_recorder() -> ModuleType:
    """bench/nvml_record.py, whose ``describe_argument`` the replay matches calls with."""
    path = Path(__file__).resolve().parent.parent / "bench" / "nvml_record.py"
    spec = importlib.util.spec_from_file_location("nvml_record", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_describe: Callable[[Any], tuple[list[Any], Any]] = load_recorder().describe_argument


class _ReplayedFunction:
    def __init__(self, library: ReplayLibrary, name: str) -> None:
        self._library = library
        self._name = name
        self.restype: Any = None
        self.argtypes: Any = None

    def __call__(self, *args: Any) -> Any:
        if self._name == "nvmlErrorString":
            return f"NVML error {_describe(args[0])[0][1]} (replayed)".encode()
        described = [_describe(arg) for arg in args]
        key = (self._name, tuple(tuple(match) for match, _ in described))
        answers = self._library.answers.get(key)
        if not answers:
            self._library.unmatched.append(key)
            return pynvml.NVML_ERROR_UNKNOWN
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        for (_, target), out in zip(described, answer["out"], strict=True):
            if out is None:
                continue
            data = bytes.fromhex(out)
            size = ctypes.sizeof(target)
            ctypes.memmove(ctypes.addressof(target), data.ljust(size, b"\0"), size)
        self._library.replayed += 1
        return answer["rc"]


class ReplayLibrary:
    def __init__(self, recording: dict[str, Any]) -> None:
        self.answers: dict[tuple[str, tuple[Any, ...]], list[dict[str, Any]]] = defaultdict(list)
        for call in recording["calls"]:
            key = (call["fn"], tuple(tuple(arg) for arg in call["args"]))
            self.answers[key].append(call)
        self.functions = {call["fn"] for call in recording["calls"]} | {"nvmlErrorString"}
        self.unmatched: list[tuple[str, tuple[Any, ...]]] = []
        self.replayed = 0

    def __getattr__(self, name: str) -> _ReplayedFunction:
        if name.startswith("_") or name not in self.functions:
            raise AttributeError(name)
        return _ReplayedFunction(self, name)


def install(library: ReplayLibrary) -> None:
    with pynvml.libLoadLock:
        pynvml.nvmlLib = library
        pynvml._nvmlGetFunctionPointer_cache.clear()


def uninstall(library: ReplayLibrary) -> None:
    with pynvml.libLoadLock:
        if pynvml.nvmlLib is library:
            pynvml.nvmlLib = None
            pynvml._nvmlLib_refcount = 0
        pynvml._nvmlGetFunctionPointer_cache.clear()
