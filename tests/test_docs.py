"""The README and the docs as a newcomer meets them: the two commands on a fresh machine are the ones
CI runs, every relative link leads to a file that exists (and to a heading that exists, where it names
one), the README links every document, and every benchmark the figures cite is a script in bench/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, ROOT / "CONTRIBUTING.md", *DOCS]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text outside fenced code blocks and code spans, where a link is a link."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(path: Path) -> list[str]:
    return _LINK.findall(prose(path.read_text()))


def anchors(markdown: str) -> set[str]:
    """The fragment ids GitHub gives the headings of a Markdown text (a repeated one gets -1, -2...)."""
    seen: dict[str, int] = {}
    out = set()
    for title in _HEADING.findall(_FENCE.sub("", markdown)):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto: ...


def test_anchors_follow_githubs_rules() -> None:
    # The slugs the link check relies on, for the kinds of headings the docs have.
    page = ("# GPU-hours by owner: `gpuscope report`\n## Docker on one host\n"
            "## Limits\n```\n# no heading\n```\n## Limits\n")
    assert anchors(page) == {"gpu-hours-by-owner-gpuscope-report", "docker-on-one-host", "limits", "limits-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_an_existing_file_and_heading(page: Path) -> None:
    broken = []
    for target in links(page):
        if not relative(target):
            continue
        file_part, _, fragment = target.partition("#")
        destination = (page.parent / file_part).resolve() if file_part else page
        if not destination.exists():
            broken.append(f"{target}: no file {destination}")
        elif fragment and destination.suffix == ".md" and fragment not in anchors(destination.read_text()):
            broken.append(f"{target}: no heading #{fragment} in {destination.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_links_every_document() -> None:
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(README) if relative(target)}
    missing = [p.relative_to(ROOT) for p in [ROOT / "CONTRIBUTING.md", *DOCS] if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


def section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"no section '## {title}'"
    return match.group(1)


def test_the_two_commands_on_a_fresh_machine_are_the_demo_and_what_ci_runs() -> None:
    body = section(README.read_text(), "Two commands on a fresh machine")
    (block,) = re.findall(r"^```sh\n(.*?)^```", body, re.MULTILINE | re.DOTALL)
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    assert [c for c in commands if c] == ["scripts/demo.sh", "scripts/test.sh"]
    for script in ("scripts/demo.sh", "scripts/test.sh", ".ci/run"):
        assert (ROOT / script).stat().st_mode & 0o111, f"{script} is not executable"
    # The demo installs the checkout and runs the simulated `demo` node; CI runs the test command.
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert "pip install" in demo and re.search(r"gpuscope run --simulate demo\b", demo)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.startswith("#")]
    assert [line for line in ci if line.strip()][-1].split()[-1] in ("./scripts/test.sh", "scripts/test.sh")


def test_every_benchmark_cited_for_a_figure_is_a_script_in_bench() -> None:
    text = (ROOT / "docs" / "performance.md").read_text()
    cited = set(re.findall(r"\bbench/([\w/]+\.py)\b", text))
    assert {"overhead.py", "compare.py", "soak.py", "concurrency.py", "analysis.py",
            "scrape_concurrency.py"} <= cited
    assert not [name for name in sorted(cited) if not (ROOT / "bench" / name).is_file()]


def exposure_score(path: Path) -> str:
    match = re.search(r"exposure (?:level|score)[^0-9]{0,40}(\d+\.\d)", path.read_text())
    assert match, f"{path.name} states no exposure score"
    return match.group(1)


def test_the_readme_states_the_exposure_score_of_the_deploy_guide() -> None:
    # tests/test_deploy.py measures the score with systemd-analyze; this holds without it.
    assert exposure_score(README) == exposure_score(ROOT / "docs" / "deploy.md")
