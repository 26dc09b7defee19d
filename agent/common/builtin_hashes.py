"""Python's own hash functions for the ``gpuscope`` command, instead of OpenSSL's.

pydantic imports ``secrets``, which imports ``hmac`` and ``hashlib``; ``hashlib`` loads ``_hashlib``,
which maps OpenSSL's libcrypto: 3.3-3.5 MiB of RSS in the agent (relocated data and the code the
loader touches), a fifteenth of its steady footprint, for hashes it uses a few times a day (the
basic-auth cache key, a token comparison). Without ``_hashlib`` the two modules use the interpreter's
own implementations (md5, sha1, sha2, sha3, blake2: the same digests; ``hmac.compare_digest`` is the
same constant-time comparison), so ``prefer_builtin_hashes`` imports them while ``_hashlib`` cannot
be imported, then lets it be importable again: a later user of OpenSSL (``ssl`` for TLS) loads it
as before, and pays for it only then.

It runs before anything else the command line imports (``gpuscope.cli``), and only there: a program
that imports gpuscope as a library keeps its own hashlib.
"""

from __future__ import annotations

import sys


def prefer_builtin_hashes() -> None:
    """Import ``hashlib`` and ``hmac`` without OpenSSL, unless something imported them already."""
    if "hashlib" in sys.modules or "hmac" in sys.modules or "_hashlib" in sys.modules:
        return
    sys.modules["_hashlib"] = None  # type: ignore[assignment]  # makes `import _hashlib` fail
    try:
        import hashlib  # noqa: F401
        import hmac  # noqa: F401
    finally:
        del sys.modules["_hashlib"]
