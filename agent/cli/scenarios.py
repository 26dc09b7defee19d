"""`gpuscope scenarios`: the bundled simulated nodes, one line each (name, then what it shows), or JSON."""

from __future__ import annotations

import json

from gpuscope.simulate import bundled_scenarios, load_scenario

EXIT_OK = 0


def scenario_descriptions() -> list[tuple[str, str]]:
    """(name, description) of every bundled scenario, the description on one line."""
    return [(name, " ".join(load_scenario(name).description.split())) for name in bundled_scenarios()]


def print_scenarios(*, as_json: bool) -> int:
    scenarios = scenario_descriptions()
    if as_json:
        print(json.dumps([{"name": name, "description": text} for name, text in scenarios], indent=2))
        return EXIT_OK
    width = max(len(name) for name, _ in scenarios)
    for name, text in scenarios:
        print(f"{name:<{width}}  {text}".rstrip())
    return EXIT_OK
