"""The README and docs/ stay true to the repository: the config page is the code's own listing, the README
stays short, no page names anything outside the repository, and every relative link reaches a file. That no page
names a commit (it asks git): tests/integration/test_docs_commits.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deploy.config_list import MARKDOWN_COMMAND, render_markdown

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250  # a README gets a user to a first run and points onward; the rest is in docs/


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_configuration_page_is_generated():
    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == render_markdown(), (
        f"docs/configuration.md differs from the listing of protocol/config/: regenerate it with `{MARKDOWN_COMMAND}`"
    )


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


# Text that only makes sense to someone inside the team that wrote it, or points off the repository.
OUTSIDE = [
    r"\.\./shared",
    r"DESIGN\.md",
    r"design card",
    r"this workplace",
    r"the session before",
    r"/work/",
    r"\bissue #?\d+",
]


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_references_outside_the_repository(page):
    text = page.read_text()
    found = [m.group(0) for pattern in OUTSIDE for m in re.finditer(pattern, text, re.IGNORECASE)]
    assert not found, f"{page.relative_to(ROOT)} refers outside the repository: {sorted(set(found))}"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.DOTALL)


def anchors(page: Path) -> set[str]:
    """The heading anchors GitHub makes: lower case, punctuation dropped, spaces to hyphens, -1, -2 for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _without_code_blocks(page.read_text()), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(_without_code_blocks(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        linked = (page.parent / path) if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to files or headings that do not exist: {broken}"
