"""``rpa-tune`` console entry point (also ``python -m rpa_tune``).

A serving install has the kernel only; the tuner's dependencies come with the ``tune``
extra. Without them the command says so in one line (exit 2) instead of a traceback.
"""
from __future__ import annotations

import sys

TUNE_DEPENDENCIES = ("typer", "rich", "optuna", "pandas", "pyarrow")


def main():
    import importlib.util
    missing = [m for m in TUNE_DEPENDENCIES if importlib.util.find_spec(m) is None]
    if missing:
        sys.stderr.write(f"rpa-tune: error: the tuner needs {', '.join(missing)} (not installed); "
                         "install the 'tune' extra: pip install 'rpa-tune[tune]'\n")
        return 2
    from .cli import app
    return app()


if __name__ == "__main__":
    sys.exit(main())
