"""What the agent's process holds: OpenSSL's libcrypto is not loaded for hashes, and glibc's
allocator is set up so that memory freed after a capture goes back to the system.

Each check runs in a fresh interpreter: what an import loads, and the allocator's settings, are
process-wide and must not depend on what the test session imported first."""

from __future__ import annotations

import subprocess
import sys

import pytest

# What `gpuscope run` imports before it builds the agent; then the hashes the agent uses.
NO_OPENSSL = """
import sys
import gpuscope.cli.main, gpuscope.agent, gpuscope.web.basic_auth
import hashlib, hmac, secrets
assert "_hashlib" not in sys.modules, "OpenSSL's hashes were loaded"
assert hashlib.sha256(b"abc").hexdigest().startswith("ba7816bf")
assert hmac.new(b"key", b"message", "sha256").hexdigest().startswith("6e9ef29b")
assert secrets.compare_digest(b"token", b"token") and not secrets.compare_digest(b"token", b"other")
import _hashlib  # still importable by whoever needs OpenSSL (then loaded, as before)
print("ok")
"""

# A capture's pattern: a thread allocates trace-sized buffers and keeps small objects made meanwhile,
# after a larger block was freed earlier in the process (which, by default, moves glibc's mmap
# threshold up, so that these buffers come from the thread's arena and stay there once freed).
CAPTURE_BUFFERS = """
import re, threading
from gpuscope.common.memory import tune_allocator
tune_allocator()

def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

earlier = bytes(16 << 20)
del earlier
kept = []

def capture():
    buffers = []
    for _ in range(16):
        buffers.append(bytes(range(256)) * 4096)  # 1 MiB, written
        kept.append(bytes(range(256)) * 3)
    del buffers

before = rss()
worker = threading.Thread(target=capture)
worker.start()
worker.join()
print((rss() - before) / 2**20)
"""


def run_python(script: str) -> str:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_command_line_hashes_without_openssl() -> None:
    assert run_python(NO_OPENSSL) == "ok"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator, /proc")
def test_buffers_a_thread_freed_go_back_to_the_system() -> None:
    retained_mib = float(run_python(CAPTURE_BUFFERS))
    assert retained_mib < 4, f"{retained_mib:.1f} MiB of 16 MiB freed stayed resident"
