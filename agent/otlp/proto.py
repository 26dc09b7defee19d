"""The OTLP protobuf classes, from the ``opentelemetry-proto`` package (the optional extra
``gpuscope[otlp]``): imported only where export is on, as they cost every agent some 2.3 MiB of memory
and 15 ms of start-up (docs/performance.md)."""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

from gpuscope.common.config_types import ConfigError

INSTALL_HINT = "pip install gpuscope[otlp]"


class OtlpProtos(NamedTuple):
    metrics: ModuleType  # opentelemetry.proto.metrics.v1.metrics_pb2
    common: ModuleType  # opentelemetry.proto.common.v1.common_pb2
    resource: ModuleType  # opentelemetry.proto.resource.v1.resource_pb2
    service: ModuleType  # opentelemetry.proto.collector.metrics.v1.metrics_service_pb2


def load_protos() -> OtlpProtos:
    """The generated modules; ConfigError naming ``otlp.enabled`` and the install command without them."""
    try:
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
        from opentelemetry.proto.common.v1 import common_pb2
        from opentelemetry.proto.metrics.v1 import metrics_pb2
        from opentelemetry.proto.resource.v1 import resource_pb2
    except ImportError as err:
        raise ConfigError("the otlp section", [
            f"otlp.enabled: OTLP export needs the opentelemetry-proto package ({err}); install it with "
            f"`{INSTALL_HINT}`"]) from None
    return OtlpProtos(metrics=metrics_pb2, common=common_pb2, resource=resource_pb2,
                      service=metrics_service_pb2)
