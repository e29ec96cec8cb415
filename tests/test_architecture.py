"""The map in docs/architecture.md is true: every module of the package is on it, every path it names exists,
and it lists the same decoding methods as the registry and the README. A newcomer reads the map first; a map
that drifts from the code is worse than none."""

from __future__ import annotations

import re
from itertools import takewhile
from pathlib import Path

from rasd.decoding.proposers import METHODS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rasd"
DOC = ROOT / "docs" / "architecture.md"
BASELINES = {"hf", "hf-pld", "hf-assisted"}


def section(text: str, title: str) -> str:
    """The body of a `## title` section (up to the next `## `)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert match, f"docs/architecture.md has no '## {title}' section"
    return match.group(1)


def map_entries(text: str) -> list[str]:
    """Paths listed in the package map's tree, relative to the repository: indentation gives the folder.

    A line is `NAMES description`: one folder (`x/`) or one or more `.py` files, then words; a line that
    starts with a plain word continues the description above it.
    """
    block = re.search(r"```\n(rasd/\n.*?)```", section(text, "Package map"), flags=re.S)
    assert block, "the package map is a fenced tree starting with rasd/"
    stack: list[tuple[int, str]] = []
    paths = []
    for line in block.group(1).splitlines():
        names = list(takewhile(lambda word: re.fullmatch(r"[\w.-]+(\.py|/)", word), line.split()))
        if not names:          # a blank line or a description's continuation
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = "".join(name for _, name in stack)
        for name in names:
            paths.append(parent + name)
        if names[0].endswith("/"):
            stack.append((indent, names[0]))
    return paths


def modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}


def test_every_module_is_on_the_map() -> None:
    listed = set(map_entries(DOC.read_text()))
    assert sorted(modules() - listed) == []


def test_every_path_on_the_map_exists() -> None:
    missing = [p for p in map_entries(DOC.read_text()) if not (ROOT / p.rstrip("/")).exists()]
    assert missing == []


def test_every_code_path_named_in_the_text_exists() -> None:
    """Backticked paths such as `decoding/step/verify.py` resolve under rasd/ or the repository root."""
    named = set(re.findall(r"`((?:[\w.-]+/)+[\w.-]*\.(?:py|md|yaml|sh|json))`", DOC.read_text()))
    missing = [p for p in named if not (PACKAGE / p).exists() and not (ROOT / p).exists()]
    assert sorted(missing) == []


def method_names(table: str) -> set[str]:
    """First-column backticked names of a markdown table."""
    return set(re.findall(r"^\| `([\w-]+)` \|", table, flags=re.M))


def test_the_map_lists_the_registry_and_the_readme_methods() -> None:
    doc_methods = method_names(section(DOC.read_text(), "Methods"))
    readme_methods = method_names((ROOT / "README.md").read_text())
    assert doc_methods - BASELINES == set(METHODS)
    assert readme_methods - BASELINES == set(METHODS)
    assert doc_methods & BASELINES == readme_methods & BASELINES


def test_the_map_parser_can_fail(tmp_path: Path) -> None:
    text = ("## Package map\n```\nrasd/\n  a/          the a\n    b.py c.py two of them\n      and more\n"
            "  d.py        one\n```\n")
    assert map_entries(text) == ["rasd/", "rasd/a/", "rasd/a/b.py", "rasd/a/c.py", "rasd/d.py"]
