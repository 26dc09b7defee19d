"""The NVML simulator: scenario-driven fake GPUs behind the real ``pynvml`` bindings.

``Simulation(load_scenario("demo")).install()`` makes every ``pynvml`` call answer from the
scenario. Names are imported lazily so that the helper processes the simulator spawns
(``python -m gpuscope.simulate.helper_process``) start without loading pydantic or pynvml.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuscope.simulate.loader import ScenarioError, bundled_scenarios, load_scenario
    from gpuscope.simulate.scenario import Scenario
    from gpuscope.simulate.simulation import Simulation

__all__ = ["Scenario", "ScenarioError", "Simulation", "bundled_scenarios", "load_scenario"]

_HOMES = {
    "Scenario": "gpuscope.simulate.scenario",
    "ScenarioError": "gpuscope.simulate.loader",
    "bundled_scenarios": "gpuscope.simulate.loader",
    "load_scenario": "gpuscope.simulate.loader",
    "Simulation": "gpuscope.simulate.simulation",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
