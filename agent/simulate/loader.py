"""Loading scenarios: bundled names and YAML files, with errors that name the file and key path."""

from __future__ import annotations

import os
import sys
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from pydantic import ValidationError

from gpuscope.common.config_types import ConfigError, format_errors
from gpuscope.simulate.patterns import PATTERN_NAMES
from gpuscope.simulate.scenario import Scenario

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable


class ScenarioError(ConfigError, ValueError):
    """A scenario that cannot be used; the message names the file and the offending key path.

    With several problems the message has one line per problem, each ``FILE: key.path: reason``.
    """

    def describe(self) -> str:
        return "\n".join(f"{self.source}: {p}" for p in self.problems)


def bundled_scenarios() -> list[str]:
    """Names of the scenarios shipped in gpuscope/simulate/scenarios/."""
    return sorted(p.name[: -len(".yaml")] for p in _bundled_dir().iterdir() if p.name.endswith(".yaml"))


def load_scenario(name_or_path: str) -> Scenario:
    """A bundled scenario by name (``"demo"``) or a YAML file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path or path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise ScenarioError(name_or_path, [f"cannot read scenario file: {err.strerror or err}"]) from err
        return parse_scenario(text, source=str(path), default_name=path.stem)
    resource = _bundled_dir() / f"{name_or_path}.yaml"
    if not resource.is_file():
        bundled = ", ".join(bundled_scenarios())
        raise ScenarioError(name_or_path, [f"unknown scenario: not a file, nor a bundled one ({bundled})"])
    return parse_scenario(resource.read_text(encoding="utf-8"), source=f"{name_or_path}.yaml",
                          default_name=name_or_path)


def parse_scenario(text: str, *, source: str = "<string>", default_name: str = "scenario") -> Scenario:
    """Validate YAML text; ``source`` names it in error messages."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ScenarioError(source, [f"not valid YAML: {err}"]) from err
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ScenarioError(source, [f"the top level must be a mapping of keys, not {type(data).__name__}"])
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as err:
        # The patterns' names are the tags of a union, not keys the user wrote.
        raise ScenarioError(source, format_errors(err, hidden=PATTERN_NAMES)) from None
    if not scenario.name:
        scenario = scenario.model_copy(update={"name": default_name})
    return scenario


def _bundled_dir() -> Traversable:
    return resources.files("gpuscope.simulate") / "scenarios"
