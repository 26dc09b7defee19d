"""The NVML boundary: ``boundary`` is the only module of the agent that imports ``pynvml``.

Nothing is imported here, so that the pure modules of this package (``clock_events``,
``readings``) load without the NVML bindings.
"""
