"""A real MLflow tracking server for the tests (`mlflow server`, from the test extra): a SQLite
backend and a local artifact store in a temporary directory, on 127.0.0.1 (or the address given:
a namespace cluster's bridge, which its hosts reach) at a free port, one worker. It can be killed
and started again on the same port and database, as a server that went away mid-run and came back.

    with MLflowServer(tmp) as server:
        server.uri         # http://127.0.0.1:PORT
        server.kill(); server.start()
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from postgres_server import free_port


class MLflowServer:
    """Start with `with` (or `start`); `uri` is its tracking URI."""

    def __init__(self, root: Path, host: str = "127.0.0.1"):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.host, self.port = host, free_port()
        self.uri = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen | None = None

    def client(self):
        """MLflow's own client of this server (mlflow.tracking.MlflowClient)."""
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def start(self) -> MLflowServer:
        log = open(self.root / "server.log", "ab")
        # start_new_session: `kill` ends the server and the workers it forks, as a lost host would.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", self.host, "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts"),
             # Its Host-header check admits loopback and private addresses; the test network is neither.
             "--allowed-hosts", f"{self.host},{self.host}:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            # No background job runner (a second process importing MLflow): the tests log runs only.
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        log.close()
        deadline = time.monotonic() + 180  # the first start makes the database's tables
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("mlflow server did not start:\n" + (self.root / "server.log").read_text()[-3000:])
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the server and its workers: gone mid-request, as a lost machine is."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    def __enter__(self) -> MLflowServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
