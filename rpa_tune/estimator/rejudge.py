"""Recorded estimates judged again by today's time model, from their own cycles.

A compile-backend row keeps the cycles its probes composed; its time, bounds and audit
verdict follow from them by ``audit.time_model``. When that rule grows stricter, rows
recorded before need no new compile: ``rejudge`` applies the rule to their cycles,
workload and block sizes, as a new evaluation would.

The memory bound of our kernel's configs counts the cached K/V their own walk fetches
(``audit.walk_bytes``: a q block fetches its context again, so a small ``bq`` reads the
cache several times), not the context read once, and counts a head_dim under 128 padded to
128 lanes, as the cache holds it (``audit.time_model``). A row whose estimate beats that
bound by more than ``audit.RATE_TOLERANCE`` is refused (audit ``incomplete``, no metric: it
cannot win); one within it keeps the bound as its time. Its message says so (``NOTE``).

    python -m rpa_tune.estimator.rejudge tables/results            # what would change
    python -m rpa_tune.estimator.rejudge tables/results --write    # rewrite the changed rows

``--write`` replaces only the parts that hold a changed row, by new compacted parts
(``rpa_tune.store.write_parts``); every other part stays byte for byte.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

# recorded into the message of every re-judged row: data, so its date stays (tests/test_docs.py)
NOTE = "re-judged 2026-11-28: memory bound of the cached K/V this config's walk fetches"


def _window(row) -> int | None:
    if not row.sliding_window:
        return None
    m = re.search(r"sliding window (\d+)", str(row.workload or ""))
    return int(m.group(1)) if m else -1


def rejudge(df):
    """``(frame, changed)``: ``df`` with the rows of our kernel's compile estimates judged
    by today's ``audit.time_model`` (every such row gets today's ``memory_bound_s``), and
    the boolean mask of the rows whose time or verdict changed (their message says so)."""
    import numpy as np

    from kernel.config import BlockSizes
    from kernel.workload import ModelShape, Workload

    from . import audit
    from ..kernels import get_kernel, row_kernel
    df = df.copy()
    changed = np.zeros(len(df), dtype=bool)
    cols = {c: df.columns.get_loc(c) for c in ("metric", "memory_bound_s", "active_bound", "audit", "message")}
    memo = {}
    for i, r in enumerate(df.itertuples(index=False)):
        if not (r.backend == "compile" and get_kernel(row_kernel(r.kernel)).rejudgeable and r.status == "ok" and r.method == "estimate"
                and r.cycles == r.cycles and r.cycles is not None):
            continue
        sw = _window(r)
        if sw == -1:          # a window the row does not name: left as recorded
            continue
        bs = BlockSizes(int(r.bq), int(r.bkv), int(r.cq), int(r.ckv))
        model = ModelShape(int(r.num_q_heads), int(r.num_kv_heads), int(r.head_dim), r.q_dtype, r.kv_dtype)
        k = (r.workload_id, r.case, tuple(bs), int(r.page_size), model, sw, r.generation, float(r.cycles))
        if k not in memo:
            wj = json.loads(r.workload_json)
            w = Workload(wj["q_lens"], wj["kv_lens"], wj["distribution"])
            walk = audit.walk_bytes(w, model, r.case, bs, int(r.page_size), sliding_window=sw)
            memo[k] = audit.time_model(float(r.cycles), w, model, r.generation, r.case, sliding_window=sw, walk=walk)
        t = memo[k]
        if t["memory_bound_s"] <= (r.memory_bound_s or 0.0) * (1 + 1e-9):
            continue
        df.iat[i, cols["memory_bound_s"]] = t["memory_bound_s"]
        if t["rate_ok"] and t["active_bound"] != "memory":
            continue          # a larger bound that the estimate still clears: time and verdict stand
        changed[i] = True
        msg = str(r.message or "")
        if t["rate_ok"]:
            df.iat[i, cols["active_bound"]] = t["active_bound"]
            if r.metric == r.metric and r.metric is not None:
                df.iat[i, cols["metric"]] = t["time_s"]
            df.iat[i, cols["message"]] = f"{msg}; {NOTE}" if msg else NOTE
        else:
            df.iat[i, cols["audit"]] = audit.INCOMPLETE
            df.iat[i, cols["metric"]] = None
            df.iat[i, cols["message"]] = f"{msg}; {NOTE}; audit incomplete: {t['rate_note']}"
    return df, changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", help="a results directory (rpa_tune.store)")
    ap.add_argument("--write", action="store_true",
                    help="replace the parts holding a changed row by new compacted parts, the changed "
                         "rows judged again (default: report only)")
    a = ap.parse_args(argv)
    import numpy as np
    import pandas as pd
    import pyarrow as pa
    from pathlib import Path
    from ..store import SCHEMA, _read_files, result_files, write_parts
    d = Path(a.results)
    if not d.is_dir():
        print(f"rejudge: results directory {a.results!r} does not exist", file=sys.stderr)
        return 2
    parts, frames, masks = [], [], []
    for f in result_files([d]):           # each part as recorded, to know which ones change
        t, damaged = _read_files([f])
        if damaged:
            print(f"rejudge: damaged files in {a.results} ({damaged[0][0]}); nothing rewritten", file=sys.stderr)
            return 2
        new, changed = rejudge(t.to_pandas())
        parts.append(f)
        frames.append(new)
        masks.append(changed)
    new = pd.concat(frames, ignore_index=True) if frames else SCHEMA.empty_table().to_pandas()
    changed = np.concatenate(masks) if masks else np.zeros(0, dtype=bool)
    refused = int((changed & (new["audit"] == "incomplete").to_numpy()).sum())
    print(f"{int(changed.sum())} of {len(new)} rows judged again ({refused} refused, "
          f"{int(changed.sum()) - refused} at the walk's memory bound)")
    for r in new[changed].itertuples(index=False):
        print(f"  {r.key_id} {(r.bq, r.bkv, r.cq, r.ckv)}: {r.audit}")
    touched = [i for i, m in enumerate(masks) if m.any()]
    if a.write and touched:
        rows = pd.concat([frames[i] for i in touched], ignore_index=True)
        out = write_parts(d, pa.Table.from_pandas(rows, schema=SCHEMA, preserve_index=False),
                          [parts[i] for i in touched])
        print(f"replaced {len(touched)} parts by {', '.join(p.name for p in out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
