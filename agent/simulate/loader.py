"""Loading scenarios: bundled names and YAML files, with errors that name the file and key path."""

from __future__ import annotations

import os
import sys
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

from gpuscope.common.config_types import ConfigError, format_errors
from gpuscope.common.sizes import format_size
from gpuscope.common.unixfs import FileTooLargeError, read_bounded
from gpuscope.simulate.patterns import PATTERN_NAMES
from gpuscope.simulate.scenario import Scenario

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable


# Nodes a scenario may have with its aliases expanded. The largest bundled scenario has ~400. Every alias
# is validated again where it is used, so without a bound a file of a few KiB of nested aliases (a "billion
# laughs") would take hours and all memory to validate.
MAX_EXPANDED_NODES = 100_000
MAX_SCENARIO_BYTES = 1 << 20  # the largest bundled scenario is 3 KiB


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
        # Read within a bound, a regular file only (a FIFO would block, /dev/zero fill the memory), and
        # decoded here: read_text's UnicodeDecodeError is not an OSError and ended in a traceback.
        try:
            data = read_bounded(path, MAX_SCENARIO_BYTES, follow_symlinks=True)
        except FileTooLargeError:
            raise ScenarioError(name_or_path, [f"the file is larger than {format_size(MAX_SCENARIO_BYTES)}; "
                                               "a scenario is a few KiB"]) from None
        except OSError as err:
            raise ScenarioError(name_or_path, [f"cannot read scenario file: {err.strerror or err}"]) from err
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ScenarioError(name_or_path, [f"not UTF-8 text: byte {data[err.start]:#04x} at offset "
                                               f"{err.start} cannot be decoded"]) from None
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
        data = _load_yaml(text, source)
    except ScenarioError:
        raise
    except yaml.YAMLError as err:
        raise ScenarioError(source, [f"not valid YAML: {err}"]) from err
    # yaml.safe_load raises more than YAMLError: RecursionError once per nesting level past the
    # interpreter's limit ("[[[[..."), ValueError from a constructor (an integer of over 4300 digits).
    except RecursionError:
        raise ScenarioError(source, ["not valid YAML: nested too deeply for a scenario"]) from None
    except ValueError as err:
        raise ScenarioError(source, [f"not valid YAML: a value cannot be read ({err})"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ScenarioError(source, [f"the top level must be a mapping of keys, not {type(data).__name__}"])
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as err:
        # The patterns' names are the tags of a union, not keys the user wrote.
        raise ScenarioError(source, format_errors(err, hidden=PATTERN_NAMES, model=Scenario)) from None
    if not scenario.name:
        scenario = scenario.model_copy(update={"name": default_name})
    return scenario


def _load_yaml(text: str, source: str) -> Any:
    """yaml.safe_load, refusing a document whose aliases expand past MAX_EXPANDED_NODES."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_nodes(node) > MAX_EXPANDED_NODES:
            raise ScenarioError(source, [f"more than {MAX_EXPANDED_NODES} YAML nodes once its aliases are "
                                         "expanded (or an alias inside the node it names)"])
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_nodes(root: yaml.Node) -> int:
    """How many nodes ``root`` stands for with every alias expanded (an alias is the very node it names,
    so a node's count is computed once); past MAX_EXPANDED_NODES, and for a cycle, MAX_EXPANDED_NODES + 1."""
    over = MAX_EXPANDED_NODES + 1
    counts: dict[int, int] = {}
    open_nodes: set[int] = set()  # entered, not yet counted: the nodes on the path from the root
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_counted = stack.pop()
        children: list[yaml.Node] = []
        if isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        if children_counted:
            open_nodes.discard(id(node))
            counts[id(node)] = min(over, 1 + sum(counts[id(child)] for child in children))
            continue
        if id(node) in counts:
            continue
        if id(node) in open_nodes:
            return over  # an alias inside the node it names: no finite document
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in counts)
    return counts[id(root)]


def _bundled_dir() -> Traversable:
    return resources.files("gpuscope.simulate") / "scenarios"
