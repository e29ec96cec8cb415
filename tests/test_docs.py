"""The user docs hold their promises: a short README with the two commands, and no link to a file that is not
in the repository (README and every page under docs/)."""

from __future__ import annotations

import json
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


# ------------------------------------------------------------------- the current pages (not the lab notes)


def current_pages() -> list[Path]:
    """What a user reads: the README and docs/*.md; docs/lab-notes/ is the dated history."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids of a Markdown page: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for title in re.findall(r"^#+ +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_link_of_a_current_page_reaches_its_file_and_heading() -> None:
    broken = []
    for page in current_pages():
        for target in relative_links(page):
            path, _, anchor = target.partition("#")
            file = page.parent / path if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.relative_to(ROOT)} -> {target} (no such heading)")
    assert broken == []


def test_the_anchor_check_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Spec-Bench on a CPU (v16)\n## `rasd load`: the service\n## Twice\n## Twice\n")
    assert anchors(page) == {"spec-bench-on-a-cpu-v16", "rasd-load-the-service", "twice", "twice-1"}


def test_every_tool_the_current_pages_name_exists() -> None:
    """`bench/x.py`, `scripts/x.py`, `tests/...` named in a command must be in the tree (scripts move and go)."""
    named = {(page.name, m) for page in current_pages()
             for m in re.findall(r"\b((?:bench|scripts|tests)/[\w/]+\.py)\b", page.read_text())}
    assert named and [f"{page} names {path}" for page, path in sorted(named) if not (ROOT / path).exists()] == []


def test_result_files_are_the_ones_current_pages_link_to() -> None:
    """docs/results/ and docs/gpu/ keep the latest file of each benchmark, each linked from a current page;
    superseded runs live in git history (docs/lab-notes/benchmark-history.md)."""
    linked = {(page.parent / t.partition("#")[0]).resolve() for page in current_pages() for t in relative_links(page)}
    files = [f for d in ("results", "gpu") for f in (ROOT / "docs" / d).rglob("*") if f.is_file()]
    assert files and [str(f.relative_to(ROOT)) for f in files if f.resolve() not in linked] == []


def test_benchmark_sections_are_current_and_say_how_and_where() -> None:
    """docs/benchmarks.md shows no dated or superseded section; each measured section gives its command and its
    machine."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    headings = re.findall(r"^#{2,3} +(.+)$", text, flags=re.M)
    assert [h for h in headings if re.search(r"\d{4}-\d{2}-\d{2}|latest|session", h, flags=re.I)] == []
    sections = re.split(r"^#{2,3} +.+$", text, flags=re.M)[1:]
    for heading, body in zip(headings, sections, strict=True):
        if "|---" not in body or heading == "Data":
            continue
        assert re.search(r"```bash|`(?:rasd|python) [^`]+`", body), f"{heading}: no command"
        assert re.search(r"\b(?:VM|CPU|GPU|H100|H200|cores?)\b", body), f"{heading}: no machine"


def test_the_shipped_heads_metadata_names_its_real_parent_and_the_recipe_rebuilds_it() -> None:
    """The head's report names its parent by version and commit, not a temporary file; the last command of
    docs/methods.md's recipe carries the flags the report records."""
    report = json.loads((ROOT / "rasd/decoding/model/heads/smollm2-135m-instruct.json").read_text())
    parent = report["parent"]
    assert re.fullmatch(r"v\d+", parent["version"]) and re.fullmatch(r"[0-9a-f]{7,40}", parent["commit"])
    assert not any(str(v).startswith(("/tmp", "/root", "~")) for v in (report["init"], *parent.values()))
    methods = (ROOT / "docs" / "methods.md").read_text()
    recipe = methods.split("### Rebuilding the shipped head", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    last = re.findall(r"^\$E .+?(?=^\$E |\Z)", recipe, flags=re.M | re.S)[-1].replace("\\\n", " ")
    flags = dict(re.findall(r"--([\w-]+) +([^\s-][^\s]*)", last))
    assert f"--out $H/{report['version']}.safetensors" in " ".join(last.split())
    assert flags["init"] == f"$H/{parent['version']}.safetensors"
    expected = {"steps": report["steps"], "lr": report["lr"], "seed": report["seed"], "samples": report["samples"],
                "max-answers": report["max_answers"], "average-init": report["average_init"],
                "taps": ",".join(map(str, report["taps"])), "temperature": report["temperature"],
                "turns": ",".join(map(str, report["turns"]))}
    assert {k: str(v) for k, v in expected.items()} == {k: _number(flags[k]) for k in expected}


def _number(text: str) -> str:
    """A flag's value as the report writes it (`3e-4` -> `0.0003`)."""
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() and "." not in text and "e" not in text else str(value)
