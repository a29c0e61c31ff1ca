"""The method reference lives in the repository (docs/reference/) and every citation of it
resolves: no file cites a page that is not there, and no link of the reference is broken."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_DIR = ROOT / "docs" / "reference"
SCANNED = ("mmgoal", "tools", "docs", "tests", "bench", "configs", "README.md")
# Built from parts so that this file does not cite them itself.
OUTSIDE_NOTES = tuple(name + ".md" for name in ("REFERENCE", "DESIGN"))
CITATION = re.compile(r"docs/reference/[\w/.-]+?\.md")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+\s+(.+?)\s*$", re.MULTILINE)


def scanned_files() -> list[Path]:
    """Every file of the scanned folders, caches and hidden folders left out."""
    files = []
    for name in SCANNED:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        files += [f for f in candidates if f.is_file() and f.suffix != ".pyc"
                  and not any(part.startswith(".") or part == "__pycache__"
                              for part in f.relative_to(ROOT).parts)]
    return files


def text_of(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def slug(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_reference_pages_exist():
    pages = {p.name for p in REFERENCE_DIR.glob("*.md")}
    assert {"index.md", "goal.md", "objectives.md", "dual_encoders.md", "scan.md", "xvlm.md",
            "retrieval.md"} <= pages


def test_no_file_cites_notes_outside_the_repository():
    offenders = [f"{path.relative_to(ROOT)}: {note}" for path in scanned_files()
                 for note in OUTSIDE_NOTES if note in text_of(path)]
    assert not offenders, ("these cite notes that are not in the repository; cite "
                           "docs/reference/<page>.md instead:\n" + "\n".join(offenders))


def test_every_cited_reference_page_exists():
    cited = {(path.relative_to(ROOT), page) for path in scanned_files()
             for page in CITATION.findall(text_of(path))}
    assert any(str(page) == "docs/reference/goal.md" for _, page in cited)
    missing = [f"{path}: {page}" for path, page in sorted(cited) if not (ROOT / page).is_file()]
    assert not missing, "cited pages that do not exist:\n" + "\n".join(missing)


def markdown_links() -> list[tuple[Path, str]]:
    """Relative links of the reference pages, and links of other pages into them."""
    pages = sorted(REFERENCE_DIR.glob("*.md"))
    others = [p for p in sorted((ROOT / "docs").rglob("*.md")) if p.parent != REFERENCE_DIR]
    links = [(page, target) for page in pages for target in LINK.findall(text_of(page))]
    links += [(page, target) for page in others + [ROOT / "README.md"]
              for target in LINK.findall(text_of(page)) if "reference/" in target]
    return [(page, target) for page, target in links
            if not re.match(r"[a-z]+:", target) and not target.startswith("#")]


@pytest.mark.parametrize("page,target", markdown_links(),
                         ids=lambda x: x.name if isinstance(x, Path) else x)
def test_markdown_links_resolve(page, target):
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve()
    assert resolved.is_file(), f"{page.relative_to(ROOT)} links to {target}: no such file"
    if anchor and resolved.suffix == ".md":
        anchors = {slug(h) for h in HEADING.findall(text_of(resolved))}
        assert anchor in anchors, (f"{page.relative_to(ROOT)} links to {target}: no heading "
                                   f"with that anchor; headings: {sorted(anchors)}")
