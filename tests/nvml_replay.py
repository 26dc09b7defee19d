"""Play back an NVML recording (``bench/nvml_record.py``) under the real pynvml.

``ReplayLibrary`` stands where pynvml keeps the loaded library (``pynvml.nvmlLib``) and answers each
C function with what the real library answered when a call with the same arguments was recorded:
it writes the recorded bytes into the buffers passed by reference and returns the recorded code.
Calls are matched by function name and the arguments passed by value (handles, ids, cursors, a null
buffer) plus the sizes of those passed by reference; recorded answers to the same call are given in
their order, the last one again once they run out. A function never recorded does not exist (pynvml
raises FUNCTION_NOT_FOUND, as with an older driver), and a recorded function called with arguments
never recorded answers NVML_ERROR_UNKNOWN and is listed in ``unmatched``, for the test to show.
"""

from __future__ import annotations

import ctypes
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pynvml

FIXTURES = Path(__file__).parent / "fixtures" / "nvml"


def load_recording(name: str) -> dict[str, Any]:
    recording: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    return recording


def _match(arg: Any) -> tuple[Any, ...]:
    """The argument as the recorder described it for matching (see bench/nvml_record.py)."""
    if arg is None:
        return ("null",)
    if isinstance(arg, bool | int):
        return ("int", int(arg))
    if isinstance(arg, bytes):
        return ("bytes", arg.hex())
    if isinstance(arg, str):
        return ("bytes", arg.encode().hex())
    if type(arg).__name__ == "CArgObject":
        return ("ref", ctypes.sizeof(arg._obj))
    if isinstance(arg, ctypes._Pointer):
        if ctypes.sizeof(arg._type_) and arg:
            return ("ref", ctypes.sizeof(arg._type_))
        return ("value", bytes(arg).hex())
    if isinstance(arg, ctypes._SimpleCData):
        return ("value", bytes(arg).hex())
    return ("ref", ctypes.sizeof(arg))


def _target(arg: Any) -> Any:
    """The ctypes object a by-reference argument's recorded bytes go into."""
    if type(arg).__name__ == "CArgObject":
        return arg._obj
    if isinstance(arg, ctypes._Pointer):
        return arg.contents
    return arg


class _ReplayedFunction:
    def __init__(self, library: ReplayLibrary, name: str) -> None:
        self._library = library
        self._name = name
        self.restype: Any = None
        self.argtypes: Any = None

    def __call__(self, *args: Any) -> Any:
        if self._name == "nvmlErrorString":
            return f"NVML error {_match(args[0])[1]} (replayed)".encode()
        key = (self._name, tuple(_match(arg) for arg in args))
        answers = self._library.answers.get(key)
        if not answers:
            self._library.unmatched.append(key)
            return pynvml.NVML_ERROR_UNKNOWN
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        for arg, out in zip(args, answer["out"], strict=True):
            if out is None:
                continue
            target = _target(arg)
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
