"""Client of the kubelet's pod-resources API: which pod container was allocated which device.

The kubelet serves ``v1.PodResourcesLister`` over gRPC on a Unix socket
(``/var/lib/kubelet/pod-resources/kubelet.sock``); ``List`` returns every pod with the devices each
of its containers was given. NVIDIA's device plugin names GPUs by UUID (``GPU-…``), by
``<uuid>::<replica>`` when a GPU is time-sliced, or by index with ``DEVICE_ID_STRATEGY=index``.
:func:`gpu_allocations` turns a response into a map keyed the way :meth:`GpuAllocations.pods_for`
looks GPUs up. A MIG device is named by its own UUID (``MIG-…``) and keyed by it, as a GPU by its UUID.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuscope.common.lazy_import import lazy_module
from gpuscope.snapshot import PodContainer

if TYPE_CHECKING:
    import grpc

    from gpuscope.generated.kubelet.v1 import podresources_pb2, podresources_pb2_grpc
else:  # imported once a kubelet socket exists: a node off Kubernetes never loads gRPC for this
    grpc = lazy_module("grpc")
    podresources_pb2 = lazy_module("gpuscope.generated.kubelet.v1.podresources_pb2")
    podresources_pb2_grpc = lazy_module("gpuscope.generated.kubelet.v1.podresources_pb2_grpc")

# A node with hundreds of pods answers in well under 1 MiB; the cap only stops a runaway reply.
MAX_RESPONSE_BYTES = 16 * 1024 * 1024
# Resources whose numeric device ids are GPU indexes (the device plugin's DEVICE_ID_STRATEGY=index).
# Other plugins use small numbers too, so an index is trusted only under NVIDIA's GPU resources.
_INDEXED_RESOURCE_PREFIX = "nvidia.com/gpu"
_REPLICA_SEPARATOR = "::"  # time-slicing: "<uuid>::<replica>"


class KubeletError(Exception):
    """The kubelet could not be asked: no socket, nobody listening, a timeout, or a bad answer."""


@dataclass(frozen=True)
class GpuAllocations:
    """GPU → the pod containers it is allocated to, from one ``List`` answer."""

    by_uuid: Mapping[str, tuple[PodContainer, ...]] = field(default_factory=dict)
    by_index: Mapping[int, tuple[PodContainer, ...]] = field(default_factory=dict)

    def pods_for(self, uuid: str, index: int) -> tuple[PodContainer, ...]:
        """The pod containers holding the GPU, sorted; () when none (or none known)."""
        found = self.by_uuid.get(uuid)
        if found is None:
            found = self.by_index.get(index, ())
        return found

    @cached_property  # read by every scrape (gpuscope_pod_resources_pods); the answer never changes
    def pod_count(self) -> int:
        pods = {(c.namespace, c.pod) for group in (*self.by_uuid.values(), *self.by_index.values())
                for c in group}
        return len(pods)


def gpu_allocations(response: podresources_pb2.ListPodResourcesResponse) -> GpuAllocations:
    """Indexes a ``List`` answer by GPU UUID (replica suffixes dropped) and by GPU index."""
    by_uuid: dict[str, set[PodContainer]] = {}
    by_index: dict[int, set[PodContainer]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            holder = PodContainer(namespace=pod.namespace, pod=pod.name, container=container.name)
            for devices in container.devices:
                for device_id in devices.device_ids:
                    key = device_id.split(_REPLICA_SEPARATOR, 1)[0]
                    if key.startswith(("GPU-", "MIG-")):
                        by_uuid.setdefault(key, set()).add(holder)
                    elif key.isdecimal() and devices.resource_name.startswith(_INDEXED_RESOURCE_PREFIX):
                        by_index.setdefault(int(key), set()).add(holder)
    return GpuAllocations(
        by_uuid={uuid: tuple(sorted(holders)) for uuid, holders in by_uuid.items()},
        by_index={index: tuple(sorted(holders)) for index, holders in by_index.items()},
    )


class PodResourcesClient:
    """One connection to the kubelet's pod-resources socket. Not thread-safe; ``close`` is idempotent.

    The channel is made on first use and dropped after any failure, so that the next call dials the
    socket afresh: the kubelet re-creates its socket when it restarts, and a fresh channel connects
    at once instead of waiting out gRPC's reconnect back-off.
    """

    def __init__(self, socket_path: Path, *, timeout_seconds: float) -> None:
        self.socket_path = socket_path
        self.timeout_seconds = timeout_seconds
        self._channel: grpc.Channel | None = None
        self._stub: Any = None

    def list_gpu_allocations(self) -> GpuAllocations:
        """Asks the kubelet for every pod's devices. KubeletError when that fails."""
        if not self.socket_path.exists():
            self.close()
            raise KubeletError(f"no kubelet pod-resources socket at {self.socket_path}")
        if self._stub is None:
            options = [("grpc.max_receive_message_length", MAX_RESPONSE_BYTES)]
            self._channel = grpc.insecure_channel(f"unix:{self.socket_path}", options=options)
            self._stub = podresources_pb2_grpc.PodResourcesListerStub(self._channel)  # type: ignore[no-untyped-call]
        try:
            response = self._stub.List(podresources_pb2.ListPodResourcesRequest(),
                                       timeout=self.timeout_seconds)
        except grpc.RpcError as err:
            self.close()
            code = err.code().name if hasattr(err, "code") else "error"
            details = err.details() if hasattr(err, "details") else str(err)
            raise KubeletError(f"kubelet pod-resources List on {self.socket_path} failed: "
                               f"{code}: {details}") from None
        return gpu_allocations(response)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._stub = None
