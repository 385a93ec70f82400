"""User pages teach: each page of the docs' navigation is at most 2,500 words, and at most a
fifth of its words are dated measurements; those live on docs/results.md, which names every
folder of raw rows under bench/results/.

A block (a paragraph, a list, a table, a heading; code fences are blocks of their own) is
*dated* where it names a date (`2026-12-06`, `December 2026`; a link's target does not
count), where it is a table right after a dated block (the paragraph that introduces it),
or where it sits under a heading that names a date. Words are counted as `wc -w` counts
them, in the page's own source (tables a page includes from a generated file, as
typing.md's checker table, are not counted)."""

import pathlib
import re

import pytest


pytestmark = pytest.mark.once

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MAX_WORDS = 2500
MAX_DATED_SHARE = 0.20
# The one page of dated measurements, exempt from both limits.
RESULTS = "results.md"
# Not user pages (none: the contributors' map of the code, architecture.md, keeps the
# limits too).
NOT_USER_PAGES: set[str] = set()

_DATE = re.compile(
    r"\b20\d\d-\d\d-\d\d|\b(January|February|March|April|May|June|July|August|September"
    r"|October|November|December) 20\d\d\b")
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_HEADING = re.compile(r"^(#{1,6}) ")


def nav_pages() -> list[str]:
    """The pages of mkdocs.yml's `nav`, relative to docs/ (read without a YAML parser: each
    entry ends in its page's path)."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:"):]
    return re.findall(r"^\s*- (?:[^\n]*?: )?\"?([\w./-]+\.md)\"?\s*$", nav, re.MULTILINE)


def blocks(text: str) -> list[list[str]]:
    """The page's blocks: runs of lines between blank lines and headings, a fence whole."""
    out: list[list[str]] = []
    current: list[str] = []
    fence = None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is not None:
            current.append(line)
            if m and m[1][0] == fence:
                fence = None
            continue
        if m:
            fence = m[1][0]
            current.append(line)
            continue
        if not line.strip() or _HEADING.match(line):
            if current:
                out.append(current)
                current = []
            if line.strip():
                out.append([line])
            continue
        current.append(line)
    if current:
        out.append(current)
    return out


def dated_words(text: str) -> tuple[int, int]:
    """`(words in dated blocks, words)` of a page's source."""
    total = dated = 0
    previous = False
    section: int | None = None  # the level of the dated heading we are under
    for block in blocks(text):
        source = "\n".join(block)
        words = len(source.split())
        total += words
        names_date = _DATE.search(_LINK_TARGET.sub("]", source)) is not None
        heading = _HEADING.match(block[0])
        if heading:
            level = len(heading[1])
            if section is not None and level <= section:
                section = None
            if names_date and section is None:
                section = level
        is_table = block[0].lstrip().startswith("|")
        is_dated = names_date or (is_table and previous) or section is not None
        dated += words if is_dated else 0
        previous = is_dated
    return dated, total


_USER_PAGES = [p for p in nav_pages() if p != RESULTS and p not in NOT_USER_PAGES]


def test_nav_is_read_and_results_page_is_in_it():
    pages = nav_pages()
    assert RESULTS in pages
    for page in ("index.md", "models.md", "benchmark.md", "capacity.md", "api/index.md"):
        assert page in pages, page
    assert all((DOCS / p).is_file() for p in pages)


@pytest.mark.parametrize("page", _USER_PAGES)
def test_user_page_is_short_and_mostly_not_dated(page):
    dated, total = dated_words((DOCS / page).read_text())
    assert total <= MAX_WORDS, f"docs/{page}: {total} words (at most {MAX_WORDS})"
    assert dated <= MAX_DATED_SHARE * total, (
        f"docs/{page}: {dated} of {total} words are dated measurements "
        f"({dated / total:.0%}; at most {MAX_DATED_SHARE:.0%}): move them to docs/{RESULTS}")


def test_results_page_names_every_folder_of_raw_rows():
    text = (DOCS / RESULTS).read_text()
    folders = sorted(p.name for p in (ROOT / "bench" / "results").iterdir() if p.is_dir())
    assert folders
    for folder in folders:
        assert f"bench/results/{folder}/" in text, folder


def test_the_rule_counts_what_it_says_and_can_fail():
    teaching = " ".join(["word"] * 80)
    page = (f"# Title\n\n{teaching}\n\nMeasured 2026-12-06 on a chip, ten words here in all.\n\n"
            "| a | b |\n| --- | --- |\n| 1 | 2 |\n\n"
            "See [results](results.md#measured-2026-12-06).\n\n"
            "```python\nx = '2026-12-06'  # a code block is a block too\n```\n\n"
            "## Results (December 2026)\n\nunder a dated heading\n\n### deeper\n\nstill\n\n"
            "## Next\n\nnot dated\n")
    dated, total = dated_words(page)
    assert total == len(page.split())
    # the dated paragraph (10 words), its table (15), the code block (13), the dated
    # heading (4) and what is under it (4 + 2 + 1); not the link's target
    assert dated == 10 + 15 + 13 + 4 + 4 + 2 + 1, dated
    assert dated > MAX_DATED_SHARE * total  # such a page fails
    assert dated_words(teaching) == (0, 80)
