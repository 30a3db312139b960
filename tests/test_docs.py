"""The README stays a front page: short, the two commands verbatim, measured claims only
by link to benchmarks/README.md, and every relative link resolves."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
DOCS = sorted((REPO / "docs").glob("*.md"))


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


@pytest.mark.parametrize("doc", [REPO / "README.md", *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if "://" in target:
            continue
        assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"
