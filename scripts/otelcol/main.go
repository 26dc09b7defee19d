// Command otelcol-gpuscope is the smallest OpenTelemetry Collector that gpuscope's OTLP tests need:
// the OTLP receiver (gRPC and HTTP) and the file exporter, whose JSON lines the tests read back.
// Nothing else is compiled in, so the build stays short on a small CI machine.
package main

import (
	"os"

	"github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter"
	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/exporter"
	"go.opentelemetry.io/collector/otelcol"
	"go.opentelemetry.io/collector/receiver"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/service/telemetry/otelconftelemetry"
)

// version is set at build time (-X main.version=...) to the Collector release in go.mod.
var version = "unknown"

// components lists the factories the configuration may name. Processors, connectors and extensions
// are left out: the tests' pipeline goes straight from the receiver to the exporter.
func components() (otelcol.Factories, error) {
	receivers, err := otelcol.MakeFactoryMap[receiver.Factory](otlpreceiver.NewFactory())
	if err != nil {
		return otelcol.Factories{}, err
	}
	exporters, err := otelcol.MakeFactoryMap[exporter.Factory](fileexporter.NewFactory())
	if err != nil {
		return otelcol.Factories{}, err
	}
	return otelcol.Factories{
		Receivers: receivers,
		Exporters: exporters,
		// The Collector refuses to start without a telemetry factory (its own logs and metrics).
		Telemetry: otelconftelemetry.NewFactory(),
	}, nil
}

func main() {
	settings := otelcol.CollectorSettings{
		BuildInfo: component.BuildInfo{
			Command:     "otelcol-gpuscope",
			Description: "OpenTelemetry Collector for gpuscope's OTLP tests (OTLP receiver, file exporter)",
			Version:     version,
		},
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{
			ResolverSettings: confmap.ResolverSettings{
				// Only configuration files: the tests write one per Collector.
				ProviderFactories: []confmap.ProviderFactory{fileprovider.NewFactory()},
			},
		},
	}
	if err := otelcol.NewCommand(settings).Execute(); err != nil {
		// cobra has already printed the error.
		os.Exit(1)
	}
}
