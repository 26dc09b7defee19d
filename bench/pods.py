"""Benchmark: what pod attribution costs, against a stand-in kubelet on a Unix socket (real gRPC).

Run: python bench/pods.py [--pods 110] [--gpus 8] [--rounds 200]

Times, as median and p99:

* ``refresh``: one ``List`` call and indexing its answer, as the background thread does every
  ``pods.refresh_interval`` (10 s by default). Never on the sampling or scrape path.
* ``lookup``: what the sampler pays per GPU per tick (a dictionary read).

The node has ``--pods`` pods (110, the kubelet's default maximum), the first ``--gpus`` of which hold
one GPU each; the others hold a NIC each, so the answer is as large as a full node's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from gpuscope.host.pods import PodAttribution
from gpuscope.simulate.kubelet import DeviceAllocation, FakeKubelet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=110)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()

    uuids = [f"GPU-{i:08d}-0000-0000-0000-000000000000" for i in range(args.gpus)]
    allocations = [
        DeviceAllocation("research", f"job-{i}", "main",
                         (uuids[i],) if i < args.gpus else (f"nic-{i}",),
                         "nvidia.com/gpu" if i < args.gpus else "example.com/nic")
        for i in range(args.pods)]
    with tempfile.TemporaryDirectory() as tmp:
        kubelet = FakeKubelet(Path(tmp) / "kubelet.sock", allocations)
        kubelet.start()
        pods = PodAttribution(kubelet.socket_path, refresh_interval=3600, timeout=5, keep_for=300)
        try:
            pods.refresh()  # connect once, as the agent's first refresh does
            refresh = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                pods.refresh()
                refresh.append(time.perf_counter() - started)
            assert pods.status().up and pods.pods_for(uuids[0], 0)
            lookup = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                for index, uuid in enumerate(uuids):
                    pods.pods_for(uuid, index)
                lookup.append((time.perf_counter() - started) / len(uuids))
        finally:
            pods.stop()
            kubelet.stop()

    def line(name: str, samples: list[float], unit: float, suffix: str) -> str:
        ordered = sorted(samples)
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        return (f"{name:<34} median {statistics.median(samples) * unit:8.3f} {suffix}"
                f"   p99 {p99 * unit:8.3f} {suffix}")

    print(f"{args.pods} pods, {args.gpus} holding a GPU; {args.rounds} rounds")
    print(line("refresh (List + index), background", refresh, 1e3, "ms"))
    print(line("lookup per GPU per tick", lookup, 1e6, "µs"))


if __name__ == "__main__":
    main()
