"""Reading the table files a process uses: ``$RPA_TABLE``, then the shipped tables; a bad
file or entry is skipped with one warning, never raised."""
from __future__ import annotations

import dataclasses
import importlib.resources
import logging
import os
from pathlib import Path
from typing import Iterable

from ..provenance import canonical_kernel_id, kernel_id, libtpu_version
from .env import ENV_PUBLIC_TABLE, ENV_SHIPPED, ENV_STRICT, ENV_TABLE, env_flag
from .index import TableIndex
from .schema import DEFAULT_KERNEL, PUBLIC_KERNEL, Table, TableError

log = logging.getLogger("kernel.tables")

@dataclasses.dataclass
class LoadedTables:
    index: TableIndex
    files: list[tuple[str, str]]        # (path, "ok: N entries" | problem)
    warnings: list[str]


def shipped_table_dir() -> Path | None:
    """The shipped tables: package data ``kernel/_tables`` of an installed wheel (read with
    ``importlib.resources``), else ``tables/`` at the root of the source checkout holding
    the ``kernel`` package (what people edit; the wheel is built from it, see
    pyproject.toml)."""
    data = importlib.resources.files("kernel").joinpath("_tables")
    if data.is_dir():
        return Path(str(data))
    repo = Path(__file__).resolve().parents[2]
    if (repo / "tables").is_dir() and (repo / "pyproject.toml").is_file():
        return repo / "tables"
    return None


def _table_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix == ".json" and p.is_file())
    return [path]   # Table.read refuses anything but a regular file


def _strict() -> bool:
    return env_flag(ENV_STRICT)


def kernel_version(kernel: str) -> str | None:
    """What an entry's ``provenance.kernel_hash`` is checked against: our kernel's version
    id (``kernel.provenance.kernel_id``), or ``tpu-inference==<installed version>`` (None when it is not installed: the
    check is skipped)."""
    if kernel == DEFAULT_KERNEL:
        return kernel_id()
    from importlib import metadata
    try:
        return f"{PUBLIC_KERNEL}=={metadata.version(PUBLIC_KERNEL)}"
    except metadata.PackageNotFoundError:
        return None


def tuned_for_another_kernel(entry, cur_hash: str | None) -> bool:
    """Whether ``entry`` was tuned for another kernel version than ``cur_hash``
    (``kernel_version``; None: not checked; an entry without a hash is not)."""
    return cur_hash is not None and entry_kernel_id(entry) not in (None, cur_hash)


def entry_kernel_id(entry):
    """The kernel version id an entry was tuned for (a legacy source hash read as its
    version's id: ``kernel.provenance.canonical_kernel_id``)."""
    return canonical_kernel_id(entry.provenance.get("kernel_hash"))


def _compat_filter(table: Table, path: str, strict: bool, warn, cur_hash: str | None) -> Table:
    """``table`` with a warning (or, strict, without the entries) for entries tuned for
    another kernel version than ``cur_hash`` (``kernel_version``; None: not checked) or
    another libtpu."""
    cur_libtpu = libtpu_version()
    bad_hash = sorted({entry_kernel_id(e) for e in table.entries if tuned_for_another_kernel(e, cur_hash)})
    bad_lib = sorted({e.provenance.get("libtpu_version") for e in table.entries
                      if cur_libtpu is not None
                      and e.provenance.get("libtpu_version") not in (None, cur_libtpu)})
    if not bad_hash and not bad_lib:
        return table
    problems = []
    if bad_hash:
        what = "kernel version" if table.kernel == DEFAULT_KERNEL else "kernel"
        problems.append(f"tuned for {what} {', '.join(bad_hash)} (current {cur_hash})")
    if bad_lib:
        problems.append(f"tuned with libtpu {', '.join(bad_lib)} (installed {cur_libtpu})")
    n_bad = sum(1 for e in table.entries
                if entry_kernel_id(e) in bad_hash or e.provenance.get("libtpu_version") in bad_lib)
    if strict:
        warn(f"rpa table {path}: {n_bad} of {len(table)} entries {' and '.join(problems)}; "
             f"refusing them ({ENV_STRICT}=1)")
        keep = tuple(e for e in table.entries if entry_kernel_id(e) not in bad_hash
                     and e.provenance.get("libtpu_version") not in bad_lib)
        return Table(keep, table.info, table.schema_version)
    warn(f"rpa table {path}: {n_bad} of {len(table)} entries {' and '.join(problems)}; using them "
         f"anyway (set {ENV_STRICT}=1 to refuse)")
    return table


def load_tables(paths: Iterable | None = None, *, shipped: bool | None = None,
                strict: bool | None = None, kernel: str = DEFAULT_KERNEL) -> LoadedTables:
    """Read the tables of ``kernel`` (never raises for a bad file: one warning per file,
    then skipped; so is a table of another kernel).

    Defaults come from the environment: ``paths`` from ``$RPA_TABLE`` (``none`` disables
    every table; for tpu-inference ``$RPA_TPU_INFERENCE_TABLE``), ``shipped`` from
    ``$RPA_SHIPPED_TABLES`` (default on; tpu-inference's shipped tables are in the
    ``tpu-inference/`` directory of ours), ``strict`` from ``$RPA_TABLE_STRICT``.
    """
    warnings_: list[str] = []

    def warn(msg):
        warnings_.append(msg)
        log.warning(msg)

    if paths is None:
        raw = os.environ.get(ENV_TABLE if kernel == DEFAULT_KERNEL else ENV_PUBLIC_TABLE, "")
        if raw.strip().lower() == "none":
            return LoadedTables(TableIndex(), [], [])
        paths = [p for p in raw.split(os.pathsep) if p.strip()]
    if shipped is None:
        shipped = os.environ.get(ENV_SHIPPED, "1").strip().lower() not in ("0", "false", "no", "off")
    if strict is None:
        strict = _strict()
    index = TableIndex()
    files = []
    current = kernel_version(kernel)
    sources = [(Path(p).expanduser(), True) for p in paths]
    if shipped:
        d = shipped_table_dir()
        if d is not None and kernel != DEFAULT_KERNEL:
            d = d / kernel if (d / kernel).is_dir() else None
        if d is not None:
            sources.append((d, False))
        else:
            log.info("no shipped rpa tables found (looked for tables/ next to the kernel package)")
    for src, user in sources:
        if not src.exists():
            msg = f"rpa table {src}: does not exist; falling back to the heuristic for its keys"
            (warn if user else log.info)(msg)
            files.append((str(src), "missing"))
            continue
        for f in _table_files(src):
            rejected = []
            try:
                table = Table.read(f, on_bad_entry=rejected.append)
            except TableError as e:
                warn(f"rpa table {f}: {e}; ignoring this file (the heuristic applies)")
                files.append((str(f), f"ignored: {e}"))
                continue
            except Exception as e:  # noqa: BLE001 - serving must not break on a table
                warn(f"rpa table {f}: unexpected error {type(e).__name__}: {e}; ignoring this file")
                files.append((str(f), f"ignored: {e}"))
                continue
            if table.kernel != kernel:
                warn(f"rpa table {f}: a table of kernel {table.kernel}, not {kernel}; ignoring this file")
                files.append((str(f), f"ignored: kernel {table.kernel}"))
                continue
            for msg in rejected:
                warn(f"rpa table {f}: {msg}; ignoring this entry (the heuristic applies for its key)")
            other = sum(1 for e in table.entries if tuned_for_another_kernel(e, current))
            table = _compat_filter(table, str(f), strict, warn, current)
            n = index.add(table, str(f))
            files.append((str(f), f"ok: {n} entries" + (f", {len(rejected)} rejected" if rejected else "")
                          + (f", {other} tuned for another kernel version" if other else "")))
    return LoadedTables(index, files, warnings_)
