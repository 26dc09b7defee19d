"""Shared plumbing of the fake NVML library: ctypes argument helpers, the state every C function
sees, and the decorators that give each function NVML's preconditions (init, handle, lost GPU).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import Any

import pynvml

from gpuscope.simulate.model import GpuModel
from gpuscope.simulate.scenario import Scenario

OK: int = pynvml.NVML_SUCCESS
# nvmlReturn_t values, typed (pynvml itself is untyped).
ARGUMENT_VERSION_MISMATCH: int = pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
DRIVER_NOT_LOADED: int = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
GPU_IS_LOST: int = pynvml.NVML_ERROR_GPU_IS_LOST
INSUFFICIENT_SIZE: int = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
INVALID_ARGUMENT: int = pynvml.NVML_ERROR_INVALID_ARGUMENT
NOT_FOUND: int = pynvml.NVML_ERROR_NOT_FOUND
NOT_SUPPORTED: int = pynvml.NVML_ERROR_NOT_SUPPORTED
NO_DATA: int = pynvml.NVML_ERROR_NO_DATA
NO_PERMISSION: int = pynvml.NVML_ERROR_NO_PERMISSION
TIMEOUT: int = pynvml.NVML_ERROR_TIMEOUT
UNINITIALIZED: int = pynvml.NVML_ERROR_UNINITIALIZED
UNKNOWN: int = pynvml.NVML_ERROR_UNKNOWN
_FAILURES = {
    "unknown": UNKNOWN,
    "not_supported": NOT_SUPPORTED,
    "timeout": TIMEOUT,
    "no_permission": NO_PERMISSION,
    "gpu_is_lost": GPU_IS_LOST,
    "no_data": NO_DATA,
}


class Return(Exception):
    """Not an error: an early nvmlReturn_t from a helper, returned by the decorators below."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def value_of(arg: Any) -> int:
    """A C integer argument: pynvml passes ``c_uint(x)`` objects, or plain ints to a few functions."""
    return int(getattr(arg, "value", arg))


def address(pointer: Any) -> int | None:
    """The address an opaque handle (a ctypes POINTER) holds; None for NULL."""
    if pointer is None:
        return None
    value: int | None = ctypes.cast(pointer, ctypes.c_void_p).value
    return value


def set_pointer(target: Any, where: int) -> None:
    """Store an address into a pointer object that pynvml passed by reference (an out-handle)."""
    ctypes.c_void_p.from_buffer(target).value = where


class Opaque:
    """Distinct non-NULL addresses for handed-out handles: each points at a small buffer we keep."""

    def __init__(self) -> None:
        self._buffers: dict[int, ctypes.Array[ctypes.c_char]] = {}

    def new(self) -> int:
        buffer = ctypes.create_string_buffer(8)
        self._buffers[ctypes.addressof(buffer)] = buffer
        return ctypes.addressof(buffer)

    def free(self, where: int) -> None:
        self._buffers.pop(where, None)


class LibState:
    """What every fake C function can see. One re-entrant lock guards all of it, because a sampler
    thread and an event thread call concurrently; ``cond`` lets a blocked EventSetWait release it."""

    def __init__(self, scenario: Scenario, gpus: list[GpuModel], clock: Callable[[], float]) -> None:
        self.scenario = scenario
        self.gpus = gpus
        self.clock = clock
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.initialized = 0  # nvmlInit reference count, as the real library keeps one
        self.closed = False
        self.opaque = Opaque()
        self._handles = [self.opaque.new() for _ in gpus]
        self._by_address = dict(zip(self._handles, gpus, strict=True))

    def handle_address(self, gpu: GpuModel) -> int:
        return self._handles[gpu.index]

    def gpu_of(self, handle: Any) -> GpuModel:
        gpu = self._by_address.get(address(handle) or 0)
        if gpu is None:
            raise Return(INVALID_ARGUMENT)
        return gpu

    def close(self) -> None:
        """Uninstalled: every later call fails as uninitialised; blocked waits return at once."""
        with self.cond:
            self.closed = True
            self.initialized = 0
            self.cond.notify_all()


def api(fn: Callable[..., int]) -> Callable[..., int]:
    """A C function: runs under the lock, and needs nvmlInit unless it is nvmlInitWithFlags."""

    @functools.wraps(fn)
    def call(self: LibState, *args: Any) -> int:
        with self.lock:
            if self.initialized <= 0 and fn.__name__ != "nvmlInitWithFlags":
                return UNINITIALIZED
            try:
                return fn(self, *args)
            except Return as early:
                return early.code

    return call


def device_api(fn: Callable[..., int]) -> Callable[..., int]:
    """A per-device C function: resolves the handle and applies lost windows and injected failures.

    The decorated method receives ``(self, gpu, t, *rest)``, t being the scenario time of the call.
    """

    @api
    @functools.wraps(fn)
    def call(self: LibState, handle: Any, *args: Any) -> int:
        gpu = self.gpu_of(handle)
        t = self.clock()
        if gpu.lost(t):
            return GPU_IS_LOST
        failure = gpu.failure(fn.__name__, t)
        if failure is not None:
            return _FAILURES[failure]
        return fn(self, gpu, t, *args)

    return call
