"""The NVML boundary. Outside this package nothing imports ``pynvml`` (besides the simulator's fake
library, which installs itself under it): the sampler imports ``boundary`` and ``xid`` only.

Within it, ``boundary`` and the modules it delegates to import ``pynvml``, each for the calls,
constants or structures of its own part of the API: ``errors`` (NVML's error classes, put into
words), ``decoding`` (pynvml's sample arrays, process lists and value types), ``mig`` (MIG device
handles), ``gpm`` (GPM metric ids and samples), ``health`` (violation policies, ECC, NVLink and the
readings as seldom read). None of them is imported from outside the package.

Nothing is imported here, so that the pure modules of this package (``clock_events``,
``readings``) load without the NVML bindings.
"""
