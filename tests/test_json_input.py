"""JSON from outside read within bounds: size, depth, encoding, and no input that makes the depth
check itself slow."""

from __future__ import annotations

import threading

import pytest

from gpuscope.common.json_input import JsonInputError, load_json, nesting_depth


@pytest.mark.parametrize(("data", "depth"), [
    (b"{}", 1), (b"1", 0), (b'{"a": [[1], {"b": []}]}', 4), (b'["[[[[", "]]"]', 1),
    (b'["\\"[[["]', 1), (b'"unterminated [[[', 0), (b"]]][[", 0),
])
def test_depth_ignores_brackets_inside_strings(data: bytes, depth: int) -> None:
    assert nesting_depth(data) == depth


def test_valid_json_within_bounds_loads() -> None:
    assert load_json(b'{"a": [1, "x"]}', max_bytes=100) == {"a": [1, "x"]}


@pytest.mark.parametrize(("data", "reason"), [
    (b"x" * 101, "101 bytes exceeds the limit of 100"),
    (b"[" * 33 + b"]" * 33, "nested 33 levels deep; at most 32"),
    (b'"\xff"', "not UTF-8: invalid start byte at byte 1"),
    (b"{'a': 1}", "not JSON"),
    (b"[NaN]", "NaN is not a JSON value"),
    (b"[-Infinity]", "-Infinity is not a JSON value"),
])
def test_input_out_of_bounds_is_refused_with_the_reason(data: bytes, reason: str) -> None:
    with pytest.raises(JsonInputError, match=reason):
        load_json(data, max_bytes=100)


@pytest.mark.parametrize("data", [
    b'"' + b'\\"' * 500_000,  # one unterminated string of escaped quotes: quadratic for a naive scan
    b"[" * 1_000_000,
    b'"' * 1_000_000,
])
def test_a_megabyte_of_hostile_input_is_refused_promptly(data: bytes) -> None:
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            load_json(data, max_bytes=1 << 20)
        except JsonInputError as err:
            outcome.append(err)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(60)  # a linear scan takes milliseconds; the quadratic one took hours
    assert not worker.is_alive(), "the depth check did not finish"
    assert outcome and isinstance(outcome[0], JsonInputError)
