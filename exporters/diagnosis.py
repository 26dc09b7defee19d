"""Prometheus exposition of each GPU's latest diagnosis: what the newest analysed capture of the GPU
found, and what fixing it would win back, for fleet queries of GPU-hours by cause.

The catalogue entries are in docs/metrics.md ("Diagnosis"). The series carry the ``gpu`` and ``uuid``
labels of the ``gpu_*`` families, the UUID from the latest snapshot: a GPU the snapshot does not list
(before the first tick, or gone from the node) exports no diagnosis.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from gpuscope.capture.diagnoses import GpuDiagnosis
from gpuscope.exporters.families import Collector, GaugeMetricFamily, Metric
from gpuscope.snapshot import SnapshotSource

GPU_LABELS = ("gpu", "uuid")


class DiagnosisSource(Protocol):
    def latest(self) -> list[GpuDiagnosis]:
        """Each GPU's diagnosis, by GPU index; safe from any thread."""
        ...


class DiagnosisCollector(Collector):
    """Collects the ``gpuscope_diagnosis_*`` families from ``diagnoses``, labelled with the GPUs of
    ``snapshots``' latest snapshot."""

    def __init__(self, diagnoses: DiagnosisSource, snapshots: SnapshotSource) -> None:
        self._diagnoses = diagnoses
        self._snapshots = snapshots

    def describe(self) -> Iterable[Metric]:
        return []  # registration must not collect

    def collect(self) -> Iterable[Metric]:
        snapshot = self._snapshots.latest()
        diagnoses = self._diagnoses.latest()
        if snapshot is None or not diagnoses:
            return []
        uuids = {gpu.index: gpu.uuid for gpu in snapshot.gpus}
        timestamp = GaugeMetricFamily(
            "gpuscope_diagnosis_timestamp_seconds",
            "Unix time at which the capture behind the GPU's gpuscope_diagnosis_* series started (the "
            "newest analysed capture of the GPU), in seconds.", labels=GPU_LABELS, unit="seconds")
        verdict = GaugeMetricFamily(
            "gpuscope_diagnosis_verdict",
            "The verdict of the newest analysed capture of the GPU (value always 1): the finding that "
            "holds its steps back most, or healthy, inconclusive or unreadable.",
            labels=(*GPU_LABELS, "verdict"))
        finding = GaugeMetricFamily(
            "gpuscope_diagnosis_finding_share",
            "Share (0-1) of the step time a finding of the newest analysed capture of the GPU accounts "
            "for, by finding and its severity (the largest over the capture's traces).",
            labels=(*GPU_LABELS, "finding", "severity"))
        gain = GaugeMetricFamily(
            "gpuscope_diagnosis_gain_share",
            "Share (0-1) of the step time that fixing the finding would win back, as the replay of the "
            "newest analysed capture of the GPU estimates it; absent when not estimated.",
            labels=(*GPU_LABELS, "finding"))
        together = GaugeMetricFamily(
            "gpuscope_diagnosis_gain_together_share",
            "Share (0-1) of the step time that all the estimated fixes of the newest analysed capture of "
            "the GPU would win back together; absent when none was estimated.", labels=GPU_LABELS)
        for diagnosis in diagnoses:
            uuid = uuids.get(diagnosis.gpu)
            if uuid is None:
                continue
            labels = (str(diagnosis.gpu), uuid)
            timestamp.add_metric(labels, diagnosis.start)
            verdict.add_metric((*labels, diagnosis.verdict), 1.0)
            for found in diagnosis.findings:
                if found.share is not None:  # a count per step, not a share (a CPU-only trace)
                    finding.add_metric((*labels, found.kind, found.severity), found.share)
                if found.gain_share is not None:
                    gain.add_metric((*labels, found.kind), found.gain_share)
            if diagnosis.gain_together is not None:
                together.add_metric(labels, diagnosis.gain_together)
        return [family for family in (timestamp, verdict, finding, gain, together) if family.samples]
