"""The status page at 700 px in a real headless Chromium: the GPUs table (with its Health column and
a MIG GPU) and the captures table (with their verdicts and the alert each capture was for) fit their
sections, so that no column, the power and the verdict ones included, is scrolled out of view.

The page is rendered from a StatusView built here (``render_status_page``, a pure function) and
loaded from a file: no agent is started.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from chromium import DevToolsBrowser, find_chromium
from snapshots import make_gpu, make_mig_gpu, make_snapshot

from gpuscope.alerts.model import Alert
from gpuscope.capture.model import CaptureRecord, CaptureTarget, TargetOutcome, Trigger
from gpuscope.version import __version__
from gpuscope.web.status_page import StatusView, render_status_page
from gpuscope.web.utilization_history import UtilizationHistory

BROWSER_TIMEOUT = 60.0
WIDTH, HEIGHT = 700, 900

# Per table: its section's visible box, and the box of every cell of its rows; whether the section
# needs sideways scrolling.
MEASURE = """(() => {
  const box = (e) => { const r = e.getBoundingClientRect();
                       return {left: r.left, right: r.right, top: r.top, bottom: r.bottom}; };
  const measured = (id) => { const s = document.getElementById(id);
    return {section: box(s), scroll: [s.scrollWidth, s.clientWidth],
            cells: [...s.querySelectorAll('tbody tr td')].filter((td) => td.getClientRects().length)
                     .map((td) => ({box: box(td), text: td.innerText}))}; };
  return {page: [document.documentElement.scrollWidth, document.documentElement.clientWidth],
          gpus: measured('gpus'), captures: measured('captures')};
})()"""

NOW = time.time()


def record(n: int, trigger: Trigger, analysis: dict[str, Any] | None, gpu: int = 3) -> CaptureRecord:
    target = CaptureTarget("tsl", 4242, "127.0.0.1:6009", "port 6009 of pid 4242")
    return CaptureRecord(
        id=f"20260101T0000{n:02d}Z-gpu{gpu}-{n:04x}", trigger=trigger, gpu=gpu, pids=(4242,),
        targets=(TargetOutcome(target, "captured", ("a.xplane.pb",)),), start=NOW - 600 + n, duration_s=10.0,
        bytes=48 << 20, outcome="captured", analysis=analysis, hostname="gpu-node-07")


def status_view() -> StatusView:
    gpus = [make_gpu(i) for i in range(8)]
    gpus[3] = replace(gpus[3], row_remap_pending=True)
    gpus[5] = make_mig_gpu(5)
    gpus[7] = replace(gpus[7], row_remap_failed=True)
    alerts = [Alert(name="GpuXidError", gpu=3, uuid=gpus[3].uuid, severity="critical", state="firing",
                    hostname="gpu-node-07", active_since=NOW - 60, firing_since=NOW - 60, values={},
                    summary="GPU 3 reported Xid 48 (double-bit ECC error) in the last 30s")]
    stalled = {"verdict": "input_bound", "headline": "input_bound: the device idles 41% of each step waiting "
               "for the input pipeline", "findings": [{"kind": "input_bound", "severity": "high", "gain": {
                   "before_s": 0.1726, "after_s": 0.1447, "share": 0.1616,
                   "assumptions": ["the input wait runs in 1 background worker"]}}]}
    captures = [
        record(1, Trigger("alert", alertname="GpuBusyButStalled", judged_until=NOW - 700), stalled),
        record(2, Trigger("user", user="unix"), {"verdict": "healthy", "headline": "healthy: no finding"}),
        record(3, Trigger("webhook", alertname="GpuLowUtilization"),
               {"verdict": "inconclusive", "headline": "inconclusive: the trace shows too little"}),
    ]
    return StatusView(snapshot=make_snapshot(gpus=gpus, timestamp=NOW), stale=False, alerts=alerts,
                      captures=captures, history=UtilizationHistory().series, version=__version__, now=NOW)


def test_the_gpus_and_captures_tables_fit_their_sections_at_700_px(tmp_path: Path) -> None:
    chromium = find_chromium()
    page = tmp_path / "status.html"
    page.write_bytes(render_status_page(status_view()))
    with DevToolsBrowser(chromium, tmp_path / "chromium-profile", tmp_path / "chromium.log",
                         BROWSER_TIMEOUT) as browser:
        browser.load(page.as_uri(), WIDTH, HEIGHT)
        layout = browser.evaluate(MEASURE)
    shown = json.dumps(layout)[:4000]
    assert layout["page"][0] <= layout["page"][1] <= WIDTH, shown
    for name in ("gpus", "captures"):
        table = layout[name]
        scroll_width, client_width = table["scroll"]
        assert scroll_width <= client_width + 1, f"{name} scrolls sideways: {shown}"
        section = table["section"]
        assert table["cells"], shown
        for cell in table["cells"]:
            left, right = cell["box"]["left"], cell["box"]["right"]
            assert section["left"] - 0.5 <= left and right <= section["right"] + 0.5, (
                f"{name}: {cell['text']!r} is out of view: {shown}")
    texts = [cell["text"] for cell in layout["captures"]["cells"]]
    assert any("fixing it: 172.6 -> 144.7 ms a step (16% less)" in text for text in texts), shown
    assert any("input_bound" in text for text in texts) and any(" W / " in c["text"]
                                                                for c in layout["gpus"]["cells"])


if __name__ == "__main__":  # pragma: no cover - render the page by hand to look at it
    pytest.main([__file__])
