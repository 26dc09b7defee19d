"""Which tool opens a downloaded capture, by trace format.

- XSpace (``*.xplane.pb``, TensorFlow/JAX) lies in TensorBoard's ``plugins/profile/<run>/`` layout: the
  download directory is a logdir for TensorBoard with the profile plugin, or for XProf.
- PyTorch's Kineto traces (``*.pt.trace.json``, gzipped or not) are Chrome trace-event JSON: Perfetto's
  web UI and chrome://tracing open the file itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

XSPACE_SUFFIX = ".xplane.pb"
KINETO_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz")
MAX_NAMED_FILES = 3  # more Kineto traces than this are named by their pattern


def viewer_hints(written: Sequence[str], out_dir: Path) -> list[str]:
    """One line per trace format among ``written`` (paths relative to ``out_dir``): how to view it."""
    lines = []
    if any(name.endswith(XSPACE_SUFFIX) for name in written):
        lines.append(f"view the XSpace trace: tensorboard --logdir {out_dir}  (with the profile plugin: pip "
                     f"install tensorboard-plugin-profile), or xprof --logdir={out_dir}")
    kineto = [name for name in written if name.endswith(KINETO_SUFFIXES)]
    if kineto:
        files = (", ".join(str(out_dir / name) for name in kineto) if len(kineto) <= MAX_NAMED_FILES
                 else f"{out_dir}/**/*.pt.trace.json*")
        lines.append(f"view the PyTorch trace: open {files} in https://ui.perfetto.dev (or chrome://tracing)")
    return lines
