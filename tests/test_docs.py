"""The docs stay reference: the README a short front page with the two commands verbatim and
no measured figures of its own, each docs page short, the history in one dated notebook, and
every relative link (and the heading a link names) resolving."""
import ast
import io
import re
import tokenize
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
DOCS = sorted((REPO / "docs").glob("*.md"))
NOTEBOOK = REPO / "notebook.md"
BENCHMARKS = REPO / "benchmarks" / "README.md"
LINKED = [REPO / "README.md", *DOCS, BENCHMARKS, REPO / "benchmarks" / "calibration.md", NOTEBOOK]

LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_short_with_the_two_commands():
    assert len(README.splitlines()) <= 150
    assert "bash scripts/setup.sh && .venv/bin/rpa-tune sweep --tpu v6e --case decode\n" in README
    assert "\nbash scripts/test.sh\n" in README
    assert "](benchmarks/README.md)" in README


def test_readme_repeats_no_measured_figures():
    """Times and speed-ups live in benchmarks/README.md; the README links to them."""
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    figures = re.findall(r"\d+(?:\.\d+)?\s?(?:µs|us|ms|s|%|x)\b", prose)
    assert not figures, figures


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_pages_are_short(doc):
    assert len(doc.read_text().splitlines()) <= 400, doc.name


def test_notebook_holds_dated_sections_newest_first():
    """History goes to one notebook, its sections headed by an ISO date, newest first."""
    text = NOTEBOOK.read_text()
    dates = re.findall(r"^## (\d{4}-\d{2}-\d{2})\b", text, flags=re.M)
    assert dates, "notebook.md has no dated section"
    assert dates == sorted(dates, reverse=True), dates


def slug(heading):
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path):
    found, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"#{1,6} (.+)", line)):
            base = slug(m.group(1))
            n = 0
            while (name := base if n == 0 else f"{base}-{n}") in found:
                n += 1
            found.add(name)
    return found


def test_slug_follows_github():
    assert slug("## `rpa-tune export`, `--check`, `diff`"[3:]) == "rpa-tune-export---check-diff"
    assert slug("Composition for tpu-inference's RPA v3") == "composition-for-tpu-inferences-rpa-v3"
    assert slug("New K/V placement on v5p") == "new-kv-placement-on-v5p"
    assert slug("Padded head_dim") == "padded-head_dim"


@pytest.mark.parametrize("doc", LINKED, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    """Every relative link names an existing file, and a `#anchor` an existing heading."""
    for target in LINK.findall(doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, frag = target.partition("#")
        dest = (doc.parent / path) if path else doc
        assert dest.exists(), f"{doc.name}: broken link {target}"
        if frag and dest.suffix == ".md":
            assert frag in anchors(dest), f"{doc.name}: no heading for {target}"


def test_headings_code_and_tests_name_exist():
    """Code, scripts and tests cite doc sections by title (e.g. benchmarks/README.md, "Small q
    blocks"): each cited title must still begin a heading of that page."""
    cites = re.compile(r"((?:docs|benchmarks)/[A-Za-z_]+\.md)[`']*,?\s*\(?\"([A-Z][^\"]+)\"")
    pages = {}
    for src in [*REPO.glob("rpa_tune/**/*.py"), *REPO.glob("kernel/**/*.py"),
                *REPO.glob("benchmarks/*.py"), *REPO.glob("tests/*.py"), *REPO.glob("tables/*.sh")]:
        if src.name == "test_docs.py":
            continue
        text = re.sub(r"\s*\n\s*#?\s*", " ", src.read_text())
        for page, title in cites.findall(text):
            if (REPO / page).exists():
                pages.setdefault(page, set()).add(title.strip())
    assert pages, "no citation found: the pattern is stale"
    for page, titles in pages.items():
        headings = [m.group(1) for m in re.finditer(r"^#{1,6} (.+)$", (REPO / page).read_text(), re.M)]
        for title in titles:
            assert any(h.replace("`", "").startswith(title) for h in headings), f"{page}: no heading {title!r}"


ISO_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
CODE_DIRS = ("kernel", "rpa_tune", "benchmarks")


def prose(source):
    """``(line, text)`` of every comment and every string statement (docstrings, and bare
    strings standing as comments) of Python ``source``. String constants bound to a name are
    data (e.g. ``rpa_tune.estimator.rejudge.NOTE``, recorded into re-judged rows with its
    date) and are not prose."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value


def test_prose_finds_comments_and_docstrings_not_data():
    src = ('"""Module, 2026-01-02."""\n'
           'X = "recorded 2026-01-03"  # set on 2026-01-04\n'
           'def f():\n'
           '    """Since 2026-01-05."""\n'
           '    "a bare string 2026-01-06"\n'
           '    return "2026-01-07"\n')
    found = sorted(d for _, text in prose(src) for d in ISO_DATE.findall(text))
    assert found == ["2026-01-02", "2026-01-04", "2026-01-05", "2026-01-06"]


def test_no_dated_history_in_docstrings_or_comments():
    """Docstrings and comments say what is true now; dated history and the figures of past
    runs live in notebook.md (and the git log), benchmarks' figures in benchmarks/."""
    files = sorted(f for d in CODE_DIRS for f in (REPO / d).rglob("*.py"))
    assert len(files) > 50, "the source tree was not found"
    dated = [f"{f.relative_to(REPO)}:{line}: {m}"
             for f in files for line, text in prose(f.read_text()) for m in ISO_DATE.findall(text)]
    assert not dated, "dated history belongs in notebook.md:\n" + "\n".join(dated)
