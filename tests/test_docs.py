"""The user docs hold their promises: a short README with the two commands, and no link to a file that is not
in the repository (README and every page under docs/)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(page: Path) -> list[str]:
    """Link targets that point into the repository (fenced code is skipped; URLs are not checked)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t) and not t.startswith(("<", "#"))]


def test_readme_is_short_and_has_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "make run" in readme and "make test" in readme


def test_every_linked_file_exists() -> None:
    missing = [f"{page.relative_to(ROOT)} -> {target}" for page in pages() for target in relative_links(page)
               if not (page.parent / target.partition("#")[0]).exists()]
    assert missing == []


def test_the_link_check_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [gone](nope.md) [web](https://example.org) ```\n[code](x.md)\n```")
    assert relative_links(page) == ["page.md", "nope.md"]
