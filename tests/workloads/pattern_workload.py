"""A training job with a known performance problem, for the diagnosis tests:
`python pattern_workload.py {torch|jax} PATTERN PORT`.

PATTERN is what the job's steps suffer from, on the CPU, forever:

* ``slow_input``: each batch takes long to load. PyTorch: a ``DataLoader`` (``num_workers=0``) over a
  dataset whose ``__getitem__`` sleeps 3 ms, 4 items a batch, then a small MLP's forward, backward and
  SGD step. JAX: a Python generator that sleeps 10 ms a batch feeding a jitted step.
* ``sync`` (PyTorch only): batches from memory, and every step reads values back to the host:
  ``loss.item()``, ``torch.nonzero`` and a boolean-mask index.
* ``healthy``: batches from memory, the step alone (no data loader, no read-back).

PyTorch: ``gpuscope.workload.serve(PORT)`` makes the job capturable (0: any free port; it prints
``port N``). JAX: ``jax.profiler.start_server(PORT)``, each iteration (the batch fetched, the step run
to completion) inside ``jax.profiler.StepTraceAnnotation("train", step_num=i)``. Prints ``ready`` once
the loop has run, and exits when its standard input closes, so that it never outlives the test that
started it.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

TORCH_PATTERNS = ("slow_input", "sync", "healthy")
JAX_PATTERNS = ("slow_input", "healthy")
LOAD_ITEM_S = 0.003  # PyTorch slow_input: per item, 4 items a batch
LOAD_BATCH_S = 0.010  # JAX slow_input: per batch


def exit_when_stdin_closes() -> None:
    sys.stdin.read()
    os._exit(0)


def run_torch(pattern: str, port: int) -> None:
    import torch
    from torch.utils.data import DataLoader, Dataset

    torch.manual_seed(0)
    torch.set_num_threads(1)
    # About 3 ms a step of 64 (one thread): enough for the step's own time to dwarf the loop's overhead.
    model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(1024, 256), torch.randint(0, 10, (1024,))

    class SlowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
        """Reads each item slowly, as from a slow disk or with heavy decoding in ``__getitem__``."""

        def __len__(self) -> int:
            return len(inputs)

        def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            time.sleep(LOAD_ITEM_S)
            return inputs[index], targets[index]

    def from_loader() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:  # a new epoch (a new loader iterator) when the last one is exhausted
            yield from DataLoader(SlowDataset(), batch_size=4, shuffle=True, num_workers=0)

    def from_memory() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in itertools.cycle(range(0, len(inputs), 64)):
            yield inputs[start:start + 64], targets[start:start + 64]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        if pattern == "sync":
            total = loss.item()  # a read-back every step, as a logging line does
            positive = torch.nonzero(logits > 0)  # an output shape that depends on the data
            kept = logits[logits > 0]  # a boolean-mask index: the same
            assert total >= 0 and positive.shape[0] == kept.shape[0]

    batches = from_loader() if pattern == "slow_input" else from_memory()
    import gpuscope.workload

    server = gpuscope.workload.serve(port=port, host="127.0.0.1")
    print(f"port {server.port}", flush=True)
    loop(lambda: step(*next(batches)))


def run_jax(pattern: str, port: int) -> None:
    import jax
    import jax.numpy as jnp

    jax.profiler.start_server(port)

    @jax.jit
    def train_step(w: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
        def loss(w: jax.Array) -> jax.Array:
            return jnp.mean((jnp.tanh(x @ w) - y) ** 2)

        return w - 0.01 * jax.grad(loss)(w)

    # 15 to 25 ms a step on the CPU (XLA uses every core): long enough that the loop's own overhead (the
    # jitted call's dispatch and completion, the Python between steps: some 0.25 ms a step, which the
    # diagnosis counts as idle) stays well under 5% of a healthy step.
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    data = [(jax.random.normal(k, (2048, 512)), jax.random.normal(k, (2048, 512))) for k in keys]
    jax.block_until_ready(data)

    def batches() -> Iterator[tuple[jax.Array, jax.Array]]:
        for batch in itertools.cycle(data):
            if pattern == "slow_input":
                time.sleep(LOAD_BATCH_S)  # reading and decoding the batch on the training thread
            yield batch

    source = batches()
    w = jnp.eye(512, dtype=jnp.float32)
    steps = itertools.count()

    def step() -> None:
        nonlocal w
        with jax.profiler.StepTraceAnnotation("train", step_num=next(steps)):
            x, y = next(source)
            w = train_step(w, x, y).block_until_ready()

    loop(step)


def loop(step: Callable[[], None]) -> None:
    for _ in range(3):  # compiled, and the first epoch's loader started, before "ready"
        step()
    print("ready", flush=True)
    while True:
        step()


def main() -> None:
    framework, pattern, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    patterns = TORCH_PATTERNS if framework == "torch" else JAX_PATTERNS if framework == "jax" else ()
    if pattern not in patterns:
        sys.exit(f"usage: pattern_workload.py {{torch {'|'.join(TORCH_PATTERNS)} | "
                 f"jax {'|'.join(JAX_PATTERNS)}}} PORT")
    threading.Thread(target=exit_when_stdin_closes, daemon=True).start()
    (run_torch if framework == "torch" else run_jax)(pattern, port)


if __name__ == "__main__":
    main()
