"""Figures in the README and docs/ come from committed result files: every marked results
table in `readme_tables.DOCUMENTS` equals what `benchmarks/report/readme_tables.py` renders from the
files it names, no other Markdown file holds a marker, and every result file records how it
was produced (command, commit, machine, date)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.report import readme_tables

ROOT = Path(__file__).resolve().parents[2]

READMES = tuple(ROOT / doc for doc in readme_tables.DOCUMENTS)
RESULTS = ROOT / "benchmarks" / "results"


def _markdown_files() -> list[Path]:
    return sorted(
        p
        for p in ROOT.rglob("*.md")
        if not any(
            part.startswith(".") or part in {"third_party", "node_modules"}
            for part in p.relative_to(ROOT).parts
        )
    )


def _marked() -> list[tuple[str, str, tuple[str, ...], list[str]]]:
    out = []
    for readme in READMES:
        for name, files, lines in readme_tables.marked_tables(readme.read_text()):
            out.append((readme.relative_to(ROOT).as_posix(), name, files, lines))
    return out


MARKED = _marked()


def test_documents_exist() -> None:
    missing = [doc for doc, path in zip(readme_tables.DOCUMENTS, READMES) if not path.is_file()]
    assert not missing, f"readme_tables.DOCUMENTS names missing files: {missing}"


def test_every_renderer_has_its_table_in_a_document() -> None:
    assert {name for _, name, _, _ in MARKED} == set(readme_tables.TABLES)


def test_markers_only_in_the_listed_documents() -> None:
    listed = set(READMES)
    stray = [
        p.relative_to(ROOT).as_posix()
        for p in _markdown_files()
        if p not in listed and readme_tables.marked_tables(p.read_text(encoding="utf-8"))
    ]
    assert not stray, f"results markers outside readme_tables.DOCUMENTS (add them there): {stray}"


def test_check_mode_agrees(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m benchmarks.report.readme_tables --check` passes on the committed documents."""
    assert readme_tables.check() == []
    assert readme_tables.main(["--check"]) == 0
    assert "agrees" in capsys.readouterr().out


def test_help_and_an_unknown_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert readme_tables.main(["--help"]) == 0
    assert "--check" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"unknown table nope; the tables: .*ruler_10x"):
        readme_tables.main(["nope"])


def test_check_mode_finds_a_changed_table(tmp_path: Path) -> None:
    readme, name, _, lines = next(m for m in MARKED if m[0] == "README.md")
    row = lines[2]
    changed = row.replace(" |", " 9 |", 1)  # the first cell gains a 9
    text = (ROOT / readme).read_text().replace(row, changed, 1)
    (tmp_path / "README.md").write_text(text)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "results").symlink_to(RESULTS)
    problems = readme_tables.check(("README.md",), tmp_path)
    assert problems == [f"README.md: the {name} table differs from its files"]


@pytest.mark.parametrize(
    ("readme", "name", "files", "lines"), MARKED, ids=[f"{r}:{n}" for r, n, _, _ in MARKED]
)
def test_table_matches_its_result_file(
    readme: str, name: str, files: tuple[str, ...], lines: list[str]
) -> None:
    want_files, want = readme_tables.render(name)
    assert files == want_files, f"{readme}: the {name} marker names {files}, not {want_files}"
    got = [readme_tables.normalize(x) for x in lines]
    expected = [readme_tables.normalize(x) for x in want]
    assert got == expected, (
        f"{readme}: the {name} table differs from its files; "
        f"`python -m benchmarks.report.readme_tables {name}` prints it:\n" + "\n".join(want)
    )


@pytest.mark.parametrize(
    "path",
    sorted([*RESULTS.glob("*.json"), *RESULTS.glob("ruler/*.json")]),
    ids=lambda p: p.relative_to(RESULTS).as_posix(),
)
def test_result_file_records_its_provenance(path: Path) -> None:
    prov = json.loads(path.read_text()).get("provenance")
    assert isinstance(prov, dict), f"{path.name} has no provenance block"
    for key in ("command", "commit", "machine", "date"):
        assert prov.get(key), f"{path.name}: provenance.{key} is empty"
    assert re.fullmatch(r"[0-9a-f]{40}", prov["commit"]), prov["commit"]


def _named_results(text: str) -> set[str]:
    """Patterns of result files a document names: `X.json`, `X.{json,png}`, `X.*`, `X*.json`."""
    out = set()
    for token in re.findall(r"benchmarks/results/([\w.*{},/-]+)", text):
        token = token.rstrip(".,")
        m = re.fullmatch(r"(.*)\{([\w,]+)\}", token)
        out.update(f"{m.group(1)}{e}" for e in m.group(2).split(",")) if m else out.add(token)
    return out


def test_result_files_the_readmes_name_exist() -> None:
    named = set().union(*(_named_results(r.read_text()) for r in READMES))
    assert len(named) > 10
    missing = sorted(n for n in named if not list(RESULTS.glob(n)))
    assert not missing, f"the documents name result files that are not committed: {missing}"
