"""The ``GPUSCOPE_*`` environment variables: checked, then read into the settings' key paths.

A variable is ``GPUSCOPE_`` plus a key path in upper case, sections joined by ``__``
(``GPUSCOPE_WEB__LISTEN_ADDRESS``); a whole section or list is given as JSON
(``GPUSCOPE_CAPTURE__PROFILER_PORTS='[6009, 9012]'``), and a key of a section given both ways is
taken from its own variable. Names are compared in lower case (``str.lower``), so any spelling a
shell or a manifest produces is read. A variable that names no setting, or malformed JSON where a
section or a list is expected, is a problem named by the variable, like every other configuration
problem. The values stay text (JSON decoded): the settings model validates and converts them as it
does a file's.

This is a few dozen lines rather than a settings library: the one commonly used with pydantic
adds some 60 modules (asyncio, cloud secret stores) and 1.5-3 MiB of RSS to an agent that runs on
every node.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, get_args, get_origin

from pydantic import BaseModel

PREFIX = "GPUSCOPE_"
DELIMITER = "__"


def environment_problems(settings_model: type[BaseModel], environ: Mapping[str, str]) -> list[str]:
    """"VARIABLE: reason" for each ``GPUSCOPE_*`` variable that names no setting, holds malformed
    JSON where a section or a list is expected, or sets what another spelling of its name sets."""
    # Compared as environment_values reads them, in lower case: with upper() a variable such as
    # GPUSCOPE_\u017fAMPLE_INTERVAL (a long s, upper-cased to S) passed here and was then silently ignored.
    names = {name.lower(): expects_json for name, _path, expects_json, _section in _variables(settings_model)}
    problems = []
    spellings: dict[str, list[str]] = {}
    for variable in sorted(environ):
        name = variable.lower()
        if not name.startswith(PREFIX.lower()):
            continue
        spellings.setdefault(name, []).append(variable)
        expects_json = names.get(name)
        if expects_json is None:
            problems.append(f"{variable}: names no setting (a typo?); a variable is GPUSCOPE_ and a key path "
                            "in upper case with sections joined by __, e.g. GPUSCOPE_SAMPLE_INTERVAL or "
                            "GPUSCOPE_WEB__LISTEN_ADDRESS")
        elif expects_json:
            try:
                json.loads(environ[variable])
            except ValueError as err:
                problems.append(f"{variable}: a section or a list is written as JSON here, e.g. "
                                f"'[6009, 9012]' or '{{\"listen_address\": \":9847\"}}'; this is not "
                                f"JSON: {err}")
            except RecursionError:  # json.loads recurses once per level: "[[[[..." exhausts the stack
                problems.append(f"{variable}: nested too deeply; a section or a list is a few levels of JSON")
    # Which of two spellings would win is an accident of their order: neither is taken unseen.
    problems += [f"{', '.join(variables)}: one setting given {len(variables)} times (the names differ only "
                 "in letter case); keep one" for name, variables in spellings.items()
                 if len(variables) > 1 and name in names]
    return problems


def environment_values(settings_model: type[BaseModel], environ: Mapping[str, str]) -> dict[str, Any]:
    """The ``GPUSCOPE_*`` variables as nested settings, keyed as a configuration file keys them;
    variables that name no setting are left out (``environment_problems`` names them). Call it once
    ``environment_problems`` has found none: JSON is decoded here without a second check."""
    paths = {name.lower(): (path, expects_json, section)
             for name, path, expects_json, section in _variables(settings_model)}
    found = [(paths[variable.lower()], variable) for variable in sorted(environ)
             if variable.lower() in paths]
    values: dict[str, Any] = {}
    # A whole section first, then the keys inside it: a key's own variable wins over the section's JSON.
    for (path, expects_json, section), variable in sorted(found, key=lambda item: len(item[0][0])):
        raw = environ[variable]
        value = json.loads(raw) if expects_json else raw
        _place(values, path, value if section is None else _field_names(value, section))
    return values


def _field_names(value: Any, model: type[BaseModel]) -> Any:
    """A section's JSON with its keys, at every level of sections, spelt as the model's fields (the
    variables' names are read in any case, and so are the keys inside them). A key that names no
    field, or a second spelling of one already there, is kept as written: the model refuses it by
    name rather than one of them being dropped unseen."""
    if not isinstance(value, dict):
        return value
    fields = {(field.alias or name).lower(): (field.alias or name, field)
              for name, field in model.model_fields.items()}
    out: dict[str, Any] = {}
    for key, inner in value.items():
        match = fields.get(key.lower()) if isinstance(key, str) else None
        if match is None or match[0] in out:
            out[key] = inner
            continue
        name, field = match
        section = _model_of(field.annotation)
        out[name] = inner if section is None else _field_names(inner, section)
    return out


def _place(values: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set ``path`` in the nested ``values``. Under a section whose JSON is not an object there is no
    key to set: the section keeps its value, which the model then refuses by the section's name."""
    for key in path[:-1]:
        inner = values.setdefault(key, {})
        if not isinstance(inner, dict):
            return
        values = inner
    current = values.get(path[-1])
    if isinstance(current, dict) and isinstance(value, dict):
        # A section given whole and a section inside it given whole: both apply.
        values[path[-1]] = deep_merge(current, value)
    else:
        values[path[-1]] = value


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base`` at every level, as a new mapping: a key ``top`` sets wins, the others of
    ``base`` stay."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _variables(model: type[BaseModel], prefix: str = PREFIX, path: tuple[str, ...] = ()
               ) -> Iterator[tuple[str, tuple[str, ...], bool, type[BaseModel] | None]]:
    """(variable name, key path, whether its value is JSON, the section's model or None for a key)
    for every section and key of ``model``."""
    for name, field in model.model_fields.items():
        key = field.alias or name
        variable = prefix + key.upper()
        section = _model_of(field.annotation)
        if section is not None:
            yield variable, (*path, key), True, section
            yield from _variables(section, variable + DELIMITER, (*path, key))
        else:
            yield variable, (*path, key), _is_complex(field.annotation), None


def _unwrap(annotation: Any) -> list[Any]:
    """The types an annotation allows, Optional and Annotated unwrapped."""
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for arg in get_args(annotation) for t in _unwrap(arg)]
    return [annotation]


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for candidate in _unwrap(annotation):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _is_complex(annotation: Any) -> bool:
    """A list, a set, a tuple or a mapping: a value given as JSON."""
    return any(get_origin(t) in (list, set, frozenset, tuple, dict) or t in (list, set, tuple, dict)
               for t in _unwrap(annotation))
