"""OpenTelemetry export: the snapshot's readings pushed to an OTLP receiver (an OpenTelemetry Collector)
under the hardware semantic conventions (``hw.*``), beside the Prometheus side.

``config`` (the ``otlp`` section), ``target`` (that section with the ``OTEL_EXPORTER_OTLP_*``
variables: where to push and how), ``catalogue`` (each Prometheus family's OTLP name, unit and
attributes), ``encode`` (the families of one snapshot as an ``ExportMetricsServiceRequest``),
``transport`` (one push over HTTP or gRPC), ``delivery`` (the queue and the thread that pushes),
``self_metrics`` (the ``gpuscope_otlp_*`` families), ``factory`` (all of it built from the settings).
The protobuf classes come from the ``opentelemetry-proto`` package (``pip install gpuscope[otlp]``),
which ``proto`` imports only where export is on.
"""
