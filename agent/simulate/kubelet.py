"""A stand-in kubelet: the pod-resources ``List`` API served over real gRPC on a Unix socket.

The simulator serves a scenario's pods with it, so that ``--simulate`` shows pod attribution end to
end; tests use it to play the kubelet, including its restarts (``stop`` removes the socket, ``start``
makes it again) and pods that come and go (``set_allocations``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpuscope.generated.kubelet.v1 import podresources_pb2, podresources_pb2_grpc


@dataclass(frozen=True)
class DeviceAllocation:
    """One container's devices of one resource, as the kubelet reports them."""

    namespace: str
    pod: str
    container: str
    device_ids: tuple[str, ...]
    resource_name: str = "nvidia.com/gpu"


class _Lister(podresources_pb2_grpc.PodResourcesListerServicer):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._response = podresources_pb2.ListPodResourcesResponse()
        self.calls = 0

    def set(self, allocations: Iterable[DeviceAllocation]) -> None:
        pods: dict[tuple[str, str], dict[str, list[DeviceAllocation]]] = {}
        for a in allocations:
            pods.setdefault((a.namespace, a.pod), {}).setdefault(a.container, []).append(a)
        response = podresources_pb2.ListPodResourcesResponse(pod_resources=[
            podresources_pb2.PodResources(name=pod, namespace=namespace, containers=[
                podresources_pb2.ContainerResources(name=container, devices=[
                    podresources_pb2.ContainerDevices(resource_name=a.resource_name,
                                                      device_ids=list(a.device_ids))
                    for a in devices])
                for container, devices in containers.items()])
            for (namespace, pod), containers in pods.items()])
        with self._lock:
            self._response = response

    def List(self, request: podresources_pb2.ListPodResourcesRequest,
             context: grpc.ServicerContext) -> podresources_pb2.ListPodResourcesResponse:
        with self._lock:
            self.calls += 1
            return self._response


class FakeKubelet:
    """Serves ``v1.PodResourcesLister`` on ``socket_path`` while started. Not a context manager on
    purpose: tests stop and start it to play kubelet restarts."""

    def __init__(self, socket_path: Path, allocations: Iterable[DeviceAllocation] = ()) -> None:
        self.socket_path = socket_path
        self._lister = _Lister()
        self._lister.set(allocations)
        self._server: grpc.Server | None = None

    @property
    def calls(self) -> int:
        """``List`` calls answered since this object was made."""
        return self._lister.calls

    def set_allocations(self, allocations: Iterable[DeviceAllocation]) -> None:
        self._lister.set(allocations)

    def start(self) -> None:
        if self._server is not None:
            return
        self.socket_path.unlink(missing_ok=True)  # a socket left by a previous run
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="fake-kubelet"))
        podresources_pb2_grpc.add_PodResourcesListerServicer_to_server(self._lister, server)  # type: ignore[no-untyped-call]
        if server.add_insecure_port(f"unix:{self.socket_path}") == 0:
            raise RuntimeError(f"cannot serve the fake kubelet on {self.socket_path}")
        server.start()
        self._server = server

    def stop(self) -> None:
        """Stop serving and remove the socket, as a kubelet that goes down does."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace=None).wait(5)
        self.socket_path.unlink(missing_ok=True)
