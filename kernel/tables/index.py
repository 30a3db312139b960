"""The bucketing index: exact keys, then the nearest bucket at or above within a family."""
from __future__ import annotations

import dataclasses

from ..config import TuningKey
from .schema import Entry, Table

def _family(key: TuningKey) -> tuple:
    """Everything the bucketing rule never crosses."""
    return (key.generation, key.case, key.q_dtype, key.kv_dtype, key.num_q_heads,
            key.num_kv_heads, key.head_dim, key.page_size, key.sliding_window)


@dataclasses.dataclass
class Match:
    entry: Entry
    source: str          # file the entry came from
    exact: bool


class TableIndex:
    """Entries from several tables, earlier tables winning on identical keys.

    ``find(key)``: the exact key; else, within the key's family (same generation, case,
    dtypes, head counts, head_dim, page_size and sliding-window flag), the entry with the
    smallest tabled ``max_num_tokens >= key.max_num_tokens`` and, among those, the smallest
    tabled ``max_model_len >= key.max_model_len`` (a token bucket whose model lengths are all
    too small moves on to the next token bucket). Nothing is ever rounded down.
    """

    def __init__(self):
        self._exact: dict[TuningKey, tuple[Entry, str]] = {}
        self._families: dict[tuple, list[tuple[int, int, TuningKey]]] = {}

    def add(self, table: Table, source: str) -> int:
        added = 0
        for e in table.entries:
            if e.key in self._exact:
                continue
            self._exact[e.key] = (e, source)
            self._families.setdefault(_family(e.key), []).append(
                (e.key.max_num_tokens, e.key.max_model_len, e.key))
            added += 1
        for lst in self._families.values():
            lst.sort()
        return added

    def __len__(self) -> int:
        return len(self._exact)

    def find(self, key: TuningKey) -> Match | None:
        hit = self._exact.get(key)
        if hit is not None:
            return Match(hit[0], hit[1], True)
        for t, l, k in self._families.get(_family(key), ()):
            if t >= key.max_num_tokens and l >= key.max_model_len:
                e, src = self._exact[k]
                return Match(e, src, False)
        return None
