import pytest

from gpuscope.common.durations import format_duration, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [(1, 1.0), (0.5, 0.5), ("2", 2.0), ("1.5", 1.5), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0),
     ("1m30s", 90.0), (" 10s ", 10.0)],
)
def test_parse_duration(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "fast", "10 s", "5d", "-1", -2, True, None, "nan", "1s2"])
def test_parse_duration_rejects_with_the_value_named(bad: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


def test_format_duration_round_trips() -> None:
    for seconds in (0.5, 1.0, 90.0, 120.0):
        assert parse_duration(format_duration(seconds)) == seconds
