"""The ``gpuscope`` command line, one module per command group."""
