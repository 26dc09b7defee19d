"""gpuscope: an always-on per-node GPU telemetry agent."""

from gpuscope.version import __version__

__all__ = ["__version__"]
