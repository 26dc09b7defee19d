"""A PyTorch training job for the capture tests: `python torch_workload.py [--serve PORT] [--idle]
[--self-profile] [--many-small-ops] [--train-threads N]`.

Trains a small MLP on the CPU forever (linear layers, matmul, relu, backward, optimizer step) in the
main thread. Started with KINETO_USE_DAEMON=1 in its environment, it polls the Kineto daemon; with
--serve PORT it also calls gpuscope.workload.serve(PORT) (0: any free port) and prints "port N".
--idle does no work; --self-profile keeps torch.profiler running over the loop (the job profiles
itself, so an on-demand capture is busy); --many-small-ops runs small ops back to back, without a
pause, as a launch-bound job does (its traces are large and slow to write: about 700,000 events a
second), calling gpuscope.workload.step() every 100 ops when serving. --train-threads N runs N more
training loops, each on its own thread and model, so that ops run on several threads at once.
Prints "ready" once the loop has run, and exits when its standard input closes, so that it never
outlives the test that started it.
"""

from __future__ import annotations

import os
import sys
import threading
import time


def exit_when_stdin_closes() -> None:
    sys.stdin.read()
    os._exit(0)


def main() -> None:
    args = sys.argv[1:]
    idle = "--idle" in args
    self_profile = "--self-profile" in args
    serve_port = int(args[args.index("--serve") + 1]) if "--serve" in args else None
    train_threads = int(args[args.index("--train-threads") + 1]) if "--train-threads" in args else 0
    threading.Thread(target=exit_when_stdin_closes, daemon=True).start()

    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(32, 64)
    targets = torch.randint(0, 10, (32,))
    projection = torch.randn(64, 64)

    def step() -> None:
        optimizer.zero_grad()
        features = torch.relu(torch.matmul(inputs, projection))
        loss = torch.nn.functional.cross_entropy(model(features), targets)
        loss.backward()
        optimizer.step()

    def train_on_its_own_thread() -> None:
        own = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        own_optimizer = torch.optim.SGD(own.parameters(), lr=0.01)
        while True:
            own_optimizer.zero_grad()
            torch.nn.functional.cross_entropy(own(torch.relu(inputs @ projection)), targets).backward()
            own_optimizer.step()
            time.sleep(0.002)

    if serve_port is not None:
        import gpuscope.workload

        server = gpuscope.workload.serve(port=serve_port, host="127.0.0.1")
        print(f"port {server.port}", flush=True)
    for _ in range(3):
        step()
    for index in range(train_threads):
        threading.Thread(target=train_on_its_own_thread, name=f"train-{index}", daemon=True).start()
    if self_profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            print("ready", flush=True)
            while True:
                step()
                time.sleep(0.05)
    print("ready", flush=True)
    if idle:
        threading.Event().wait()
    if "--many-small-ops" in args:
        small = torch.randn(64, 64)
        while True:
            x = small
            for _ in range(100):
                x = torch.relu(x @ small + 1.0) * 0.5
            if serve_port is not None:  # no optimizer here: the loop says where a step ends
                gpuscope.workload.step()
    while True:
        step()
        time.sleep(0.005)  # leave the CPU to the test and the profiler's threads


if __name__ == "__main__":
    main()
