"""The node's name: a simulated node is named after its scenario (`demo`), not after the machine the
simulation runs on, unless node_name says otherwise; a real node takes the hostname."""

from __future__ import annotations

import socket

import pytest

from gpuscope.config import Settings
from gpuscope.sampling.node import NodeSampling


@pytest.mark.parametrize(("settings", "expected"), [
    ({"simulate": "demo"}, "demo"),
    ({"simulate": "demo", "node_name": "gpu-node-07"}, "gpu-node-07"),
    ({}, socket.gethostname()),
])
def test_the_node_name(settings: dict[str, str], expected: str) -> None:
    node = NodeSampling(Settings.model_validate(settings))
    try:
        assert node.hostname == expected  # what the alerts, captures and the webhook's matching use
        if "simulate" in settings:
            node.install()
            assert node.sampler.tick().hostname == expected  # the snapshots and the metrics' label
    finally:
        node.uninstall()
