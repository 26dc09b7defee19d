"""Shared plumbing of the fake NVML library: ctypes argument helpers, the state every C function
sees, and the decorators that give each function NVML's preconditions (init, handle, lost GPU).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
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
HANG_POLL_S = 0.02


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
        # The same map keyed by the bytes of a device handle (a pointer's value, native order):
        # bytes(handle) costs a fifth of ctypes.cast(handle, c_void_p).value, on every device call.
        self._by_pointer_bytes = {
            where.to_bytes(ctypes.sizeof(ctypes.c_void_p), sys.byteorder): gpu
            for where, gpu in self._by_address.items()
        }
        # MIG devices' handles: address -> (parent GPU, MIG device index).
        self.mig_handles: dict[tuple[int, int], int] = {
            (gpu.index, i): self.opaque.new() for gpu in gpus for i in range(len(gpu.spec.mig_devices))}
        self.mig_by_address = {where: key for key, where in self.mig_handles.items()}

    def handle_address(self, gpu: GpuModel) -> int:
        return self._handles[gpu.index]

    def gpu_of(self, handle: Any) -> GpuModel:
        if type(handle) is _DEVICE_HANDLE:  # what pynvml passes: the fast path
            gpu = self._by_pointer_bytes.get(bytes(handle))
            if gpu is not None:
                return gpu
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
    It runs under the lock and needs nvmlInit, as with ``api`` (one wrapper instead of two: these
    run some twenty times per GPU per sampler tick).
    """
    name = fn.__name__

    @functools.wraps(fn)
    def call(self: LibState, handle: Any, *args: Any) -> int:
        with self.lock:
            if self.initialized <= 0:
                return UNINITIALIZED
            try:
                # gpu_of(), its fast path inlined
                gpu = self._by_pointer_bytes.get(bytes(handle)) if type(handle) is _DEVICE_HANDLE else None
                if gpu is None:
                    mig = self.mig_by_address.get(address(handle) or 0)
                    if mig is not None:  # a MIG device's handle: its own function, if it has one
                        mig_fn = getattr(self, "mig_" + name, None)
                        if mig_fn is None:
                            return NOT_SUPPORTED
                        return int(mig_fn(self.gpus[mig[0]], mig[1], *args))
                    gpu = self.gpu_of(handle)
                t = self.clock()
                if gpu.may_fail:  # the scenario has lost windows or injected failures for this GPU
                    if gpu.lost(t):
                        return GPU_IS_LOST
                    failure = gpu.failure(name, t)
                    if failure == "hang":
                        hanging = gpu
                    elif failure is not None:
                        return _FAILURES[failure]
                    else:
                        return fn(self, gpu, t, *args)
                else:
                    return fn(self, gpu, t, *args)
            except Return as early:
                return early.code
        # A hanging call blocks outside the lock, as a stuck device blocks only its own calls, until
        # its window ends; then it answers as usual.
        while hanging.failure(name, self.clock()) == "hang":
            time.sleep(HANG_POLL_S)
        return call(self, handle, *args)

    return call


# ---------------------------------------------------------------- filling pynvml's structures

_DEVICE_HANDLE = pynvml.c_nvmlDevice_t
_INT_CODES = {1: "b", 2: "h", 4: "i", 8: "q"}


def _field(ctype: Any, path: str) -> tuple[int, Any]:
    """(offset, ctypes type) of a possibly nested field such as ``"sampleValue.uiVal"``."""
    offset = 0
    for name in path.split("."):
        descriptor = getattr(ctype, name)
        offset += descriptor.offset
        ctype = dict((f[0], f[1]) for f in ctype._fields_)[name]
    return offset, ctype


def _code(ctype: Any) -> str:
    """The struct module's code for a simple ctypes type (standard sizes, as in a '=' format)."""
    kind = getattr(ctype, "_type_", None)
    size = ctypes.sizeof(ctype)
    if isinstance(ctype, type) and issubclass(ctype, (ctypes._Pointer, ctypes.c_void_p)):
        kind = "Q" if size == 8 else "I"  # a pointer, read as the address it holds
    if kind in ("f", "d"):
        return str(kind)
    if not isinstance(kind, str) or kind not in "bBhHiIlLqQ" or size not in _INT_CODES:
        raise TypeError(f"not a simple integer or float ctypes type: {ctype!r}")
    code = _INT_CODES[size]
    return code if kind.islower() else code.upper()


class Packer:
    """Writes (and reads) chosen fields of pynvml structures as the C library does: as memory.

    pynvml's structures get and set each field through Python ``__getattribute__``/``__setattr__``
    overrides; a driver writes bytes. A Packer does that with the struct module, at the offsets ctypes
    gives the type (read from the type itself; native byte order). ``paths`` name the fields in
    increasing offset order (``"value.ullVal"`` for a union member). Only the bytes from the first to
    the last chosen field are written, and a gap between them must be padding (checked here), so no
    other field changes. ``zeroed`` names top-level fields that ``fill`` sets to 0 (they are then
    written as zero bytes, which is what 0 is for an integer or float field). Anything but an instance
    (or array) of exactly ``ctype``, or a value out of a field's range, takes the attribute path,
    where ctypes' own conversions decide.
    """

    def __init__(self, ctype: Any, *paths: str, zeroed: tuple[str, ...] = ()) -> None:
        self.ctype, self.paths, self.size = ctype, paths, ctypes.sizeof(ctype)
        self.zeroed = zeroed
        fields = [_field(ctype, p) for p in paths]
        self.offset = fields[0][0]
        fmt, at = "", self.offset
        for offset, ftype in fields:
            if offset < at:
                raise TypeError(f"{ctype.__name__}: {paths} are not in increasing offset order")
            if offset > at and _any_field_in(ctype, at, offset):
                raise TypeError(f"{ctype.__name__}: a field lies between those of {paths}")
            fmt += f"{offset - at}x" * (offset > at) + _code(ftype)
            at = offset + ctypes.sizeof(ftype)
        self._struct = struct.Struct("=" + fmt)
        # Whole elements: every byte outside the chosen fields is padding or a zeroed field, so an
        # array can be written with one pack_into of n elements (padding written as zeros, as fresh
        # memory has it).
        for name in zeroed:
            _code(_field(ctype, name)[1])  # a simple type, for which zero bytes are 0
        others = [(o, s) for o, s in _named_ranges(ctype)
                  if not any(getattr(ctype, name).offset == o for name in zeroed)]
        whole = (all("." not in p for p in paths) and not _any_range_in(others, 0, self.offset)
                 and not _any_range_in(others, at, self.size))
        self._element_fmt: str | None = None
        if whole:
            head, tail = self.offset, self.size - at
            self._element_fmt = f"{head}x" * (head > 0) + fmt + f"{tail}x" * (tail > 0)
        self._arrays: dict[int, struct.Struct] = {}

    def fill(self, array: Any, rows: Sequence[Sequence[Any]]) -> None:
        """Element i of ``array`` gets ``rows[i]`` (values in ``paths`` order)."""
        fast = getattr(type(array), "_type_", None) is self.ctype and len(rows) <= len(array)
        if fast and self._element_fmt is not None and rows:
            packer = self._arrays.get(len(rows))
            if packer is None:
                if len(self._arrays) > 64:
                    self._arrays.clear()
                packer = self._arrays[len(rows)] = struct.Struct("=" + self._element_fmt * len(rows))
            try:
                packer.pack_into(array, 0, *itertools.chain.from_iterable(rows))
                return
            except struct.error:  # a value out of its field's range: row by row below
                pass
        for i, row in enumerate(rows):
            if fast:
                try:
                    self._struct.pack_into(array, i * self.size + self.offset, *row)
                    if self.zeroed:
                        self._set_attributes(array[i], [0] * len(self.zeroed), self.zeroed)
                    continue
                except struct.error:
                    pass
            self._set_attributes(array[i], row)
            if self.zeroed:
                self._set_attributes(array[i], [0] * len(self.zeroed), self.zeroed)

    def set(self, target: Any, *values: Any) -> None:
        """One structure (the ``_obj`` of a byref argument) gets ``values``."""
        if type(target) is self.ctype:
            try:
                self._struct.pack_into(target, self.offset, *values)
                return
            except struct.error:
                pass
        self._set_attributes(target, values)

    def set_at(self, array: Any, index: int, *values: Any) -> None:
        """Element ``index`` of ``array`` gets ``values``."""
        if getattr(type(array), "_type_", None) is self.ctype and 0 <= index < len(array):
            try:
                self._struct.pack_into(array, index * self.size + self.offset, *values)
                return
            except struct.error:
                pass
        self._set_attributes(array[index], values)

    def read(self, target: Any) -> tuple[Any, ...]:
        """The chosen fields of one structure, in ``paths`` order."""
        if type(target) is self.ctype:
            return self._struct.unpack_from(target, self.offset)
        return tuple(self._get_attribute(target, path) for path in self.paths)

    def read_at(self, array: Any, index: int) -> tuple[Any, ...]:
        """The chosen fields of element ``index`` of ``array``."""
        if getattr(type(array), "_type_", None) is self.ctype and 0 <= index < len(array):
            return self._struct.unpack_from(array, index * self.size + self.offset)
        return tuple(self._get_attribute(array[index], path) for path in self.paths)

    @staticmethod
    def _get_attribute(target: Any, path: str) -> Any:
        for name in path.split("."):
            target = getattr(target, name)
        return target

    def _set_attributes(self, target: Any, values: Sequence[Any], paths: Sequence[str] = ()) -> None:
        for path, value in zip(paths or self.paths, values, strict=True):
            *parents, name = path.split(".")
            obj = target
            for parent in parents:
                obj = getattr(obj, parent)
            setattr(obj, name, value)


def _any_field_in(ctype: Any, start: int, end: int) -> bool:
    """Whether any field of ``ctype`` has a byte in [start, end)."""
    return _any_range_in(_named_ranges(ctype), start, end)


def _any_range_in(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    return any(offset < end and start < offset + size for offset, size in ranges)


def _named_ranges(ctype: Any) -> list[tuple[int, int]]:
    return [(getattr(ctype, f[0]).offset, getattr(ctype, f[0]).size) for f in ctype._fields_]
