"""A throwaway PostgreSQL server for tests: ``initdb`` into a temporary directory, start
``postgres`` on a free local port (its unix socket in the same directory), create a
database, yield its URL, then stop the server and remove everything.

PostgreSQL refuses to run as root; as root the server runs as ``nobody`` (``runuser``),
its data directory owned by that user. ``find_pg_bin()`` is None when no PostgreSQL
binaries are installed (scripts/setup.sh installs Debian's ``postgresql``): tests then
skip with that reason.
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PG_USER = "rpa"


def find_pg_bin() -> Path | None:
    """The directory holding initdb / postgres, or None."""
    found = shutil.which("initdb")
    cands = ([str(Path(found).resolve().parent)] if found else []) + \
        sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for d in cands:
        if (Path(d) / "initdb").exists() and (Path(d) / "postgres").exists():
            return Path(d)
    return None


def create_database(url: str, name: str) -> str:
    """A new database ``name`` on the server of ``url``; its URL."""
    import sqlalchemy
    engine = sqlalchemy.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as c:
            c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    finally:
        engine.dispose()
    return url.rsplit("/", 1)[0] + "/" + name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_user(cmd: list[str], user: str | None) -> list[str]:
    return ["runuser", "-u", user, "--", *cmd] if user else cmd


@contextlib.contextmanager
def postgres_server(dbname: str = "rpa_tune"):
    """Yield ``postgresql+psycopg2://rpa@127.0.0.1:PORT/dbname`` of a fresh server."""
    bindir = find_pg_bin()
    if bindir is None:
        raise RuntimeError("no PostgreSQL binaries (initdb) found; scripts/setup.sh installs postgresql")
    user = "nobody" if os.geteuid() == 0 else None
    tmp = Path(tempfile.mkdtemp(prefix="rpa_tune_pg_"))
    data = tmp / "data"
    try:
        if user:
            os.chmod(tmp, 0o755)
            shutil.chown(tmp, user)
        subprocess.run(_as_user([str(bindir / "initdb"), "-D", str(data), "-U", PG_USER, "-A", "trust",
                                 "--no-sync", "-E", "UTF8"], user),
                       check=True, capture_output=True, text=True, cwd=tmp)
        port = _free_port()
        log = open(tmp / "server.log", "wb")
        proc = subprocess.Popen(
            _as_user([str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-h", "127.0.0.1",
                      "-k", str(tmp), "-c", "fsync=off", "-c", "synchronous_commit=off",
                      "-c", "full_page_writes=off", "-c", "max_connections=200"], user),
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while True:
                r = subprocess.run([str(bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)],
                                   capture_output=True)
                if r.returncode == 0:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("postgres did not start: " + (tmp / "server.log").read_text()[-2000:])
                time.sleep(0.1)
            subprocess.run([str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", PG_USER, dbname],
                           check=True, capture_output=True, text=True)
            yield f"postgresql+psycopg2://{PG_USER}@127.0.0.1:{port}/{dbname}"
        finally:
            _stop(proc)
            log.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _stop(proc) -> None:
    """Fast shutdown (SIGINT to the server's process group), then SIGKILL."""
    import signal
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


if __name__ == "__main__":   # manual check: start, print the URL, stop
    with postgres_server() as url:
        print(url)
