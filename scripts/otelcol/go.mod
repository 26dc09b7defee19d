// The OpenTelemetry Collector that gpuscope's OTLP tests push to (scripts/build-otelcol builds it).
// One Collector release throughout: core v0.161.0 with its stable modules at v1.67.0, and contrib
// v0.161.0. go.sum is not kept here: the build script resolves it into its cache, then checks that
// every module below kept its version.
module gpuscope.test/otelcol

go 1.26.0

require (
	github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter v0.161.0
	go.opentelemetry.io/collector/component v1.67.0
	go.opentelemetry.io/collector/confmap v1.67.0
	go.opentelemetry.io/collector/confmap/provider/fileprovider v1.67.0
	go.opentelemetry.io/collector/exporter v1.67.0
	go.opentelemetry.io/collector/otelcol v0.161.0
	go.opentelemetry.io/collector/receiver v1.67.0
	go.opentelemetry.io/collector/receiver/otlpreceiver v0.161.0
	go.opentelemetry.io/collector/service v0.161.0
)
