"""The status page in a real headless Chromium, driven over its DevTools pipe, at a desktop width and
at 700 px: the page never scrolls sideways (a wide table scrolls in its own section), nor do the
alerts; every alert summary has a readable width and, with every GPU sparkline, lies in view; the
alerts' cells do not overlap; the screenshot at
each width has that width and shows the page's right-hand part."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from agent_process import run_agent
from chromium import DevToolsBrowser, find_chromium, png_rows, png_size
from test_status_page import FAST_ALERTS, wait_until_firing

BROWSER_TIMEOUT = 60.0
HEIGHT = 900

# Measured in the page: the document's and the window's width, and the box of every alert summary
# and sparkline next to the visible part of the section that holds it (a section clips what its
# table's scrolling hides), with the boxes of the other cells of each alert row.
MEASURE = """(() => {
  const box = (e) => { const r = e.getBoundingClientRect();
                       return {left: r.left, right: r.right, top: r.top, bottom: r.bottom}; };
  const placed = (e) => ({box: box(e), section: box(e.closest('section')),
                          overflows: e.scrollWidth > e.clientWidth + 1});
  return {
    scrollWidth: document.documentElement.scrollWidth,
    clientWidth: document.documentElement.clientWidth,
    alertsScroll: (s => [s.scrollWidth, s.clientWidth])(document.getElementById('alerts')),
    summaries: [...document.querySelectorAll('#alerts tr.alert td:last-child')].map(placed),
    sparklines: [...document.querySelectorAll('#gpus tr.gpu svg.spark')].map(placed),
    alertRows: [...document.querySelectorAll('#alerts tr.alert')].map(
      (row) => [...row.querySelectorAll('td')].map(box)),
  };
})()"""


def inside(inner: dict[str, float], outer: dict[str, float]) -> bool:
    return (inner["left"] >= outer["left"] - 0.5 and inner["right"] <= outer["right"] + 0.5
            and inner["top"] >= outer["top"] - 0.5 and inner["bottom"] <= outer["bottom"] + 0.5)


def overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    return (min(a["right"], b["right"]) - max(a["left"], b["left"]) > 0.5
            and min(a["bottom"], b["bottom"]) - max(a["top"], b["top"]) > 0.5)


def check_layout(width: int, layout: dict[str, Any]) -> None:
    shown = json.dumps(layout)[:3000]
    # No sideways scrolling of the page (its vertical scrollbar takes part of the window).
    assert layout["scrollWidth"] <= layout["clientWidth"] <= width, shown
    view = {"left": 0, "right": layout["clientWidth"], "top": -1e9, "bottom": 1e9}
    assert len(layout["summaries"]) >= 2 and len(layout["sparklines"]) == 4, shown
    for placed in layout["summaries"] + layout["sparklines"]:
        assert inside(placed["box"], view), shown
        assert inside(placed["box"], placed["section"]), shown  # not scrolled away inside its section
    # The alerts need no sideways scrolling: their summaries would be the part scrolled away.
    assert layout["alertsScroll"][0] <= layout["alertsScroll"][1], shown
    for placed in layout["summaries"]:
        assert not placed["overflows"], shown  # wrapped, not running out of its cell
        # A readable width, not a sliver wrapped a few words a line as the other columns squeeze it.
        assert placed["box"]["right"] - placed["box"]["left"] >= 0.4 * layout["clientWidth"], shown
    for cells in layout["alertRows"]:
        for i, cell in enumerate(cells):
            assert not any(overlap(cell, other) for other in cells[i + 1:]), shown


def check_screenshot(width: int, png: bytes) -> None:
    assert png_size(png) == (width, HEIGHT)
    rows = png_rows(png)
    channels = len(rows[0]) // width
    # The right-hand third, short of the scrollbar: text (dark pixels) and colours of its own.
    left, right = (2 * width // 3) * channels, (width - 20) * channels
    dark = 0
    colours = set()
    for row in rows:
        for x in range(left, right, channels):
            red, green, blue = row[x], row[x + 1], row[x + 2]
            colours.add((red, green, blue))
            dark += red + green + blue < 300
    assert dark > 500, f"{dark} dark pixels on the right of the {width}-px screenshot: blank"
    assert len(colours) > 20, f"{len(colours)} colours on the right of the {width}-px screenshot"


@pytest.mark.parametrize("width", [1280, 700])
def test_the_status_page_fits_the_window_in_chromium(tmp_path: Path, width: int) -> None:
    chromium = find_chromium()
    config = tmp_path / "gpuscope.yaml"
    config.write_text(FAST_ALERTS)
    with run_agent(tmp_path, "--simulate", "demo", "--config", str(config)) as agent:
        wait_until_firing(agent.get, {"GpuSharedByProcesses", "GpuFrequentIdleDips"})
        with DevToolsBrowser(chromium, tmp_path / "chromium-profile", tmp_path / "chromium.log",
                             BROWSER_TIMEOUT) as browser:
            browser.load(agent.base + "/", width, HEIGHT)
            layout = browser.evaluate(MEASURE)
            png = browser.screenshot()
    (tmp_path / f"status-{width}.png").write_bytes(png)
    check_layout(width, layout)
    check_screenshot(width, png)
