"""JAX training jobs with a known bottleneck, for bench/gpu_scenarios.py (not run by themselves).

    python bench/gpu_jobs/jax_jobs.py JOB --port PORT [--tiny] [--max-seconds S]

Each starts ``jax.profiler.start_server(PORT)`` (the agent captures it on a port listed in
``capture.profiler_ports``), runs forever on JAX's default device (``--tiny``: small sizes; the
scenario script sets ``JAX_PLATFORMS``), and prints its step time and "ready" as
bench/gpu_jobs/job_loop.py describes.

* ``jax_python_generator``: a jitted step (forward, backward and SGD update) of an 8-layer MLP of
  8192x8192 weights, fed by a Python generator that makes each batch with NumPy on the host
  (``params = train_step(params, next(batches))``). The batch takes tens of milliseconds to make;
  the step, a few on a datacenter GPU: the device waits for the host.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
from job_loop import WallClock, exit_with_parent, info, job_arguments, run_forever

JOBS = ("jax_python_generator",)


def jax_python_generator(tiny: bool) -> Any:
    import jax
    import jax.numpy as jnp

    width, depth, batch = (256, 8, 32) if tiny else (8192, 8, 256)
    keys = jax.random.split(jax.random.PRNGKey(0), depth)
    params = [jax.random.normal(key, (width, width), jnp.float32) / np.sqrt(width) for key in keys]

    def loss_fn(weights: list[Any], x: Any) -> Any:
        for w in weights:
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    # Donating the weights lets XLA update them in place: 2 GiB of fp32 weights, not twice that.
    @partial(jax.jit, donate_argnums=0)
    def train_step(weights: list[Any], x: Any) -> list[Any]:
        grads = jax.grad(loss_fn)(weights, x)
        return [w - 1e-3 * g for w, g in zip(weights, grads, strict=True)]

    def batches() -> Iterator[np.ndarray]:
        """Each batch drawn and normalised in NumPy, as a data pipeline written in plain Python does:
        the work runs on the thread that dispatches the steps, between them."""
        rng = np.random.default_rng(0)
        while True:
            x = rng.standard_normal((batch, width), dtype=np.float32)
            for _ in range(4):
                x = (x - x.mean(axis=1, keepdims=True)) / (x.std(axis=1, keepdims=True) + 1e-6)
            yield x

    data = batches()
    state = {"params": params}

    def step() -> None:
        # No block_until_ready: JAX dispatches asynchronously, as a training loop does.
        state["params"] = train_step(state["params"], next(data))

    return step


def main() -> None:
    args = job_arguments(__doc__.splitlines()[0], JOBS)
    exit_with_parent(args.max_seconds)
    import jax

    jax.profiler.start_server(args.port)
    info("jax", jax.__version__)
    info("device", jax.devices()[0].device_kind)
    step = jax_python_generator(args.tiny)
    run_forever(step, WallClock)


if __name__ == "__main__":
    main()
