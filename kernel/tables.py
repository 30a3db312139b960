"""Tuned block-size tables (filled by ``rpa-tune export``).

Only the lookup hook lives here for now: no table is shipped yet, so every lookup
misses and the heuristic applies.
"""
from __future__ import annotations


def lookup_block_sizes(case, *, generation: str, dims: dict):
    """Return ``(BlockSizes, source)`` from a table, or None when no entry matches."""
    return None
