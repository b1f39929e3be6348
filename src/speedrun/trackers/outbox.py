"""What a run sends to an experiment tracker goes through its run directory first.

Each tracker of a run (`--track mlflow`, ...) has two files in `RUN/trackers/`:

    NAME.jsonl   every record for it, in order, one JSON line each (its `seq` counts from 1)
    NAME.json    where it goes (the tracker's own run id, `where`: its URI or project) and how
                 many records it took (`sent`)

The training thread only appends a line; a thread of the Outbox sends what the tracker has not
taken yet, in order, in batches, and moves `sent` on after each batch the tracker accepted. A
tracker that stops answering never holds the run up: the lines wait, and are sent when it
answers again, at the run's next start (a resume) or by `speedrun track sync RUN`. A batch that
failed after the tracker stored it is sent again: MLflow keeps one copy of a metric point logged
twice (the same key, step, time and value), and a parameter logged again with its value is no
change.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from speedrun import files
from speedrun.errors import one_line

RETRY_S = (1, 2, 5, 10, 30)  # waits between tries after a failure; the last one repeats
FLUSH_S = 10.0  # how long a closing run waits for its records to reach the tracker
GATHER_S = 1.0  # while a run goes on, records are sent at most this often (one call for many)
BATCH = 500  # records per call at most


class Backend(Protocol):
    """One tracker's run (MLflow, W&B): made or found again by `open`, then takes records in order
    (`send` raises when the tracker cannot take them); `close` ends what `send` left open."""

    name: str
    run_id: str | None

    def open(self, run_name: str, group: str | None) -> None: ...

    def send(self, records: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...

    def describe(self) -> str: ...


class Outbox:
    """Records for one tracker: kept in the run directory, sent by a thread of their own."""

    def __init__(self, run_dir: Path, name: str):
        self.dir = Path(run_dir) / "trackers"
        self.name = name
        self.log = self.dir / f"{name}.jsonl"
        self.state_file = self.dir / f"{name}.json"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state: dict[str, Any] = read_state(self.state_file)
        kept = files.read_jsonl(self.log) if self.log.exists() else []
        self._seq = kept[-1]["seq"] if kept else 0
        self._queue = [r for r in kept if r["seq"] > self.sent]  # what earlier starts left unsent, then this one's
        self._lock = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None

    @property
    def sent(self) -> int:
        """How many records (by seq) the tracker has taken."""
        return int(self.state.get("sent", 0))

    def save_state(self, **fields: Any) -> None:
        """Record `fields` (the tracker's run id, its URI, `sent`) beside the records."""
        self.state.update(fields)
        files.write_text(self.state_file, files.to_json(self.state, indent=1) + "\n")

    def put(self, record: dict[str, Any]) -> None:
        """Keep `record` (a dict with "kind") for the tracker; the sender takes it from here."""
        with self._lock:
            self._seq += 1
            record = {"seq": self._seq, **record}
            with open(self.log, "a") as f:
                f.write(files.to_json(record) + "\n")
            self._queue.append(record)
            self._lock.notify()

    def pending(self) -> int:
        """How many records the tracker has not taken yet."""
        with self._lock:
            return len(self._queue)

    def send_pending(self, backend: Backend, batch: int = BATCH) -> int:
        """Send what is pending, in order, in batches of at most `batch`; returns how many were sent.
        The backend's error (the tracker unreachable) propagates; the batches before it count."""
        done = 0
        while True:
            with self._lock:
                chunk = self._queue[:batch]
            if not chunk:
                return done
            backend.send(chunk)
            with self._lock:
                del self._queue[: len(chunk)]
            self.save_state(sent=chunk[-1]["seq"])
            done += len(chunk)

    def start(self, backend: Backend) -> None:
        """Send in the background from now on, `backend` taking the records."""
        self._thread = threading.Thread(target=self._run, args=(backend,), name=f"speedrun-{self.name}", daemon=True)
        self._thread.start()

    def _run(self, backend: Backend) -> None:
        failures = 0
        while True:
            with self._lock:
                while not self._closing and not self._queue:
                    self._lock.wait()
                closing = self._closing
            try:
                self.send_pending(backend)
                failures, self.last_error = 0, None
            except Exception as e:  # the tracker's trouble, never the run's: keep the lines, try again
                self.last_error = one_line(e)
                wait = RETRY_S[min(failures, len(RETRY_S) - 1)]
                failures += 1
                with self._lock:
                    self._lock.wait(timeout=wait)
                continue
            if closing and not self.pending():
                return
            with self._lock:  # a batch per GATHER_S at most while the run goes on, not a call per record
                if not self._closing:
                    self._lock.wait(timeout=GATHER_S)

    def close(self, timeout_s: float = FLUSH_S) -> int:
        """Stop sending once everything is sent, or `timeout_s` passed, or the tracker failed;
        returns how many records stay unsent (kept for the next start or `speedrun track sync`)."""
        if self._thread is not None:
            with self._lock:
                self._closing = True
                self._lock.notify()
            deadline = time.monotonic() + timeout_s
            while self._thread.is_alive() and time.monotonic() < deadline and self.last_error is None:
                self._thread.join(timeout=0.1)
            # A tracker failing at the end gets no more of the run's time: its thread, a daemon, is
            # left to its retries until the process ends; what it did not send is on disk.
        return self.pending()


def read_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
