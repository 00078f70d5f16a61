"""The README is an entry and docs/ the manual: every relative link lands on a file (and heading), the README stays
short and opens with the two fresh-machine commands, and every docs page is reachable from the index."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code, where a Markdown link is a link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens, -1/-2 on repeats."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def relative_links(page: Path) -> list[str]:
    return [
        target for target in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", target)
    ]  # https:, mailto:, ... are not checked here


def test_anchors_follow_githubs_rules():
    text = "# Memory planning: `llmft plan`\n## Will it fit? `llmft plan --model`\n## W&B on compute nodes\n## CPUs\n## CPUs\n"
    assert heading_anchors(text) == {
        "memory-planning-llmft-plan",
        "will-it-fit-llmft-plan---model",
        "wb-on-compute-nodes",
        "cpus",
        "cpus-1",
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_at_an_existing_file_and_heading(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(REPO) if file.is_relative_to(REPO) else file}")
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert broken == []


def test_readme_is_an_entry_that_starts_with_make_demo_then_make_test():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 250  # the manual goes to docs/
    first_block = re.search(r"^```\w*\n(.*?)^```", text, re.S | re.M).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.split("#")[0].strip()]
    assert commands[:2] == ["make demo", "make test"]


def test_every_docs_page_is_linked_from_the_index_and_the_readme():
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"README.md"}
    assert pages >= {
        "training.md",
        "memory-planning.md",
        "checkpoints.md",
        "slurm.md",
        "inference.md",
        "evaluation.md",
        "clusters.md",
        "development.md",
    }
    index = {Path(t.partition("#")[0]).name for t in relative_links(REPO / "docs" / "README.md")}
    readme = {Path(t.partition("#")[0]).name for t in relative_links(REPO / "README.md") if t.startswith("docs/")}
    assert pages - index == set()
    assert pages - readme == set()


def test_the_package_description_is_the_readme():
    from setuptools.config.setupcfg import read_configuration

    metadata = read_configuration(REPO / "setup.cfg")["metadata"]
    assert metadata["long_description"] == (REPO / "README.md").read_text()
