"""The ``gpuscope`` command line, one module per command group."""

from gpuscope.common.builtin_hashes import prefer_builtin_hashes

# Before the commands' imports (pydantic's import hashlib): see gpuscope.common.builtin_hashes.
prefer_builtin_hashes()
