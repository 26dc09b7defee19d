"""A mistyped flag, subcommand or configuration key is refused with the closest known names."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuscope.cli.main import main
from gpuscope.common.config_types import ConfigError
from gpuscope.common.suggestions import did_you_mean
from gpuscope.config import load_settings
from gpuscope.simulate.loader import ScenarioError, parse_scenario
from gpuscope.web.web_config import load_web_config


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_a_mistyped_flag_names_the_closest_flag_of_its_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert refused(capsys, "capture", "--gpus", "0").endswith(
        "error: unrecognized arguments: --gpus 0 (did you mean --gpu?)")
    assert refused(capsys, "run", "--sample-intervl", "1s").endswith("(did you mean --sample-interval?)")
    # A subcommand's own flags: `captures ls` has --json.
    assert refused(capsys, "captures", "ls", "--jsno").endswith(
        "unrecognized arguments: --jsno (did you mean --json?)")
    several = refused(capsys, "capture", "--gpus", "0", "--durration=2s", "--zzzzzz")
    assert several.endswith("(did you mean --gpu for --gpus, --duration for --durration?)")
    assert refused(capsys, "capture", "--zzzzzz").endswith("unrecognized arguments: --zzzzzz")


def test_a_mistyped_subcommand_names_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    assert refused(capsys, "captrue").endswith(
        "argument COMMAND: invalid choice: 'captrue' (did you mean capture or captures?)")
    assert refused(capsys, "captures", "lss").endswith("invalid choice: 'lss' (did you mean ls?)")
    assert "(choose from " in refused(capsys, "zzz"), "nothing close: argparse's own list"


def test_a_mistyped_configuration_key_names_the_closest_key_of_its_section(tmp_path: Path) -> None:
    path = tmp_path / "gpuscope.yml"
    path.write_text("sample_intervl: 1s\n"
                    "capture:\n  hourly_budgt: 3\n  store: {quota: 1GiB}\n  targets: [{adress: 'a:1'}]\n"
                    "alerting:\n  rules:\n    GpuLowUtilization: {windw: 1m, for: 1m}\n"
                    "zzzzzz: 1\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    problems = caught.value.problems
    assert "sample_intervl: unknown key (did you mean sample_interval?)" in problems
    assert "capture.hourly_budgt: unknown key (did you mean hourly_budget?)" in problems
    assert "capture.store.quota: unknown key (did you mean quota_bytes?)" in problems
    assert "capture.targets[0].adress: unknown key (did you mean address?)" in problems
    assert "alerting.rules.GpuLowUtilization.windw: unknown key (did you mean window?)" in problems
    assert "zzzzzz: unknown key" in problems


def test_did_you_mean() -> None:
    assert did_you_mean("gpus", ["gpu", "pid"]) == " (did you mean gpu?)"
    assert did_you_mean("xyz", ["gpu", "pid"]) == ""
    assert did_you_mean("captrue", ["capture", "captures", "run"]) == " (did you mean capture or captures?)"
    assert did_you_mean("GpuLowUtilisation", ["GpuLowUtilization", "GpuUtilizationSkew"]) == \
        " (did you mean GpuLowUtilization?)", "only the names about as close as the best"


def test_a_mistyped_key_of_a_scenario_or_of_the_web_configuration_names_the_closest(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError) as scenario:
        parse_scenario("duratoin: 60s\ngpus: []\n", source="typo.yml")
    assert "duratoin: unknown key (did you mean duration?)" in scenario.value.problems
    web = tmp_path / "web.yml"
    web.write_text("basic_auth_user: {}\n")
    with pytest.raises(ConfigError) as config:
        load_web_config(web)
    assert "basic_auth_user: unknown key (did you mean basic_auth_users?)" in config.value.problems
