"""Write resolved_block_sizes.json: every shipped table entry's key id -> the block sizes
the kernel resolves from the tables for it (None: not promoted, the heuristic applies), as
the tables of a given git revision hold them. Run from the repository root:

    .venv/bin/python tests/snapshots/make_resolved.py <revision>

(the revision whose tables were last re-ranked on purpose; tests/test_tables_shipped.py
checks that the tables of today resolve the same block sizes.)"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def resolved(table_dir: Path) -> dict:
    from kernel import tables as kt
    out = {}
    for p in sorted(table_dir.glob("*.json")):
        for e in kt.Table.read(p).entries:
            out[e.key.id()] = list(e.block_sizes) if e.promoted else None
    return dict(sorted(out.items()))


def main(rev: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        names = subprocess.run(["git", "ls-tree", "--name-only", rev, "tables/"], capture_output=True,
                               text=True, check=True).stdout.split()
        for n in names:
            if n.endswith(".json"):
                blob = subprocess.run(["git", "show", f"{rev}:{n}"], capture_output=True, check=True).stdout
                (Path(d) / Path(n).name).write_bytes(blob)
        doc = {"revision": rev, "entries": resolved(Path(d))}
    (HERE / "resolved_block_sizes.json").write_text("{\"revision\": %s, \"entries\": {\n" % json.dumps(rev) + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in doc["entries"].items()) + "\n}}\n")


if __name__ == "__main__":
    main(sys.argv[1])
