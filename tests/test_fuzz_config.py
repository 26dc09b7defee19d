"""Property-based tests of the configuration loader: the YAML file (``gpuscope config check FILE`` and
``load_settings``), the GPUSCOPE_* environment variables, and the duration and size parsers under them.

Fuzzed: arbitrary bytes and YAML-ish text as a config file; a valid, documented configuration with one
leaf replaced by an arbitrary YAML value or one unknown key added at any depth; the same documents with
byte-level edits; environment variables named after real settings (in any letter case, with typos) or
anything else, holding valid-looking or arbitrary values.

Asserted: ``config check`` exits 0 and prints ``FILE: OK``, or exits 2 with ``invalid configuration in
FILE`` and one ``key.path: reason`` line per problem; the reason is the one expected for the input (not
UTF-8, not YAML, not a mapping, an unknown key named by its path, a bad value named by its path); the
loader raises ConfigError and nothing else; a variable is either refused by name or actually applied.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, get_args, get_origin
from unittest import mock

import pytest
import yaml
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from gpuscope.cli.main import EXIT_OK, EXIT_USAGE, main
from gpuscope.common.config_types import ConfigError
from gpuscope.common.durations import parse_duration
from gpuscope.common.sizes import parse_size
from gpuscope.config import ENVIRONMENT, Settings, load_settings

FUZZ = settings(max_examples=150)  # and tests/conftest.py\'s profile

# A configuration using every section, as docs/configuration.md documents it: loads without a problem.
BASE: dict[str, Any] = {
    "sample_interval": "1s",
    "node_name": "gpu-node-07",
    "log_level": "info",
    "web": {"listen_address": ":9847", "max_requests": 64},
    "processes": {"cmdline": False},
    "idle_dips": {"threshold": 0.25, "max_duration": "5s"},
    "nvml": {"retry_initial": "1s", "retry_max": "1m", "expected_gpus": 8},
    "watchdog": {"stuck_after": "3s", "unhealthy_after": "30s"},
    "alerting": {
        "enabled": True,
        "rules": {
            "GpuLowUtilization": {"threshold": 0.7, "window": "5m", "for": "5m"},
            "GpuSharedByProcesses": {"allow": ["nvidia-cuda-mps-server"]},
            "GpuThrottled": {"enabled": False},
        },
        "event_log": {"path": "/var/log/gpuscope/alerts.jsonl", "max_bytes": "10MiB", "backups": 3},
        "alertmanager": {"url": "http://alertmanager:9093", "resend_interval": "1m", "timeout": "5s"},
    },
    "capture": {
        "enabled": True,
        "store": {"root": "/var/lib/gpuscope/captures", "quota_bytes": "2GiB"},
        "duration": "2s",
        "max_duration": "30s",
        "cooldown": "15m",
        "hourly_budget": 6,
        "rules": {"GpuThrottled": True, "GpuLowUtilization": False},
        "profiler_ports": [6009, 9012],
        "targets": [{"address": "10.0.0.7:6009", "gpu": 0}, {"address": "trainer:9012", "all": True}],
        "kineto": {"trace_dir": "/run/gpuscope/kineto/traces", "socket_dir": "/run/gpuscope/kineto/ipc"},
    },
    "control": {"enabled": True, "socket": "/run/gpuscope/control.sock", "socket_mode": "0660"},
    "pods": {"enabled": True, "socket": "/var/lib/kubelet/pod-resources/kubelet.sock",
             "refresh_interval": "10s", "timeout": "2s", "keep_for": "5m"},
}


# -- the model's shape, walked once ------------------------------------------------------------------------


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The section model an annotation holds (Optional and Annotated unwrapped), if any."""
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        return _section_of(get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        found = [s for arg in get_args(annotation) if (s := _section_of(arg)) is not None]
        return found[0] if found else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _walk(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], bool]]:
    """(key path, is a section) for every key of ``model``, as a file spells them (aliases)."""
    for name, field in model.model_fields.items():
        path = (*prefix, field.alias or name)
        section = _section_of(field.annotation)
        yield path, section is not None
        if section is not None:
            yield from _walk(section, path)


LEAVES = sorted(path for path, is_section in _walk(Settings) if not is_section)
SECTIONS = [(), *sorted(path for path, is_section in _walk(Settings) if is_section)]
VARIABLES = {"GPUSCOPE_" + "__".join(path).upper(): is_section for path, is_section in _walk(Settings)}
KEY_NAMES = {path[-1] for path, _ in _walk(Settings)}


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


# -- strategies ------------------------------------------------------------------------------------------

# Text YAML and JSON can carry: no lone surrogates (they cannot be written as UTF-8), and no NEL (U+0085),
# which yaml.safe_dump writes into a quoted scalar unescaped and yaml.safe_load reads back as a space.
TEXT = st.text(st.characters(codec="utf-8", blacklist_characters="\x85"), max_size=24)
NEAR_MISSES = st.sampled_from([
    "500ms", "2m", "1m30s", "1h", "0", "-1", "1e400", "nan", "inf", "1.5", "1.5.5", "5 s", "5S", "ms",
    "2GiB", "512MiB", "1.5GB", "10PiB", "2 gib", "1e3", ":9847", "[::1]:9847", "[::1]", "host:0",
    "host:65536", "0660", "0o777", "0777", "rwx", "/", "//", "/a/../b", "relative/path", "/a\x00b",
    "true", "null", "~", "GpuThrottled", "http://[::1", "ftp://x", "unix:///x",
])
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=10**300, max_value=10**1000),
    st.floats(), TEXT, NEAR_MISSES,
)
YAML_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(TEXT, children, max_size=4),
    max_leaves=12,
)
# Values no leaf of the model accepts: a mapping where a scalar or list is expected, or with a key no
# dict-typed leaf (capture.rules: rule names) accepts and a value that is not a bool.
INVALID_FOR_ANY_LEAF = st.dictionaries(TEXT.map(lambda s: "zz" + s),
                                       st.lists(SCALARS, min_size=1, max_size=2), min_size=1, max_size=3)


def _sub_document(draw: st.DrawFn, document: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``document`` with some keys left out at every level (the rest keep their values)."""
    out: dict[str, Any] = {}
    for key, value in document.items():
        if draw(st.booleans()):
            out[key] = _sub_document(draw, value) if isinstance(value, dict) else value
    return out


@st.composite
def valid_documents(draw: st.DrawFn) -> dict[str, Any]:
    return _sub_document(draw, BASE)


def _set_path(document: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """A copy of ``document`` with ``path`` set to ``value`` (sections created on the way)."""
    out = dict(document)
    head, *rest = path
    if rest:
        inner = out.get(head)
        out[head] = _set_path(inner if isinstance(inner, dict) else {}, tuple(rest), value)
    else:
        out[head] = value
    return out


def _edit(data: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    """``data`` with each (position, bytes removed, bytes inserted) applied in turn."""
    for position, removed, inserted in edits:
        at = position % (len(data) + 1)
        data = data[:at] + inserted + data[at + removed:]
    return data


EDITS = st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 8),
                           st.binary(max_size=6) | st.sampled_from([b":", b"- ", b"\n  ", b"{", b"[", b"&a ",
                                                                    b"*a", b"!!binary ", b"'", b'"', b"\t",
                                                                    b"\xff", b"? "])),
                 min_size=1, max_size=4)


# -- running the loader ----------------------------------------------------------------------------------


@contextlib.contextmanager
def gpuscope_environment(variables: Mapping[str, str] | None = None) -> Iterator[None]:
    """os.environ without any GPUSCOPE_* variable of the test process, plus ``variables``."""
    kept = {k: v for k, v in os.environ.items() if not k.upper().startswith("GPUSCOPE")
            and not k.lower().startswith("gpuscope")}
    with mock.patch.dict(os.environ, {**kept, **(variables or {})}, clear=True):
        yield


def config_check(path: Path) -> tuple[int, str, str]:
    """``gpuscope config check PATH``: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with gpuscope_environment(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["config", "check", str(path)])
    return status, out.getvalue(), err.getvalue()


def check_file(path: Path, data: bytes) -> tuple[int, list[str]]:
    """Write ``data`` to ``path`` and check it: (exit status, the problems). The command's output is
    asserted to be exactly ``FILE: OK``, or the header and one line per problem of load_settings."""
    path.write_bytes(data)
    status, out, err = config_check(path)
    web_config_file = None
    with gpuscope_environment():
        try:
            web_config_file = load_settings(path).web.config_file
        except ConfigError as error:
            problems = error.problems
        else:
            problems = []
    if status == EXIT_OK:
        assert (out, err, problems) == (f"{path}: OK\n", "", [])
        return status, []
    assert status == EXIT_USAGE, (status, out, err)
    if not problems and web_config_file is not None:
        # A valid configuration naming a web configuration file that cannot be used (missing, not
        # readable, invalid): `config check` reads that file too, and names it as the source.
        assert out == ""
        assert err.startswith(f"gpuscope: invalid configuration in {web_config_file}:\n  "), err
        return status, []
    assert problems and all(p for p in problems)
    assert out == ""
    assert err == f"gpuscope: invalid configuration in {path}:\n" + "".join(f"  {p}\n" for p in problems)
    return status, problems


def yaml_bytes(document: Any) -> bytes:
    return yaml.safe_dump(document, allow_unicode=True, sort_keys=False).encode()


def is_odd_yaml(text: str) -> bool:
    """Whether ``text`` is a document that yaml.safe_load cannot turn into a configuration although
    it parses (the tests below cover each kind): a value the constructor refuses with ValueError (an
    integer of more than 4300 digits), nesting past the recursion limit, or a top-level key that is
    not a string."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    except (ValueError, RecursionError):
        return True
    return isinstance(data, dict) and not all(isinstance(k, str) for k in data)


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-config")


# -- the file --------------------------------------------------------------------------------------------



def names_unknown(path: str, problems: list[str]) -> bool:
    """``path`` is among ``problems`` as an unknown key (with the closest known keys, if any)."""
    return any(p == f"{path}: unknown key" or p.startswith(f"{path}: unknown key (did you mean ")
               for p in problems)

def test_the_base_document_is_valid(config_dir: Path) -> None:
    assert check_file(config_dir / "base.yaml", yaml_bytes(BASE)) == (EXIT_OK, [])


@FUZZ
@given(data=st.one_of(
    st.binary(max_size=300),
    st.text(st.sampled_from("abc_:-[]{}#&*!|>'\"\n \t0123456789.,?%@`~\\é\x85\u2028"), max_size=120)
    .map(str.encode),
    st.builds(_edit, valid_documents().map(yaml_bytes), EDITS),
))
@example(data=b"\xff\xfe")
@example(data=b"- a\n- b\n")
@example(data=b"sample_interval: [\n")
@example(data=b"")
def test_config_check_on_arbitrary_bytes(config_dir: Path, data: bytes) -> None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        status, problems = check_file(config_dir / "bytes.yaml", data)
        assert status == EXIT_USAGE
        assert problems == [f"not UTF-8 text: byte {data[err.start]:#04x} at offset {err.start} cannot be "
                            "decoded"]
        return
    status, problems = check_file(config_dir / "bytes.yaml", data)
    if is_odd_yaml(text):
        assert status == EXIT_USAGE and len(problems) == 1, problems
        return
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError:
        assert status == EXIT_USAGE and len(problems) == 1 and "not valid YAML" in problems[0], problems
        return
    if document is None or document == {}:
        assert status == EXIT_OK  # an empty file is the defaults
    elif not isinstance(document, dict):
        assert problems == [f"the top level must be a mapping of keys, not {type(document).__name__}"]
    else:
        unknown = [k for k in document if k not in Settings.model_fields]
        assert all(names_unknown(k, problems) for k in unknown), (unknown, problems)
        assert all(": " in p for p in problems), problems


@FUZZ
@given(document=valid_documents())
def test_any_part_of_a_valid_document_is_valid(config_dir: Path, document: dict[str, Any]) -> None:
    """The fuzzing below starts from documents the loader accepts: the errors it sees are the mutation's."""
    assert check_file(config_dir / "valid.yaml", yaml_bytes(document)) == (EXIT_OK, [])


@FUZZ
@given(document=valid_documents(), leaf=st.sampled_from(LEAVES), value=INVALID_FOR_ANY_LEAF)
def test_a_bad_value_is_named_by_its_key_path(config_dir: Path, document: dict[str, Any],
                                              leaf: tuple[str, ...], value: Any) -> None:
    status, problems = check_file(config_dir / "leaf.yaml", yaml_bytes(_set_path(document, leaf, value)))
    assert status == EXIT_USAGE
    path = _dotted(leaf)
    assert any(p.startswith((f"{path}:", f"{path}.", f"{path}[")) for p in problems), (path, problems)


@FUZZ
@given(document=valid_documents(), section=st.sampled_from(SECTIONS),
       # Not empty: a problem names the key path, and an empty key at the top has none to show.
       key=TEXT.filter(lambda k: k != "" and k not in KEY_NAMES),
       value=YAML_VALUES)
@example(document={}, section=("web",), key="listen_adress", value=":9847")
@example(document={}, section=("capture",), key="function-x", value=1)  # was hidden as a validator's tag
def test_an_unknown_key_is_named_by_its_key_path(config_dir: Path, document: dict[str, Any],
                                                 section: tuple[str, ...], key: str, value: Any) -> None:
    status, problems = check_file(config_dir / "unknown.yaml",
                                  yaml_bytes(_set_path(document, (*section, key), value)))
    assert status == EXIT_USAGE
    assert names_unknown(_dotted((*section, key)), problems), problems


@FUZZ
@given(document=valid_documents(), leaf=st.sampled_from(LEAVES), value=YAML_VALUES)
@example(document={}, leaf=("sample_interval",), value=10**400)  # float() overflowed: a traceback
@example(document={}, leaf=("capture", "store", "quota_bytes"), value=10**400)
@example(document={}, leaf=("control", "socket_mode"), value="0o-7")
@example(document={}, leaf=("web", "config_file"), value="0")  # valid, but no such file to read
@example(document={}, leaf=("web", "config_file"), value="")  # read as "." (the working directory)
def test_any_value_anywhere_is_accepted_or_refused_by_its_key_path(
        config_dir: Path, document: dict[str, Any], leaf: tuple[str, ...], value: Any) -> None:
    status, problems = check_file(config_dir / "any.yaml", yaml_bytes(_set_path(document, leaf, value)))
    if status == EXIT_OK:
        return
    # Field errors name the field (or a list item, or a key under it); model and cross-field checks
    # name their section or key. Either way every line is "key.path: reason" with a known first key.
    top_keys = {path[0] for path in LEAVES}
    assert all(p.split(".", 1)[0].split(":", 1)[0].split("[", 1)[0] in top_keys for p in problems), problems


# -- YAML that parses but is no configuration: a ConfigError, not a traceback ----------------------------


@settings(FUZZ, max_examples=20)
@given(key=st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.dates()))
@example(key=1)
def test_a_top_level_key_that_is_not_a_string_is_a_config_error(config_dir: Path, key: Any) -> None:
    status, problems = check_file(config_dir / "key.yaml", yaml_bytes({key: 1}))
    assert status == EXIT_USAGE and len(problems) == 1


@settings(FUZZ, max_examples=2)  # each takes ~0.5 s: the parser's recursion ends at a fixed depth
@given(depth=st.integers(1_100, 3_000), bracket=st.sampled_from("[{"))
@example(depth=5_000, bracket="[")
def test_deep_nesting_is_a_config_error(config_dir: Path, depth: int, bracket: str) -> None:
    status, problems = check_file(config_dir / "deep.yaml", f"node_name: {bracket * depth}\n".encode())
    assert status == EXIT_USAGE and len(problems) == 1


@settings(FUZZ, max_examples=5)
@given(digits=st.integers(4_301, 20_000))
@example(digits=5_000)
def test_an_integer_python_will_not_read_is_a_config_error(config_dir: Path, digits: int) -> None:
    status, problems = check_file(config_dir / "int.yaml", f"sample_interval: {'9' * digits}\n".encode())
    assert status == EXIT_USAGE and len(problems) == 1


# Top-level keys are exact, as nested ones are: SAMPLE_INTERVAL is an unknown key, never a second
# spelling of sample_interval of which one would be silently dropped.


def _in_some_case(name: str) -> st.SearchStrategy[str]:
    return st.tuples(*(st.sampled_from([c.lower(), c.upper()]) for c in name)).map("".join)


@settings(FUZZ, max_examples=20)
@given(key=st.sampled_from(sorted(Settings.model_fields)).flatmap(_in_some_case).filter(
    lambda k: k not in Settings.model_fields), twice=st.booleans())
@example(key="SAMPLE_INTERVAL", twice=True)
def test_a_top_level_key_in_another_case_is_unknown(config_dir: Path, key: str, twice: bool) -> None:
    value = BASE.get(key.lower(), "x")
    document = {key.lower(): value, key: value} if twice else {key: value}
    status, problems = check_file(config_dir / "case.yaml", yaml_bytes(document))
    assert status == EXIT_USAGE and names_unknown(key, problems)


# -- the parsers under the value types ------------------------------------------------------------------


@FUZZ
@given(value=st.one_of(SCALARS, st.lists(SCALARS, max_size=2), st.decimals(), st.complex_numbers(),
                       st.from_regex(r"\A\s*(\d{1,400}(\.\d{0,5})?(ms|s|m|h)){1,4}\s*\Z")))
@example(value=10**400)  # float() overflowed: a traceback through pydantic instead of a problem
@example(value=-(10**400))
def test_parse_duration_answers_seconds_or_value_error(value: Any) -> None:
    try:
        seconds = parse_duration(value)
    except ValueError as err:
        assert "duration" in str(err)
        return
    assert isinstance(seconds, float) and math.isfinite(seconds) and seconds >= 0


@FUZZ
@given(value=st.one_of(SCALARS, st.lists(SCALARS, max_size=2),
                       st.from_regex(r"\A\s*\d{1,400}(\.\d{0,5})?\s*([KMGTPkmgtp]i?[Bb]|[Bb])?\s*\Z")))
@example(value=10**400)  # float() overflowed
@example(value=2.0**1023 * 1.5)
def test_parse_size_answers_bytes_or_value_error(value: Any) -> None:
    try:
        size = parse_size(value)
    except ValueError as err:
        assert "size" in str(err)
        return
    assert isinstance(size, int) and size >= 0


# -- GPUSCOPE_* variables ------------------------------------------------------------------------------

# Letters and what else the variables' reader (case-insensitive: str.lower()) or a shell could make of
# them: upper and lower case, and characters whose case mapping lands on an ASCII letter.
_CASE_VARIANTS = {"s": "sS\u017f", "k": "kK\u212a", "i": "iI\u0131\u0130"}


@st.composite
def variable_names(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["known", "typo", "prefixed", "other"]))
    if kind == "other":
        return draw(st.text(st.characters(codec="utf-8", blacklist_characters="=\x00"),
                            min_size=1, max_size=20))
    if kind == "prefixed":
        return "GPUSCOPE_" + draw(st.text(st.characters(codec="utf-8",
                                                        blacklist_characters="=\x00"), max_size=20))
    name = draw(st.sampled_from(sorted(VARIABLES)))
    if kind == "typo":
        at = draw(st.integers(len("GPUSCOPE_"), len(name)))
        name = name[:at] + draw(st.sampled_from(["", "_", "X", "__"])) + name[at + 1:]
    return "".join(draw(st.sampled_from(_CASE_VARIANTS.get(c.lower(), c.lower() + c.upper()))) for c in name)


VARIABLE_VALUES = st.one_of(
    NEAR_MISSES, TEXT,
    st.sampled_from(["[6009, 9012]", "[]", "{}", '{"listen_address": ":9847"}', '{"enabled": false}', "[1",
                     "{", '{"a": ' * 40, "[" * 5000, "1" * 5000, '{"max_requests": 1e999}', "NaN", "true"]),
    YAML_VALUES.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip()),
).filter(lambda s: "\x00" not in s)  # the environment cannot hold a NUL


@FUZZ
@given(variables=st.dictionaries(variable_names(), VARIABLE_VALUES, max_size=4))
@example(variables={"GPUSCOPE_\u017fAMPLE_INTERVAL": "5"})  # read by nobody, and no problem reported
@example(variables={"GPUSCOPE_WEB": "[1]", "GPUSCOPE_WEB__MAX_REQUESTS": "5"})
@example(variables={"GPUSCOPE_CAPTURE__PROFILER_PORTS": "[" * 5000})
def test_environment_variables_load_or_are_refused_by_name(variables: dict[str, str]) -> None:
    unknown = sorted(v for v in variables if v.lower().startswith("gpuscope_") and v.lower() not in
                     {name.lower() for name in VARIABLES})
    with gpuscope_environment(variables):
        try:
            loaded = load_settings()
        except ConfigError as err:
            assert err.problems and err.source in (ENVIRONMENT, "environment/flags"), err
            named = [p.partition(": names no setting")[0] for p in err.problems if ": names no setting" in p]
            assert named == unknown, (named, err.problems)
            return
    assert not unknown
    assert isinstance(loaded, Settings)


# (key path, variable value, what the setting reads): a variable spelt in any case is applied or refused.
_APPLIED = [
    (("sample_interval",), "5s", 5.0),
    (("node_name",), "node-7", "node-7"),
    (("pods", "keep_for"), "7m", 420.0),
    (("web", "listen_address"), "127.0.0.1:9999", "127.0.0.1:9999"),
    (("capture", "kineto", "socket_dir"), "/run/k", Path("/run/k")),
    (("alerting", "rules", "GpuThrottled", "min_fraction"), "0.75", 0.75),
]


def _spellings(name: str) -> st.SearchStrategy[str]:
    """``name`` with each letter in a case the variables' reader or a shell could produce."""
    return st.tuples(*(st.sampled_from(_CASE_VARIANTS.get(c.lower(), c.lower() + c.upper())) for c in name)
                     ).map("".join)


@FUZZ
@given(case=st.sampled_from(_APPLIED).flatmap(
    lambda c: st.tuples(st.just(c), _spellings("GPUSCOPE_" + "__".join(c[0]).upper()))))
@example(case=(_APPLIED[0], "GPUSCOPE_\u017fAMPLE_INTERVAL"))  # long s: upper() reads S, lower() does not
@example(case=(_APPLIED[2], "GPUSCOPE_PODS__\u212aEEP_FOR"))  # Kelvin sign: lower() reads k
def test_a_variable_that_is_not_refused_is_applied(
        case: tuple[tuple[tuple[str, ...], str, Any], str]) -> None:
    (path, value, expected), name = case
    if not name.lower().startswith("gpuscope_"):  # not one of ours (as the variables' reader reads it)
        expected = getattr(Settings.model_fields[path[0]], "default", None) if len(path) == 1 else None
        assume(expected is not None)
    with gpuscope_environment({name: value}):
        try:
            loaded: Any = load_settings()
        except ConfigError as err:
            assert err.problems == [p for p in err.problems if p.startswith(f"{name}: names no setting")]
            assert err.problems
            return
    for key in path:
        loaded = getattr(loaded, key)
    assert loaded == expected, name
