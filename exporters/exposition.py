"""Fast encoders of metric families, byte for byte what prometheus_client's encoders write.

prometheus_client's ``generate_latest`` (text 0.0.4) and its OpenMetrics twin check and escape
every label name and value on every scrape; on a node of 8 GPUs x 4 processes (~1,200 label pairs)
that is most of the cost of ``/metrics``. The encoders here write the same bytes faster:

* the ``{...}`` label string of a sample is memoised by its label items (label sets repeat
  scrape after scrape and across families: the same gpu/uuid, pid and reason sets), in a bounded
  cache shared by both formats, since label values are escaped the same way in both;
* the Go-style text of a sample value (``floatToGoString``, as prometheus_client writes values) is
  memoised by the value as a float, zero left out (0.0 and -0.0 are equal keys with two texts):
  0/1 gauges, limits, totals and clocks repeat across series and scrapes;
* the HELP/TYPE/UNIT header of a family is memoised by its name, type, help text and unit;
* lines are appended to one list, joined and encoded once.

Only the common case takes the fast path: a gauge, counter, unknown or info family whose metric,
sample and label names use the legacy character set without colons (``[a-zA-Z_][a-zA-Z0-9_]*``,
which every escaping scheme taken here leaves unchanged), and whose samples have no timestamp,
exemplar or native histogram (nor, in the text format, a ``_created``, ``_gsum`` or ``_gcount``
sample, which prometheus_client moves into an extra family). Any other family, or one on which
the fast path raises for any reason, is rendered by prometheus_client's own encoder, so the output
never depends on the fast path being right about an unusual case, and an invalid family fails the
way it fails in prometheus_client. Escaping schemes other than ``underscores`` and ``allow-utf-8``
go to prometheus_client whole.

``negotiate`` picks the encoder and Content-Type from an Accept header as prometheus_client's
``choose_encoder`` does (tests/test_exposition.py checks it against that function).

The families are ``families``' (prometheus_client's shapes, without importing it), and the output
is prometheus_client's to the byte: its encoders are imported only when a family or an Accept header
needs them, and tests/test_exposition.py fails if a release of it changes a byte. The fast path pays
its way: on 8 GPUs x 4 processes it renders text in 0.28 ms and OpenMetrics in 0.26 ms, against 2.1
and 3.1 ms for prometheus_client's own encoders (``python bench/scrape.py --encoders-only``).
"""

from __future__ import annotations

import copy
import functools
import math
import re
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

from gpuscope.exporters.families import Metric

__all__ = [
    "ALLOWUTF8",
    "CONTENT_TYPE_TEXT",
    "UNDERSCORES",
    "Encoder",
    "is_openmetrics",
    "negotiate",
    "render_openmetrics",
    "render_text",
    "restrict_families",
    "without_eof",
]

UNDERSCORES = "underscores"  # prometheus_client's default name escaping scheme
ALLOWUTF8 = "allow-utf-8"
DOTS = "dots"
VALUES = "values"
_ESCAPINGS = frozenset({UNDERSCORES, ALLOWUTF8, DOTS, VALUES})
OPENMETRICS_VERSION = "1.0.0"  # what prometheus_client's OpenMetrics encoder writes by default
CONTENT_TYPE_TEXT = "text/plain; version=0.0.4; charset=utf-8"
_CONTENT_TYPE_TEXT_1 = "text/plain; version=1.0.0; charset=utf-8"
_CONTENT_TYPE_OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"

# Bounds of the memos (each is emptied when full). 8 GPUs x 4 processes use ~150 label sets, of
# ~0.5-1.5 kB each (cmdline labels are the long ones): a few MiB at most.
LABEL_CACHE_MAX_ENTRIES = 4096
VALUE_CACHE_MAX_ENTRIES = 4096  # ~100 values per scrape of 8 GPUs x 4 processes; ~0.5 MiB at most
HEADER_CACHE_MAX_ENTRIES = 1024

Encoder = Callable[[Iterable[Metric]], bytes]
"""Renders metric families (as a registry's ``collect()`` yields them) as an exposition body."""

_EOF = "# EOF\n"
# Names that every escaping scheme on the fast path writes unchanged: prometheus_client's legacy
# label-name set. (Its legacy metric-name set also allows ':', which the OpenMetrics encoder turns
# into '_' in sample names under the underscores scheme; such names take the slow path.)
_PLAIN_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_FAST_ESCAPINGS = frozenset({UNDERSCORES, ALLOWUTF8})
_FAST_TYPES = frozenset({"gauge", "counter", "unknown", "info"})
# The text format's family name and type for each type on the fast path (prometheus_client's
# "munging from OpenMetrics into Prometheus format").
_TEXT_NAME_SUFFIX = {"gauge": "", "counter": "_total", "unknown": "", "info": "_info"}
_TEXT_TYPE = {"gauge": "gauge", "counter": "counter", "unknown": "untyped", "info": "gauge"}
# Samples that the text encoder moves into an extra gauge family after the family's own lines.
_TEXT_MOVED_SUFFIXES = ("_created", "_gsum", "_gcount")

_UNCHECKED = object()  # compares unequal to every sample name
_INF = float("inf")

# Label items (in the sample's dict order) -> the text between the braces. Shared by both formats
# and every thread; a lost update under concurrent scrapes only costs a recomputation.
_label_cache: dict[tuple[tuple[str, str], ...], str] = {}
# float(value) -> floatToGoString(value), for finite non-zero values (floatToGoString is a function
# of float(value), and two such floats are equal only when their bits are).
_value_cache: dict[float, str] = {}
# (openmetrics, name, type, help, unit) -> the family's comment lines.
_header_cache: dict[tuple[bool, str, str, str, str], str] = {}


class _SlowPath(Exception):
    """The family needs prometheus_client's encoder."""


class _FixedCollector:
    """A collector over a fixed list of families, to hand to prometheus_client's encoders."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def render_text(families: Iterable[Metric], escaping: str = UNDERSCORES) -> bytes:
    """The Prometheus text format of ``families``: what ``prometheus_client.generate_latest`` writes
    for the same escaping scheme (the default is text 0.0.4's)."""
    if escaping not in _FAST_ESCAPINGS:
        return _slow_text(list(families), escaping)
    out: list[str] = []
    for family in families:
        mark = len(out)
        try:
            _render_family(family, out, openmetrics=False)
        except Exception:  # anything unusual: prometheus_client renders it (or raises as it would)
            del out[mark:]
            out.append(_slow_text([family], escaping).decode("utf-8"))
    return "".join(out).encode("utf-8")


def render_openmetrics(
    families: Iterable[Metric], escaping: str = UNDERSCORES, version: str = OPENMETRICS_VERSION
) -> bytes:
    """The OpenMetrics text of ``families``, ``# EOF`` included: what prometheus_client's
    ``openmetrics.exposition.generate_latest`` writes for the same arguments."""
    if escaping not in _FAST_ESCAPINGS:
        return _slow_openmetrics(list(families), escaping, version)
    out: list[str] = []
    for family in families:
        mark = len(out)
        try:
            _render_family(family, out, openmetrics=True)
        except Exception:  # anything unusual: prometheus_client renders it (or raises as it would)
            del out[mark:]
            body = _slow_openmetrics([family], escaping, version).decode("utf-8")
            out.append(body[: -len(_EOF)])
    out.append(_EOF)
    return "".join(out).encode("utf-8")


def negotiate(accept_header: str | None) -> tuple[Encoder, str]:
    """The encoder and Content-Type for a request's Accept header (None when it has none), chosen as
    prometheus_client's ``choose_encoder`` chooses: the first ``application/openmetrics-text``
    (version 1.0.0 when it names none) or ``text/plain`` of version 1 or later, in the header's
    order, with its escaping scheme; else text 0.0.4. Escaping schemes other than ``underscores`` and
    ``allow-utf-8`` are served by prometheus_client's encoders."""
    try:
        return _choose(accept_header or "")
    except _UnreadableVersion:
        return functools.partial(render_text), CONTENT_TYPE_TEXT


def _choose(accept_header: str) -> tuple[Encoder, str]:
    for accepted in accept_header.split(","):
        parts = accepted.split(";")
        media = parts[0].strip()
        if media not in ("application/openmetrics-text", "text/plain"):
            continue
        version, escaping = _parameter(parts, "version"), _parameter(parts, "escaping")
        escaping = escaping if escaping in _ESCAPINGS else UNDERSCORES
        if media == "application/openmetrics-text":
            if not version:
                return functools.partial(render_openmetrics), _CONTENT_TYPE_OPENMETRICS
            if _at_least_1(version):
                content_type = f"application/openmetrics-text; version={version}; charset=utf-8"
                return (functools.partial(render_openmetrics, escaping=escaping, version=version),
                        f"{content_type}; escaping={escaping}")
        elif version and _at_least_1(version):
            return (functools.partial(render_text, escaping=escaping),
                    f"{_CONTENT_TYPE_TEXT_1}; escaping={escaping}")
    return functools.partial(render_text), CONTENT_TYPE_TEXT


def _parameter(parts: list[str], key: str) -> str:
    """The value of the first ``key=value`` among a media range's parameters, else ""."""
    for part in parts:
        if "=" in part:
            name, value = part.strip().split("=", 1)
            if name == key:
                return value
    return ""


def _at_least_1(version: str) -> bool:
    """Whether a version compares at least 1.0.0, as prometheus_client compares them: numeric parts
    as numbers; a part that is not a number where a number is compared makes the header unreadable,
    answered as without an Accept header (prometheus_client raises there)."""
    parsed: list[int | str] = []
    for part in version.split("."):
        try:
            parsed.append(int(part))
        except ValueError:
            parsed.append(part)
    for mine, least in zip(parsed, (1, 0, 0), strict=False):
        if isinstance(mine, str):
            raise _UnreadableVersion(version)
        if mine != least:
            return mine > least
    return len(parsed) >= 3


class _UnreadableVersion(ValueError):
    pass


def is_openmetrics(content_type: str) -> bool:
    """Whether a Content-Type ``negotiate`` chose is OpenMetrics' (its bodies end with ``# EOF``)."""
    return content_type.startswith("application/openmetrics-text")


def without_eof(body: bytes) -> bytes:
    """An OpenMetrics body without its final ``# EOF`` line: the start of a body whose rest, rendered
    separately, brings its own (both encoders render family by family, so the two parts joined are the
    body of all the families rendered at once)."""
    eof = _EOF.encode()
    if not body.endswith(eof):
        raise ValueError("not an OpenMetrics body: it does not end with '# EOF'")
    return body[: -len(eof)]


def gzip_accepted(accept_encoding: str | None) -> bool:
    """Whether an Accept-Encoding header names gzip (any q-value, as prometheus_client reads it)."""
    return any(part.split(";")[0].strip().lower() == "gzip" for part in (accept_encoding or "").split(","))


def restrict_families(families: Iterable[Metric], names: Collection[str]) -> Iterator[Metric]:
    """The families named in ``names`` whole, and of the others the samples named in ``names``.

    A name is a family's name (``gpu_energy_joules``) or a sample's (``gpu_energy_joules_total``,
    as prometheus_client's ``?name[]=`` filter takes them). A family left without samples is left
    out; a partly kept family keeps its help, type and unit.
    """
    wanted = names if isinstance(names, (set, frozenset)) else frozenset(names)
    for family in families:
        if family.name in wanted:
            yield family
            continue
        samples = [sample for sample in family.samples if sample.name in wanted]
        if samples:
            restricted = copy.copy(family)
            restricted.samples = samples
            yield restricted


# -- the fast path -----------------------------------------------------------------------------------


def _render_family(family: Metric, out: list[str], *, openmetrics: bool) -> None:
    """Append ``family``'s lines to ``out``; raise (anything) to leave it to prometheus_client."""
    name = family.name
    mtype = family.type
    unit = family.unit
    header_key = (openmetrics, name, mtype, family.documentation, unit)
    header = _header_cache.get(header_key)
    if header is None:
        header = _header(*header_key)
    out.append(header)
    append = out.append
    labels_cache = _label_cache
    values_cache = _value_cache
    checked: object = _UNCHECKED  # the last sample name found plain (a family's samples mostly share one)
    for sample_name, labels, value, timestamp, exemplar, native_histogram in family.samples:
        if timestamp is not None or exemplar is not None or native_histogram is not None:
            raise _SlowPath(name)
        if sample_name != checked:
            _check_sample_name(name, sample_name, openmetrics)
            checked = sample_name
        if labels:
            items = tuple(labels.items())
            label_text = labels_cache.get(items)
            if label_text is None:
                label_text = _label_text(items)
        else:
            label_text = None
        number = float(value)
        value_text = values_cache.get(number)
        if value_text is None:
            value_text = _value_text(number)
        if label_text is None:
            append(f"{sample_name} {value_text}\n")
        else:
            append(f"{sample_name}{{{label_text}}} {value_text}\n")


def _header(openmetrics: bool, name: str, mtype: str, documentation: str, unit: str) -> str:
    if mtype not in _FAST_TYPES or not _PLAIN_NAME.fullmatch(name):
        raise _SlowPath(name)
    if openmetrics:
        help_text = _escape_value(documentation)
        header = f"# HELP {name} {help_text}\n# TYPE {name} {mtype}\n"
        if unit:
            header += f"# UNIT {name} {unit}\n"
    else:
        text_name = name + _TEXT_NAME_SUFFIX[mtype]
        help_text = documentation.replace("\\", r"\\").replace("\n", r"\n")
        header = f"# HELP {text_name} {help_text}\n# TYPE {text_name} {_TEXT_TYPE[mtype]}\n"
    if len(_header_cache) >= HEADER_CACHE_MAX_ENTRIES:
        _header_cache.clear()
    _header_cache[openmetrics, name, mtype, documentation, unit] = header
    return header


def _check_sample_name(family_name: str, sample_name: str, openmetrics: bool) -> None:
    if not _PLAIN_NAME.fullmatch(sample_name):
        raise _SlowPath(sample_name)
    if not openmetrics and any(sample_name == family_name + suffix for suffix in _TEXT_MOVED_SUFFIXES):
        raise _SlowPath(sample_name)


def _label_text(items: tuple[tuple[str, str], ...]) -> str:
    parts = []
    for label_name, label_value in sorted(items):
        if not _PLAIN_NAME.fullmatch(label_name):
            raise _SlowPath(label_name)
        parts.append(f'{label_name}="{_escape_value(label_value)}"')
    text = ",".join(parts)
    if len(_label_cache) >= LABEL_CACHE_MAX_ENTRIES:
        _label_cache.clear()  # label sets churn slowly (pids); start over rather than track ages
    _label_cache[items] = text
    return text


def _float_to_go(number: float) -> str:
    """A sample value as Go's strconv writes it, which is what Prometheus and prometheus_client
    write: +Inf, -Inf, NaN, and for positive numbers of 7 or more integer digits an exponent (Go
    switches to one sooner than Python's repr)."""
    if number == _INF:
        return "+Inf"
    if number == -_INF:
        return "-Inf"
    if math.isnan(number):
        return "NaN"
    text = repr(number)
    dot = text.find(".")
    if number > 0 and dot > 6:
        digits = (text[1:dot] + text[dot + 1:]).rstrip("0")
        mantissa = (text[0] + "." + digits).rstrip(".")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _value_text(number: float) -> str:
    text = _float_to_go(number)
    if number != 0.0 and number - number == 0.0:  # finite, and not a zero (0.0 and -0.0 differ)
        if len(_value_cache) >= VALUE_CACHE_MAX_ENTRIES:
            _value_cache.clear()
        _value_cache[number] = text
    return text


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


# -- prometheus_client's encoders ---------------------------------------------------------------------


def _slow_text(families: list[Metric], escaping: str) -> bytes:
    # Imported here: prometheus_client's package imports its HTTP server and client (and ssl), which
    # the fast path never needs.
    from prometheus_client import exposition

    generate: Any = exposition.generate_latest
    if escaping == UNDERSCORES:  # the default: leave it out, for encoders that take no escaping
        return bytes(generate(_FixedCollector(families)))
    return bytes(generate(_FixedCollector(families), escaping=escaping))


def _slow_openmetrics(families: list[Metric], escaping: str, version: str) -> bytes:
    from prometheus_client.openmetrics import exposition

    generate: Any = exposition.generate_latest
    if escaping == UNDERSCORES and version == OPENMETRICS_VERSION:
        return bytes(generate(_FixedCollector(families)))
    return bytes(generate(_FixedCollector(families), escaping=escaping, version=version))
