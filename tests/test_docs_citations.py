"""Code and tests cite the design by section (`docs/architecture.md §N`): every cited section
exists, and nothing cites a design file the repository does not hold."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITATION = re.compile(r"docs/architecture\.md §(\d+)")
SOURCES = [
    p
    for part in ("src", "tests", "benchmarks")
    for p in (ROOT / part).rglob("*")
    if p.suffix in {".py", ".cpp", ".sh", ".md"}
    and not any(part.startswith(".venv") for part in p.parts)  # .venv, benchmarks/.venv-default
    and p != Path(__file__).resolve()
]


def architecture_sections() -> set[int]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return {int(n) for n in re.findall(r"^## (\d+)\.", text, flags=re.M)}


def test_every_cited_architecture_section_exists():
    sections = architecture_sections()
    cited = {
        (p.relative_to(ROOT).as_posix(), int(n))
        for p in SOURCES
        for n in CITATION.findall(p.read_text(errors="replace"))
    }
    assert cited, "no file cites docs/architecture.md: the pattern no longer matches"
    assert [c for c in cited if c[1] not in sections] == []


def test_no_file_cites_a_design_document_outside_the_repository():
    outside = [
        p.relative_to(ROOT).as_posix()
        for p in SOURCES
        if "DESIGN.md" in p.read_text(errors="replace")
    ]
    assert outside == [], "cite docs/architecture.md, which the repository holds"
