"""Where traces are found and which reader reads each, by its file name.

A PyTorch trace is a ``*.pt.trace.json`` (often gzipped); a TensorFlow or JAX profile is a
TensorBoard log directory with ``plugins/profile/<run>/<host>.xplane.pb``, beside which JAX also
writes ``<host>.trace.json.gz``, the same events converted: the XSpace is read and that copy is not.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from gpuscope.analysis.errors import DEFAULT_MAX_BYTES, TraceError

if TYPE_CHECKING:
    from gpuscope.analysis.model import Trace

__all__ = ["DEFAULT_MAX_BYTES", "find_traces", "read_trace"]

XSPACE_SUFFIX = ".xplane.pb"
JSON_SUFFIXES = (".json", ".json.gz")
# In a directory, only names that say "trace": a log directory holds other JSON files too.
TRACE_JSON_SUFFIXES = (".trace.json", ".trace.json.gz")
PYTORCH_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz")
# JAX's Chrome-trace copy of the XSpace beside it.
XSPACE_COPY_SUFFIX = ".trace.json.gz"

MAX_TRACES = 64
# Directory entries looked at before giving up: a trace directory is not a whole file system.
MAX_ENTRIES = 200_000


def is_trace_name(name: str) -> bool:
    return name.endswith(XSPACE_SUFFIX) or name.endswith(JSON_SUFFIXES)


def is_trace_in_folder(name: str) -> bool:
    """A file found in a folder that is a trace: in a log directory other JSON files are not."""
    return name.endswith(XSPACE_SUFFIX) or name.endswith(TRACE_JSON_SUFFIXES)


def find_traces(path: Path) -> list[Path]:
    """The trace named, or the traces under a directory (the ``MAX_TRACES`` newest), sorted."""
    if path.is_dir():
        return traces_under(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory")
    if not is_trace_name(path.name):
        raise TraceError(f"not a trace file: {path} (expected .pt.trace.json[.gz] or .xplane.pb)")
    return [path]


def traces_under(directory: Path) -> list[Path]:
    found: list[Path] = []
    entries = 0
    for folder, subfolders, files in os.walk(directory):  # does not follow symlinked folders
        entries += len(subfolders) + len(files)
        if entries > MAX_ENTRIES:
            raise TraceError(f"{directory}: more than {MAX_ENTRIES} files and folders to search for "
                             "traces; name the folder of the profile")
        found.extend(traces_in_folder(Path(folder), files))
    if not found:
        raise TraceError(f"{directory}: no trace files under it "
                         "(expected .pt.trace.json[.gz] or .xplane.pb)")
    if len(found) > MAX_TRACES:
        found = sorted(found, key=modified, reverse=True)[:MAX_TRACES]
    return sorted(found)


def traces_in_folder(folder: Path, files: list[str]) -> list[Path]:
    """The trace files of one folder, symlinks and JAX's copies of an XSpace left out."""
    has_xspace = any(name.endswith(XSPACE_SUFFIX) for name in files)
    traces = []
    for name in files:
        if not is_trace_in_folder(name):
            continue
        if has_xspace and name.endswith(XSPACE_COPY_SUFFIX) and not name.endswith(PYTORCH_SUFFIXES):
            continue
        path = folder / name
        if not path.is_symlink():
            traces.append(path)
    return traces


def modified(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:  # removed since the walk
        return 0.0


def read_trace(path: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Trace:
    """The trace in one file, read by the reader its name calls for (imported then: naming traces, as
    the agent's capture analysis does, needs no reader, nor protobuf)."""
    if path.name.endswith(XSPACE_SUFFIX):
        from gpuscope.analysis.xspace import read_xspace

        return read_xspace(path, max_bytes=max_bytes)
    if path.name.endswith(JSON_SUFFIXES):
        from gpuscope.analysis.kineto_json import read_kineto

        return read_kineto(path, max_bytes=max_bytes)
    raise TraceError(f"not a trace file: {path} (expected .pt.trace.json[.gz] or .xplane.pb)")
