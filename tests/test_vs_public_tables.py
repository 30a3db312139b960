"""benchmarks/vs_public.py: a partial run (``--tpu`` / ``--only``) merged into the table it
replaces keeps every row it did not run."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

HEADER = ["| gen | workload | ours | public | ratio |", "|---|---|---:|---:|---:|"]


def _table(rows, notes):
    return "\n".join(HEADER + rows + [""] + notes) + "\n"


def test_a_partial_run_keeps_the_rows_it_did_not_run():
    import vs_public as vp
    old_rows = ["| v6e | decode 128 x 512, page 128 | 1 | 2 | 0.50 |",
                "| v6e | causal prefill 1 x 1024 | 3 | 4 | 0.75 |",
                "| v5e | decode 128 x 512, page 128 | 5 | 5 | 1.00 |",
                "| tpu7x | decode 128 x 512, page 128 | 6 | 8 | 0.75 |"]
    old_notes = ["- v6e decode 128 x 512, page 128, public (1, 512, 1, 512): read audit complete",
                 "- v5e decode 128 x 512, page 128, public (1, 512, 1, 512): crash: x",
                 "- tpu7x decode 128 x 512, page 128, ours (1, 512, 1, 512): vmem_oom: y"]
    old = _table(old_rows, old_notes)
    # --tpu v6e --only decode, with a workload the table did not have
    new_rows = ["| v6e | short decode 128 x 128, page 128 | 7 | 9 | 0.78 |",
                "| v6e | decode 128 x 512, page 128 | 1 | 3 | 0.33 |"]
    new_notes = ["- v6e short decode 128 x 128, page 128, ours (1, 128, 1, 128): crash: z"]
    rows, notes = vp.merge_tables(old, new_rows, new_notes)
    assert rows == ["| v6e | decode 128 x 512, page 128 | 1 | 3 | 0.33 |",       # replaced in place
                    "| v6e | causal prefill 1 x 1024 | 3 | 4 | 0.75 |",         # not run: kept
                    "| v6e | short decode 128 x 128, page 128 | 7 | 9 | 0.78 |",  # new: after its generation
                    old_rows[2], old_rows[3]]                                    # other generations kept
    # the v6e decode note is gone (that row was rerun and reported none), the others kept, in row order
    assert notes == [new_notes[0], old_notes[1], old_notes[2]]
    # a full rerun reproduces the old table
    assert vp.merge_tables(old, old_rows, old_notes) == (old_rows, old_notes)
    # --tpu v6e over every case: a v6e row the run no longer produces is gone, with its
    # notes; the other generations' rows stay
    rows, notes = vp.merge_tables(old, new_rows, new_notes, rerun_gens=("v6e",))
    assert rows == ["| v6e | decode 128 x 512, page 128 | 1 | 3 | 0.33 |",
                    "| v6e | short decode 128 x 128, page 128 | 7 | 9 | 0.78 |",
                    old_rows[2], old_rows[3]]
    assert notes == [new_notes[0], old_notes[1], old_notes[2]]
