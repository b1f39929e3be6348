"""A relay that lets a process in a network namespace reach a TCP server on this machine's loopback.

The AWS test server (moto) listens on 127.0.0.1 of the test process's namespace; a namespace host
(a controller running a watcher) has a loopback of its own and no route to it. The relay has two
halves joined by a Unix socket, which both sides reach because namespaces share the filesystem:

    in the namespace:   127.0.0.1:PORT  --(each connection)-->  SOCKET     (`python3 aws_relay.py SOCKET`)
    test process:       SOCKET          --(each connection)-->  127.0.0.1:TARGET_PORT  (Relay)

    with Relay(aws.endpoint, tmp_path / "relay.sock", host.namespace) as relay:
        relay.endpoint  # http://127.0.0.1:PORT, as the namespace's processes reach the server

Traffic goes only over loopback and the Unix socket. Bytes are copied as they are (HTTP here).
"""
from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy reader to writer until end of stream, then close the writer's side."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass  # the other side went away: the connection ends either way
    finally:
        with contextlib.suppress(OSError):
            writer.close()


async def join(client: tuple[asyncio.StreamReader, asyncio.StreamWriter], connect) -> None:
    """Connect onwards (`connect()`: a coroutine giving a reader and writer) and copy both ways."""
    reader, writer = client
    try:
        far_reader, far_writer = await connect()
    except OSError:
        writer.close()
        return
    await asyncio.gather(pipe(reader, far_writer), pipe(far_reader, writer))


class Relay:
    """The test process's half (connections on `socket_path` go to `target`, an http://127.0.0.1:PORT
    URL), and with `namespace` also the other half started there; a context manager."""

    def __init__(self, target: str, socket_path: Path, namespace: str | None = None):
        url = urlsplit(target)
        self.target = (url.hostname, url.port)
        self.socket_path, self.namespace = Path(socket_path), namespace
        self.port: int | None = None  # where the namespace's half listens
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._inside: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Relay":
        self._thread.start()
        connect = lambda: asyncio.open_connection(*self.target)  # noqa: E731
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_unix_server(lambda r, w: join((r, w), connect), path=str(self.socket_path)), self._loop)
        server.result(timeout=30)
        if self.namespace is not None:
            self._inside = subprocess.Popen(["ip", "netns", "exec", self.namespace, sys.executable, __file__,
                                             str(self.socket_path)], stdout=subprocess.PIPE, text=True)
            line = self._inside.stdout.readline()  # it prints its port once it listens
            if not line.startswith("listening "):
                self.__exit__()
                raise RuntimeError(f"the relay in namespace {self.namespace} did not start: {line!r}")
            self.port = int(line.split()[1])
        return self

    def __exit__(self, *exc) -> None:
        if self._inside is not None and self._inside.poll() is None:
            self._inside.terminate()
            self._inside.wait(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self.socket_path.unlink(missing_ok=True)


async def inside(socket_path: str) -> None:
    """The namespace's half: listen on 127.0.0.1 (a free port, printed), relay each connection to the socket."""
    connect = lambda: asyncio.open_unix_connection(socket_path)  # noqa: E731
    server = await asyncio.start_server(lambda r, w: join((r, w), connect), "127.0.0.1", 0)
    print(f"listening {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(inside(sys.argv[1]))
