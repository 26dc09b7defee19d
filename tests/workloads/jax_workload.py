"""A JAX job with a profiler server, for the capture tests: `python jax_workload.py PORT [--idle]`.

Starts jax.profiler.start_server(PORT), then runs a small jitted loop of matmuls on the CPU forever
(or, with --idle, does nothing), and prints "ready" once the server is up and the loop has run.
Exits when its standard input closes, so that it never outlives the test that started it.
"""

from __future__ import annotations

import os
import sys
import threading


def exit_when_stdin_closes() -> None:
    sys.stdin.read()
    os._exit(0)


def main() -> None:
    port = int(sys.argv[1])
    idle = "--idle" in sys.argv[2:]
    threading.Thread(target=exit_when_stdin_closes, daemon=True).start()

    import jax
    import jax.numpy as jnp

    jax.profiler.start_server(port)

    @jax.jit
    def gpuscope_matmul_step(x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ x) * 0.5

    x = jnp.ones((128, 128), dtype=jnp.float32) / 128
    if not idle:
        x = gpuscope_matmul_step(x).block_until_ready()  # compiled before "ready"
    print("ready", flush=True)
    if idle:
        threading.Event().wait()
    while True:
        x = gpuscope_matmul_step(x).block_until_ready()


if __name__ == "__main__":
    main()
