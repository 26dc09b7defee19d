"""What every section of the configuration (and every scenario file) is made of: the section base,
the field types people write as text (durations, sizes, addresses, socket paths), and the one
formatter that turns pydantic's errors into ``key.path: reason`` lines.

Every duration and size is range-checked where it is read: a value no timer or file system could
use (``resend_interval: 1e12``) is refused with its key path, never discovered later by a thread.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Annotated, Any, get_args

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, ValidationError

from gpuscope.common.addresses import parse_host_port
from gpuscope.common.durations import parse_duration
from gpuscope.common.sizes import format_size, parse_size
from gpuscope.common.suggestions import did_you_mean
from gpuscope.common.unixfs import MAX_UNIX_SOCKET_PATH_BYTES

# No setting of the agent is meaningful beyond a year, and every timer accepts that much
# (Python's waits overflow near 292 years, threading.TIMEOUT_MAX).
DURATION_CEILING_SECONDS = 366 * 86400.0
SIZE_CEILING_BYTES = 2**50  # 1 PiB: more than any store or log the agent keeps
_MAX_SHOWN_VALUE_CHARS = 80
# How pydantic names a validator wrapping a union member in an error's location, e.g.
# "function-after[_duration_in_range(), float]". Matched whole: a key someone wrote, such as
# "function-x", is a key to show, not a wrapper to hide.
_VALIDATOR_TAG = re.compile(r"(?:function-(?:after|before|wrap|plain)|lax-or-strict)\[.*\]", re.DOTALL)


class ConfigError(Exception):
    """Configuration that cannot be used; ``problems`` holds one "key.path: reason" per line."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(self.describe())

    def describe(self) -> str:
        return f"invalid configuration in {self.source}:\n" + "\n".join(f"  {p}" for p in self.problems)


class Section(BaseModel):
    """A section of the configuration: unknown keys are refused with their path (a typo never falls
    back to a default), and the values are frozen once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _duration_in_range(seconds: float) -> float:
    if seconds > DURATION_CEILING_SECONDS:
        raise ValueError(f"must be at most {DURATION_CEILING_SECONDS / 86400:g} days")
    return seconds


def _size_in_range(size: int) -> int:
    if size > SIZE_CEILING_BYTES:
        raise ValueError(f"must be at most {format_size(SIZE_CEILING_BYTES)}")
    return size


def _unix_socket_path(path: Path) -> Path:
    text = str(path)
    if "\x00" in text:
        raise ValueError("a path must not contain a NUL character")
    if not path.is_absolute():
        raise ValueError("must be an absolute path")
    if len(text.encode()) > MAX_UNIX_SOCKET_PATH_BYTES:
        raise ValueError(f"must be at most {MAX_UNIX_SOCKET_PATH_BYTES} bytes long (a Unix socket address)")
    return path


def _path_named(value: Any) -> Any:
    """Before a path is coerced: an empty string would become ".", the working directory."""
    if isinstance(value, str) and not value.strip():
        raise ValueError("must not be empty (an empty path names the working directory)")
    if isinstance(value, str) and "\x00" in value:
        raise ValueError("a path must not contain a NUL character")
    return value


def _listen_address(value: str) -> str:
    parse_host_port(value, listen=True)
    return value.strip()


def _peer_address(value: str) -> str:
    parse_host_port(value)
    return value.strip()


# Seconds, written as a number or a duration string ("500ms", "2m", "1h30m"); at most a year.
Duration = Annotated[float, BeforeValidator(parse_duration), AfterValidator(_duration_in_range)]
# Bytes, written as a number or a size string ("512MiB", "2GB"); at most 1 PiB.
ByteSize = Annotated[int, BeforeValidator(parse_size), AfterValidator(_size_in_range)]
# An absolute path that fits a Unix socket address.
UnixSocketPath = Annotated[Path, BeforeValidator(_path_named), AfterValidator(_unix_socket_path)]
# A file or directory path, never empty.
FilePath = Annotated[Path, BeforeValidator(_path_named)]
# Where a server listens: "host:port", "[v6]:port" or ":port" (every interface); port 0: any free one.
ListenAddress = Annotated[str, AfterValidator(_listen_address)]
# A peer to connect to: "host:port" or "[v6]:port".
PeerAddress = Annotated[str, AfterValidator(_peer_address)]


def format_errors(err: ValidationError, *, hidden: Collection[str] = (),
                  model: type[BaseModel] | None = None) -> list[str]:
    """pydantic's errors as "key.path: reason" lines a person can act on: list items as ``[i]``, the
    offending value shown once. ``hidden`` names location parts that are not keys the user wrote (a
    union's tags); a check over a whole model may report several problems, one per line. ``model``:
    the model validated, whose keys an unknown key is compared with ("did you mean ...?")."""
    lines = []
    for error in err.errors():
        path = key_path(error["loc"], hidden=hidden)
        reason = _reason(error)
        if error["type"] == "extra_forbidden" and model is not None and error["loc"]:
            known = known_keys(model, error["loc"][:-1], hidden=hidden)
            reason += did_you_mean(str(error["loc"][-1]), known)
        for line in reason.split("\n"):
            lines.append(f"{path}: {line}" if path else line)
    return lines


def known_keys(model: type[BaseModel], loc: Sequence[int | str], *,
               hidden: Collection[str] = ()) -> list[str]:
    """The keys (aliases where set) of the section that ``loc`` leads to from ``model``; [] where the
    path does not lead to one model (a union of several)."""
    current = model
    for part in loc:
        if isinstance(part, int) or part in hidden or _VALIDATOR_TAG.fullmatch(part):
            continue  # a list item or a wrapper: the section is the one the field's type names
        field = next((f for name, f in current.model_fields.items() if part in (name, f.alias)), None)
        if field is None:
            continue  # a key of a mapping (dict[str, Section]): its values are the section
        models = _models_in(field.annotation)
        if len(models) != 1:
            return []
        current = models[0]
    return [f.alias or name for name, f in current.model_fields.items()]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's type holds: itself, or inside Optional, list, dict and Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in get_args(annotation):
        found += [m for m in _models_in(arg) if m not in found]
    return found


def key_path(loc: Sequence[int | str], *, hidden: Collection[str] = ()) -> str:
    """``("capture", "targets", 0, "address")`` as ``capture.targets[0].address``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in hidden or _VALIDATOR_TAG.fullmatch(part):
            continue  # a validator's or union's wrapper, not a key
        else:
            out += f".{part}" if out else part
    return out


def _reason(error: Any) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown key"
    reason = str(error["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if error["type"] != "missing" and "input" in error:
        value = error["input"]
        if not isinstance(value, (dict, list)) and not _quotes(reason, value):
            shown = repr(value)
            if len(shown) > _MAX_SHOWN_VALUE_CHARS:
                shown = shown[:_MAX_SHOWN_VALUE_CHARS - 1] + "…"
            reason += f" (got {shown})"
    return reason


def _quotes(reason: str, value: object) -> bool:
    """Whether ``reason`` already shows ``value`` (a validator's own "got 'fast'"), so it is not
    repeated. A quoted string counts anywhere; a number only after "got"."""
    if isinstance(value, str):
        return repr(value) in reason
    return f"got {value!r}" in reason
