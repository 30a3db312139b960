"""A wheel built from the checkout ships the tables and search spaces: installed in a fresh
venv outside the checkout, the kernel resolves a shipped entry and the tuner loads a
shipped search space (both read with importlib.resources, nothing from the checkout)."""
import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from kernel.tables import Table

REPO = Path(__file__).resolve().parent.parent


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, (cmd, r.stdout[-3000:], r.stderr[-3000:])
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of a fresh venv with only the wheel installed, a directory outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"     # a copy: building in place would leave build/ and *.egg-info in the checkout
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "results"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"), str(src)],
         timeout=600)
    wheel, = (tmp / "dist").glob("rpa_tune-*.whl")
    _run([sys.executable, "-m", "venv", str(tmp / "venv")], timeout=300)
    py = tmp / "venv" / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    # the dependencies (jax, numpy, pyarrow, ...) from this venv's site-packages, appended
    # after the fresh venv's own: a path line in a .pth file does not run the editable
    # install's finder, so `kernel` / `rpa_tune` can only come from the wheel
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], timeout=300)
    work = tmp / "elsewhere"
    work.mkdir()
    return py, work


def test_wheel_ships_tables_and_search_spaces(installed):
    py, work = installed
    shipped = Table.read(REPO / "tables" / "v6e.json")
    entry = next(e for e in shipped.entries if e.promoted)
    k = entry.key
    dims = dict(q_dtype=k.q_dtype, kv_dtype=k.kv_dtype, num_q_heads=k.num_q_heads, num_kv_heads=k.num_kv_heads,
                head_dim=k.head_dim, page_size=k.page_size, max_num_tokens=k.max_num_tokens,
                pages_per_seq=k.max_model_len // k.page_size)
    script = textwrap.dedent(f"""
        import json, os
        for v in ("RPA_TABLE", "RPA_SHIPPED_TABLES", "RPA_TABLE_STRICT"):
            os.environ.pop(v, None)
        import kernel, rpa_tune
        from kernel import tables
        from rpa_tune.space import load_space
        found = tables.lookup_entry({k.case!r}, generation={k.generation!r}, dims={dims!r},
                                    sliding_window={k.sliding_window!r})
        space = load_space("v6e")
        print(json.dumps(dict(kernel=kernel.__file__, rpa_tune=rpa_tune.__file__,
                              shipped=str(tables.shipped_table_dir()),
                              files=[f for f, _ in tables.loaded().files],
                              block_sizes=list(found[0]) if found else None, source=found and found[1],
                              space=space.source, cases=sorted(c.value for c in space.cases))))
    """)
    r = _run([str(py), "-I", "-c", script], cwd=work, timeout=300)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for f in ("kernel", "rpa_tune", "shipped", "space"):
        assert not Path(got[f]).resolve().is_relative_to(REPO), (f, got[f])
    assert Path(got["shipped"]).name == "_tables"
    assert sorted(Path(f).name for f in got["files"]) == sorted(p.name for p in (REPO / "tables").glob("*.json"))
    assert got["block_sizes"] == list(entry.block_sizes), got
    assert "v6e.json" in got["source"]
    assert Path(got["space"]).name == "v6e.toml" and got["cases"] == ["decode", "mixed", "prefill"]
