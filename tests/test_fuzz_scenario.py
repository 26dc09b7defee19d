"""Property-based tests of the scenario loader (gpuscope.simulate.loader: ``parse_scenario``,
``load_scenario``) and the schema behind it (gpuscope.simulate.scenario).

Fuzzed: the bundled scenarios and generated valid ones (GPUs with patterns, phases, processes, lost
windows, Xid events, injected failures, pods), with any node replaced by an arbitrary YAML value, an
unknown key added to any mapping, or byte-level edits of their YAML; arbitrary bytes as a scenario
file; scenario names; aliases that expand a small file into a huge document; deep nesting and
integers too long for Python.

Asserted: a Scenario comes back, or ScenarioError with one ``SOURCE: key.path: reason`` line per
problem, naming the node that was broken; generated valid scenarios load with what they say; alias
expansion is bounded (refused past the limit, not validated for hours); nothing else is raised.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
import yaml
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from gpuscope.simulate.loader import (
    MAX_EXPANDED_NODES,
    MAX_SCENARIO_BYTES,
    ScenarioError,
    bundled_scenarios,
    load_scenario,
    parse_scenario,
)
from gpuscope.simulate.scenario import DEVICE_FUNCTIONS, REASON_BITS, Scenario

FUZZ = settings(max_examples=120)  # and tests/conftest.py\'s profile
SOURCE = "fuzz.yaml"

BUNDLED: dict[str, dict[str, Any]] = {
    name: yaml.safe_load((resources.files("gpuscope.simulate") / "scenarios" / f"{name}.yaml").read_text())
    for name in bundled_scenarios()
}

# -- strategies: valid scenarios -------------------------------------------------------------------------

# No lone surrogates (not UTF-8), no NEL (yaml.safe_dump writes it unescaped, safe_load reads a space).
CHARACTERS = st.characters(codec="utf-8", blacklist_characters="\x85")
TEXT = st.text(CHARACTERS, max_size=16)
FRACTIONS = st.floats(0.0, 1.0)
TIMES = st.floats(0.0, 299.0)
DURATIONS = st.sampled_from(["500ms", "1s", "2m", "1m30s", 0.5, 3, "0.25s"])
SIZES = st.sampled_from(["1GiB", "512MiB", 1024, "2GB", 0])

PATTERNS = st.one_of(
    FRACTIONS,
    st.fixed_dictionaries({"level": FRACTIONS}, optional={"noise": FRACTIONS}),
    st.fixed_dictionaries({"pattern": st.just("steps"), "period": DURATIONS, "busy_fraction": FRACTIONS},
                          optional={"busy_level": FRACTIONS, "idle_level": FRACTIONS, "noise": FRACTIONS}),
    st.fixed_dictionaries({"pattern": st.just("ramp"), "start": FRACTIONS, "end": FRACTIONS,
                           "over": DURATIONS}),
)


@st.composite
def windows(draw: st.DrawFn, /, **extra: st.SearchStrategy[Any]) -> dict[str, Any]:
    start = draw(TIMES)
    window: dict[str, Any] = {"from": start}
    if draw(st.booleans()):
        window["to"] = start + draw(st.floats(0.5, 100.0))
    return {**window, **{key: draw(value) for key, value in extra.items()}}


@st.composite
def phase_lists(draw: st.DrawFn) -> list[dict[str, Any]]:
    starts = sorted(set(draw(st.lists(TIMES, max_size=3))))
    return [draw(st.fixed_dictionaries({"from": st.just(start)}, optional={
        "utilization": PATTERNS, "power": st.fixed_dictionaries({"limit_w": st.floats(1, 1000)}),
        "clocks": st.fixed_dictionaries({"sm_mhz": st.integers(1, 3000)}),
        "clock_event_reasons": st.lists(st.sampled_from(sorted(REASON_BITS)), max_size=2)}))
        for start in starts]


_PROCESS_KEYS: dict[str, st.SearchStrategy[Any]] = {
    "name": st.text(CHARACTERS, min_size=1, max_size=12), "pid": st.integers(1, 2**22)}
PROCESSES = st.fixed_dictionaries(
    _PROCESS_KEYS,
    optional={"kind": st.sampled_from(["compute", "graphics"]), "memory": SIZES,
              "sm_share": FRACTIONS, "utilization": PATTERNS, "start": st.floats(0.0, 100.0)})
K8S_NAMES = st.from_regex(r"\A[a-z0-9]([-a-z0-9.]{0,20}[a-z0-9])?\Z")

GPUS = st.fixed_dictionaries({}, optional={
    "name": TEXT, "uuid": TEXT, "mig": st.sampled_from(["enabled", "disabled", "unsupported", True, False]),
    "memory": st.fixed_dictionaries({"total": st.just("80GiB")}, optional={"reserved": SIZES}),
    "utilization": PATTERNS,
    "clock_event_reasons": st.lists(st.sampled_from(sorted(REASON_BITS)), max_size=2),
    "phases": phase_lists(),
    "lost": st.lists(windows(), max_size=2),
    "xid": st.lists(st.fixed_dictionaries({"at": TIMES, "code": st.integers(1, 200)}), max_size=2),
    "failures": st.lists(windows(function=st.sampled_from(sorted(DEVICE_FUNCTIONS)),
                                 error=st.sampled_from(["unknown", "timeout", "gpu_is_lost", "hang"])),
                         max_size=2),
    "processes": st.lists(PROCESSES, max_size=3, unique_by=lambda p: p["name"]),
    "pods": st.lists(st.fixed_dictionaries({"pod": K8S_NAMES, "container": K8S_NAMES},
                                           optional={"namespace": K8S_NAMES}), max_size=2),
})

VALID = st.fixed_dictionaries({"gpus": st.lists(GPUS, max_size=3)}, optional={
    "name": TEXT, "description": TEXT, "seed": st.integers(), "loop": st.just(True),
    "driver": st.fixed_dictionaries({}, optional={"version": TEXT, "available_after": st.sampled_from(
        [0, "never", None, "2s"])}),
})
DOCUMENTS = st.one_of(VALID, st.sampled_from(sorted(BUNDLED)).map(lambda name: BUNDLED[name]))

# -- strategies: what replaces a node -------------------------------------------------------------------

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(10**300, 10**1000), st.floats(),
                    TEXT, st.sampled_from(["never", "500ms", "-1s", "1e400", "80GiB", "nan", "steady", "ramp",
                                           "from", "to", "nvmlDeviceGetUUID", "sw_power_cap", ""]))
YAML_VALUES = st.recursive(
    SCALARS, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(TEXT, kids, max_size=3), max_leaves=10)
# A mapping with keys no model of the schema has, holding lists: valid for no node of a scenario.
INVALID_ANYWHERE = st.dictionaries(TEXT.map(lambda s: "zz" + s), st.lists(SCALARS, min_size=1, max_size=2),
                                   min_size=1, max_size=2)


# -- helpers ------------------------------------------------------------------------------------------


def paths(node: Any, prefix: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """The path of every node under ``node`` (mapping keys and list indices)."""
    children: list[tuple[str | int, Any]] = []
    if isinstance(node, dict):
        children = list(node.items())
    elif isinstance(node, list):
        children = list(enumerate(node))
    for key, child in children:
        yield (*prefix, key)
        yield from paths(child, (*prefix, key))


def mapping_paths(document: dict[str, Any]) -> list[tuple[str | int, ...]]:
    """The root and every mapping under it that stands for a model (whose keys are the schema's), not
    for data (``nvlink.errors``: error type -> count, whose keys the field's own check judges)."""
    found: list[tuple[str | int, ...]] = [()]
    for path in paths(document):
        if isinstance(get(document, path), dict) and not is_data_mapping(path):
            found.append(path)
    return found


def is_data_mapping(path: tuple[str | int, ...]) -> bool:
    """Whether ``path`` leads to a field of the scenario's models typed as a dict."""
    model: type[BaseModel] = Scenario
    for position, part in enumerate(path):
        if isinstance(part, int):
            continue  # a list's item: the model stays the list's item type
        field = model.model_fields.get(part)
        if field is None:
            return False
        annotation = field.annotation
        if get_origin(annotation) is dict:
            return position == len(path) - 1
        if get_origin(annotation) is list:
            annotation = get_args(annotation)[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return False  # a union (a pattern) or a scalar: not followed
        model = annotation
    return False


def get(node: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        node = node[key]
    return node


def replaced(node: Any, path: tuple[str | int, ...], value: Any) -> Any:
    """A copy of ``node`` with the node at ``path`` replaced by ``value`` (the rest shared)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(node, list):
        assert isinstance(head, int)
        return [replaced(child, rest, value) if i == head else child for i, child in enumerate(node)]
    return {**node, head: replaced(node.get(head), rest, value) if rest else value}


def dotted(path: tuple[str | int, ...]) -> str:
    """``("gpus", 0, "memory")`` as ``gpus[0].memory``, as the loader's messages write it."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def dump(document: Any) -> str:
    return yaml.safe_dump(document, allow_unicode=True, sort_keys=False)


def parse(text: str) -> tuple[Scenario | None, list[str]]:
    """(the scenario, []) or (None, the problems), the error's form asserted."""
    try:
        scenario = parse_scenario(text, source=SOURCE, default_name="fuzzed")
    except ScenarioError as err:
        assert err.source == SOURCE and err.problems and all(p for p in err.problems)
        assert str(err) == "\n".join(f"{SOURCE}: {p}" for p in err.problems)
        return None, err.problems
    assert isinstance(scenario, Scenario) and scenario.name
    return scenario, []


# -- valid scenarios ------------------------------------------------------------------------------------


@FUZZ
@given(document=VALID)
def test_generated_scenarios_load_as_written(document: dict[str, Any]) -> None:
    scenario, problems = parse(dump(document))
    assert scenario is not None, problems
    assert scenario.name == (document.get("name") or "fuzzed")
    assert len(scenario.gpus) == len(document["gpus"])
    for gpu, written in zip(scenario.gpus, document["gpus"], strict=True):
        assert [p.pid for p in gpu.processes] == [p["pid"] for p in written.get("processes", [])]
        assert [x.code for x in gpu.xid] == [x["code"] for x in written.get("xid", [])]


@FUZZ
@given(document=DOCUMENTS, data=st.data())
def test_a_broken_node_is_named_by_its_key_path(document: dict[str, Any], data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(list(paths(document))), label="path")
    value = data.draw(INVALID_ANYWHERE, label="value")
    scenario, problems = parse(dump(replaced(document, path, value)))
    assert scenario is None
    where = dotted(path)
    if path[-1] == "pattern":  # a pattern's tag: its pattern is named, "... found using 'pattern' ..."
        where = dotted(path[:-1])
    assert any(p.startswith((f"{where}:", f"{where}.", f"{where}[")) for p in problems), (where, problems)


def test_data_mappings_are_told_from_models() -> None:
    assert is_data_mapping(("gpus", 0, "nvlink", "errors"))
    assert is_data_mapping(("gpus", 0, "health", "pcie_errors"))
    assert not is_data_mapping(("gpus", 0, "nvlink"))
    assert not is_data_mapping(("gpus", 0))


@FUZZ
@given(document=DOCUMENTS, data=st.data())
def test_an_unknown_key_is_named_by_its_key_path(document: dict[str, Any], data: st.DataObject) -> None:
    at = data.draw(st.sampled_from(mapping_paths(document)), label="mapping")
    key = data.draw(TEXT.map(lambda s: "zz" + s), label="key")
    value = data.draw(YAML_VALUES, label="value")
    scenario, problems = parse(dump(replaced(document, at, {**get(document, at), key: value})))
    assert scenario is None
    assert f"{dotted((*at, key))}: unknown key" in problems, problems


@FUZZ
@given(document=DOCUMENTS, data=st.data())
@example(document={"seed": 10**400, "duration": 10**400}, data=None)  # float() of the duration overflowed
def test_any_value_at_any_node_loads_or_is_refused(document: dict[str, Any],
                                                   data: st.DataObject | None) -> None:
    if data is not None:
        path = data.draw(st.sampled_from([*paths(document), ("name",), ("gpus",)]), label="path")
        document = replaced(document, path, data.draw(YAML_VALUES, label="value"))
    parse(dump(document))


def _edit(text: str, edits: list[tuple[int, int, str]]) -> str:
    for position, removed, inserted in edits:
        at = position % (len(text) + 1)
        text = text[:at] + inserted + text[at + removed:]
    return text


EDITS = st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 6), st.text(max_size=4) | st.sampled_from([
    ":", "- ", "\n  ", "{", "[", "&a ", "*a", "<<: *a", "!!set ", "'", "? ", "\t", "%YAML 1.1\n", "---\n",
    "..."])), min_size=1, max_size=4)


@FUZZ
@given(text=st.builds(_edit, DOCUMENTS.map(dump), EDITS))
def test_edited_yaml_loads_or_is_refused(text: str) -> None:
    parse(text)


# -- sizes and shapes no scenario has -----------------------------------------------------------------


@FUZZ
@given(gpus=st.integers(1, 400), processes=st.integers(1, 400))
@example(gpus=3000, processes=3000)  # 24 KiB expanding to 45 million nodes: hours of validation
def test_aliases_are_expanded_within_a_bound(gpus: int, processes: int) -> None:
    first = "{processes: [&p {name: p, pid: 1}" + ", *p" * (processes - 1) + "]}"
    text = "gpus: [&g " + first + ", *g" * (gpus - 1) + "]\n"
    scenario, problems = parse(text)
    # Each process is a mapping of two pairs (5 nodes); each GPU adds 3; the root and gpus 4.
    expanded = 4 + gpus * (3 + 1 + 5 * processes)
    if expanded > MAX_EXPANDED_NODES:
        assert problems and "aliases are expanded" in problems[0], problems
    else:
        assert scenario is not None and len(scenario.gpus) == gpus, problems
        assert len(scenario.gpus[-1].processes) == processes


@settings(FUZZ, max_examples=20)
@given(text=st.sampled_from(["a: &a [*a]", "gpus: &g [*g]", "a: &a {b: *a}", "gpus: [&g {processes: *g}]"]))
def test_an_alias_inside_the_node_it_names_is_refused(text: str) -> None:
    scenario, problems = parse(text)
    assert scenario is None and "aliases are expanded" in problems[0]


@settings(FUZZ, max_examples=3)  # each takes ~0.5 s: the parser's recursion ends at a fixed depth
@given(depth=st.integers(1_100, 3_000), bracket=st.sampled_from("[{"))
@example(depth=5_000, bracket="[")  # a RecursionError from the YAML parser
def test_deep_nesting_is_refused(depth: int, bracket: str) -> None:
    scenario, problems = parse(f"description: {bracket * depth}\n")
    assert scenario is None and len(problems) == 1 and "not valid YAML" in problems[0]


@settings(FUZZ, max_examples=10)
@given(digits=st.integers(4_301, 20_000), key=st.sampled_from(["seed", "duration", "zz"]))
@example(digits=5_000, key="seed")  # yaml.safe_load's ValueError (Python reads at most 4300 digits)
def test_an_integer_too_long_for_python_is_refused(digits: int, key: str) -> None:
    scenario, problems = parse(f"{key}: {'7' * digits}\n")
    assert scenario is None and problems == [problems[0]] and "not valid YAML" in problems[0]


# -- files and names -------------------------------------------------------------------------------------


@contextlib.contextmanager
def empty_working_directory() -> Iterator[Path]:
    """A fresh, empty working directory: relative names then name no file."""
    before = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="gs-fuzz-") as directory:
        os.chdir(directory)
        try:
            yield Path(directory)
        finally:
            os.chdir(before)


@FUZZ
@given(data=st.one_of(st.binary(max_size=300), DOCUMENTS.map(lambda d: dump(d).encode()),
                      st.builds(lambda d, junk: dump(d).encode() + junk, DOCUMENTS,
                                st.binary(min_size=1, max_size=4))))
@example(data=b"name: caf\xe9\n")  # read_text's UnicodeDecodeError was no ScenarioError
def test_a_scenario_file_of_any_bytes_loads_or_is_refused(data: bytes) -> None:
    with empty_working_directory() as directory:
        path = directory / "node.yaml"
        path.write_bytes(data)
        try:
            scenario = load_scenario(str(path))
        except ScenarioError as err:
            assert err.source == str(path) and err.problems
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as decode_error:
                assert err.problems == [f"not UTF-8 text: byte {data[decode_error.start]:#04x} at offset "
                                        f"{decode_error.start} cannot be decoded"]
            return
    assert scenario.name == ((yaml.safe_load(data.decode()) or {}).get("name") or "node")


def test_a_file_over_the_size_bound_is_refused_without_being_parsed() -> None:
    with empty_working_directory() as directory:
        path = directory / "big.yaml"
        path.write_bytes(b"# " + b"x" * MAX_SCENARIO_BYTES + b"\n")
        with pytest.raises(ScenarioError, match="larger than"):
            load_scenario(str(path))
        with pytest.raises(ScenarioError, match="cannot read"):  # not a regular file: never read
            load_scenario(str(directory))


@FUZZ
@given(name=st.one_of(st.sampled_from([*bundled_scenarios(), "..", ".", "demo.yml", "demo\x00", "~", "*"]),
                      st.text(st.characters(codec="utf-8", blacklist_characters="/"),
                              min_size=1, max_size=20)))
def test_a_scenario_name_is_a_bundled_scenario_or_refused(name: str) -> None:
    assume(not name.endswith((".yaml", ".yml")))  # a file name: the test above
    with empty_working_directory():
        try:
            scenario = load_scenario(name)
        except ScenarioError as err:
            assert name not in bundled_scenarios()
            assert err.problems[0].startswith("unknown scenario") or err.problems[0].startswith("cannot read")
            return
    assert name in bundled_scenarios() and scenario.name
