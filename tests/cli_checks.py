"""The CLI's bad-input contract, asserted in one place: exit status 2, exactly one non-blank
line on stderr that starts ``rpa-tune: error: `` and names every needle, and no traceback."""
from __future__ import annotations


def assert_one_error_line(r, needles=()) -> str:
    """``r``: a finished ``subprocess.run`` of the CLI; returns the error line."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("rpa-tune: error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert "Traceback" not in r.stdout + r.stderr
    return lines[0]
