"""The ``GPUSCOPE_*`` environment variables, checked before the settings read them.

A variable is ``GPUSCOPE_`` plus a key path in upper case, sections joined by ``__``
(``GPUSCOPE_WEB__LISTEN_ADDRESS``); a whole section or list is given as JSON
(``GPUSCOPE_CAPTURE__PROFILER_PORTS='[6009, 9012]'``). The settings library would ignore a variable
that names no setting and stop with a traceback on malformed JSON; here both are problems named by
the variable, like every other configuration problem.
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
    """"VARIABLE: reason" for each ``GPUSCOPE_*`` variable that names no setting or holds malformed
    JSON where a section or a list is expected."""
    # Compared as the settings library compares them, in lower case: with upper() a variable such as
    # GPUSCOPE_\u017fAMPLE_INTERVAL (a long s, upper-cased to S) passed here and was then silently ignored.
    names = {name.lower(): expects_json for name, expects_json in _variables(settings_model)}
    problems = []
    for variable in sorted(environ):
        name = variable.lower()
        if not name.startswith(PREFIX.lower()):
            continue
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
    return problems


def _variables(model: type[BaseModel], prefix: str = PREFIX) -> Iterator[tuple[str, bool]]:
    """(variable name, whether its value is JSON) for every section and key of ``model``."""
    for name, field in model.model_fields.items():
        key = (field.alias or name).upper()
        variable = prefix + key
        section = _model_of(field.annotation)
        if section is not None:
            yield variable, True
            yield from _variables(section, variable + DELIMITER)
        else:
            yield variable, _is_complex(field.annotation)


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
    """A list, a set, a tuple or a mapping: what the settings library parses as JSON."""
    return any(get_origin(t) in (list, set, frozenset, tuple, dict) or t in (list, set, tuple, dict)
               for t in _unwrap(annotation))
