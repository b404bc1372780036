"""The repository's Markdown documents link only to files that are in the repository.

A user who clones the project sees nothing beside the checkout, so a relative link must
resolve inside it (web links are not checked).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOCS = sorted(
    p
    for p in ROOT.rglob("*.md")
    if not any(
        part.startswith(".") or part in {"third_party", "node_modules"}
        for part in p.relative_to(ROOT).parts
    )
)


def test_docs_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "ARCHITECTURE.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve_inside_the_repository(doc: Path) -> None:
    bad = []
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # web link, mailto:, or an anchor in the same page
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            bad.append(target)
    assert not bad, (
        f"{doc.relative_to(ROOT)} links outside the repository or to missing files: {bad}"
    )


def test_the_readme_reads_in_two_screens() -> None:
    """The front page: at most 120 lines, none over 200 characters (a results marker, an HTML
    comment GitHub does not show, aside: it names its files); its figures sit in marked tables,
    which tests/benchmarks/test_readme_results.py checks against their result files."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 120
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 200]
    assert [n for n in long if not lines[n - 1].startswith("<!-- results: ")] == []
