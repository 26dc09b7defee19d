"""The agent's version, single source for packaging and gpuscope_build_info."""

__version__ = "0.1.0"
