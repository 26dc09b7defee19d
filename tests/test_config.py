import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from gpuscope.common.config_types import ConfigError
from gpuscope.common.durations import parse_duration
from gpuscope.common.sizes import parse_size
from gpuscope.config import Settings, load_settings


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gpuscope.yml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = load_settings()
    assert s.sample_interval == 1.0
    assert s.web.listen_address == ":9847"
    assert s.processes.cmdline is False
    assert s.idle_dips.threshold == 0.25


def test_file_values_with_durations(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, "sample_interval: 500ms\nweb:\n  listen_address: 127.0.0.1:9000\n"
                                      "idle_dips:\n  threshold: 0.3\n"))
    assert s.sample_interval == 0.5
    assert s.web.listen_address == "127.0.0.1:9000"
    assert s.idle_dips.threshold == 0.3


def test_precedence_flags_over_env_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "sample_interval: 5\nweb:\n  listen_address: ':1111'\nlog_level: debug\n")
    monkeypatch.setenv("GPUSCOPE_SAMPLE_INTERVAL", "2s")
    monkeypatch.setenv("GPUSCOPE_WEB__LISTEN_ADDRESS", ":2222")
    s = load_settings(path, {"web": {"listen_address": ":3333"}})
    assert s.sample_interval == 2.0  # env beats the file
    assert s.web.listen_address == ":3333"  # the flag beats the env
    assert s.log_level == "debug"  # untouched file value survives the merge


def test_errors_name_every_offending_key_path(tmp_path: Path) -> None:
    path = write(tmp_path, "sample_interval: fast\nweb:\n  listen_adress: ':1'\nidle_dips:\n  threshold: 2\n"
                           "colour: blue\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    problems = info.value.problems
    assert any(p.startswith("sample_interval:") and "'fast'" in p for p in problems)
    assert "web.listen_adress: unknown key (did you mean listen_address?)" in problems
    assert any(p.startswith("idle_dips.threshold:") for p in problems)
    assert "colour: unknown key" in problems
    assert str(path) in str(info.value)


def test_interval_bounds(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sample_interval"):
        load_settings(write(tmp_path, "sample_interval: 1ms\n"))


def test_bad_yaml_names_the_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="line 2"):
        load_settings(write(tmp_path, "log_level: info\n  web: x\n"))


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mapping"):
        load_settings(write(tmp_path, "- a\n- b\n"))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "absent.yml")


def test_bad_env_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCOPE_SAMPLE_INTERVAL", "soon")
    with pytest.raises(ConfigError, match="GPUSCOPE_"):
        load_settings()


def test_a_section_as_json_with_a_key_of_its_own_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCOPE_PODS", '{"keep_for": "1m", "refresh_interval": "30s"}')
    monkeypatch.setenv("GPUSCOPE_PODS__KEEP_FOR", "7m")  # the key's own variable wins over the section's
    monkeypatch.setenv("GPUSCOPE_CAPTURE__PROFILER_PORTS", "[6009, 9012]")  # a list: JSON
    monkeypatch.setenv("gpuscope_alerting__rules__gputhrottled__min_fraction", "0.75")  # any case
    s = load_settings()
    assert (s.pods.keep_for, s.pods.refresh_interval) == (420.0, 30.0)
    assert list(s.capture.profiler_ports) == [6009, 9012]
    assert s.alerting.rules.GpuThrottled.min_fraction == 0.75


def test_sections_given_whole_at_two_levels_both_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCOPE_ALERTING", '{"rules": {"GpuThrottled": {"for": "5m", "window": "10m"}}}')
    monkeypatch.setenv("GPUSCOPE_ALERTING__RULES", '{"GpuThrottled": {"min_fraction": 0.5}}')
    rule = load_settings().alerting.rules.GpuThrottled
    assert (rule.for_, rule.window, rule.min_fraction) == (300.0, 600.0, 0.5)


def test_keys_inside_a_section_given_as_json_are_read_in_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCOPE_WEB", '{"LISTEN_ADDRESS": ":1234"}')
    monkeypatch.setenv("GPUSCOPE_ALERTING__RULES", '{"gputhrottled": {"FOR": "5m"}}')
    s = load_settings()
    assert s.web.listen_address == ":1234" and s.alerting.rules.GpuThrottled.for_ == 300.0
    # Two spellings of one key: refused by name, neither dropped unseen.
    monkeypatch.setenv("GPUSCOPE_WEB", '{"listen_address": ":1", "LISTEN_ADDRESS": ":2"}')
    with pytest.raises(ConfigError, match="LISTEN_ADDRESS"):
        load_settings()


def test_one_setting_spelt_twice_in_the_environment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCOPE_SAMPLE_INTERVAL", "5s")
    monkeypatch.setenv("gpuscope_sample_interval", "7s")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.problems == ["GPUSCOPE_SAMPLE_INTERVAL, gpuscope_sample_interval: one setting given 2 "
                                   "times (the names differ only in letter case); keep one"]


def test_a_section_that_is_not_an_object_is_refused_by_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCOPE_WEB", "[1]")
    monkeypatch.setenv("GPUSCOPE_WEB__MAX_REQUESTS", "5")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert info.value.source == "GPUSCOPE_* environment variables"
    assert [p.partition(":")[0] for p in info.value.problems] == ["web"]


def test_the_environment_does_not_reach_a_settings_object_made_directly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCOPE_SAMPLE_INTERVAL", "5s")
    assert Settings().sample_interval == 1.0  # only load_settings reads the variables
    assert load_settings().sample_interval == 5.0


def test_retry_max_not_below_initial(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nvml\.retry_max"):
        load_settings(write(tmp_path, "nvml:\n  retry_initial: 10s\n  retry_max: 1s\n"))


def test_the_documented_example_is_a_valid_configuration(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    example = text[text.index("# /etc/gpuscope/gpuscope.yml"):]
    example = example[: example.index("```")]
    s = load_settings(write(tmp_path, example))
    assert s.alerting.alertmanager.url == "http://alertmanager.monitoring:9093"
    assert s.alerting.rules.GpuLowUtilization.window == 120.0


def test_alerting_problems_are_named(tmp_path: Path) -> None:
    path = write(tmp_path, "sample_interval: 2s\nalerting:\n  rules:\n    GpuLowUtilisation: {}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert ("alerting.rules.GpuLowUtilisation: unknown key (did you mean GpuLowUtilization?)"
            in info.value.problems)
    bad_url = write(tmp_path, "alerting:\n  alertmanager:\n    url: ftp://am:9093\n")
    with pytest.raises(ConfigError, match=r"alerting\.alertmanager\.url"):
        load_settings(bad_url)


def _bounded_fields(model: type[BaseModel], path: str = "") -> Iterator[tuple[str, str]]:
    """(key path, "duration" | "size") of every Duration and ByteSize field, sections included."""
    for name, field in model.model_fields.items():
        key = f"{path}{field.alias or name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _bounded_fields(annotation, key + ".")
            continue
        validators = {getattr(m, "func", None) for m in field.metadata}
        if parse_duration in validators:
            yield key, "duration"
        elif parse_size in validators:
            yield key, "size"


def _nested(key: str, value: object) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    *sections, last = key.split(".")
    for section in sections:
        node = node.setdefault(section, {})
    node[last] = value
    return out


def test_every_duration_and_size_is_range_checked() -> None:
    """A value no timer or file system could use is refused where it is read, with its key path."""
    fields = list(_bounded_fields(Settings))
    assert len(fields) >= 35 and ("alerting.alertmanager.resend_interval", "duration") in fields
    for key, kind in fields:
        huge = 1e12 if kind == "duration" else 2**60
        with pytest.raises(ConfigError) as caught:
            load_settings(overrides=_nested(key, huge))
        assert any(p.startswith(f"{key}: ") for p in caught.value.problems), (key, caught.value.problems)


@pytest.mark.parametrize(("yaml_text", "key"), [
    ("web:\n  config_file: ''\n", "web.config_file"),
    ("capture:\n  store:\n    root: '  '\n", "capture.store.root"),
    ("control:\n  tcp:\n    token_file: ''\n", "control.tcp.token_file"),
])
def test_an_empty_path_is_refused_not_read_as_the_working_directory(tmp_path: Path, yaml_text: str,
                                                                    key: str) -> None:
    config = tmp_path / "gpuscope.yml"
    config.write_text(yaml_text)
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: must not be empty"):
        load_settings(config)


def test_energy_interval_defaults_to_10s_and_is_bounded(tmp_path: Path) -> None:
    assert load_settings(write(tmp_path, "{}\n")).nvml.energy_interval == 10.0
    assert load_settings(write(tmp_path, "nvml:\n  energy_interval: 0s\n")).nvml.energy_interval == 0.0
    with pytest.raises(ConfigError, match=r"nvml\.energy_interval"):
        load_settings(write(tmp_path, "nvml:\n  energy_interval: 10m\n"))
