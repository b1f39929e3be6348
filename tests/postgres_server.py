"""A real PostgreSQL server for the tests, from Debian's packages (scripts/test installs them): a
cluster of its own in a temporary directory (initdb), listening on 127.0.0.1 at a free port and
on a socket in that directory, every local connection trusted, one database. PostgreSQL refuses
to run as root: as root, the cluster belongs to Debian's `postgres` user and its commands run as it
(so its directory is made directly in /tmp: pytest's are private to root), removed at the end.

    with PostgresServer() as pg:
        pg.url  # postgresql+psycopg://speedrun@127.0.0.1:PORT/speedrun
"""
from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


def postgres_bin() -> Path:
    """The newest installed PostgreSQL's programs (Debian keeps them per version)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[4]))
    if not found:
        raise AssertionError("PostgreSQL is not installed (scripts/test installs Debian's postgresql)")
    return Path(found[-1]).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """Start with `with`; `url` reaches its database `speedrun` as user `speedrun`."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="speedrun-pg-"))
        self.bin = postgres_bin()
        self.port = free_port()
        self.url = f"postgresql+psycopg://speedrun@127.0.0.1:{self.port}/speedrun"

    def _run(self, *argv: str) -> None:
        as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        r = subprocess.run([*as_user, *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (argv, r.stdout, r.stderr)

    def __enter__(self) -> PostgresServer:
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        data = self.dir / "data"
        self._run(str(self.bin / "initdb"), "-D", str(data), "-U", "speedrun", "--auth=trust", "-E", "UTF8")
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1"
        self._run(str(self.bin / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(self.dir / "log"), "-w", "start")
        self._run(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "speedrun", "speedrun")
        return self

    def stop(self) -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.dir / "data"), "-m", "fast", "-w", "stop")

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
