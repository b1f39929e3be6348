"""The all-reduce `speedrun check` measures, for 2 gloo processes on this machine's CPU, side by side
with a plain TCP stream between two processes over the same loopback.

    python benchmarks/allreduce.py [--size 64] [--iters 20] [--json benchmarks/results/allreduce-gloo-2proc-cpu.json]

  speedrun check's benchmark   torchrun, 2 processes, gloo over TCP on 127.0.0.1: busbw per message
                               size (python -m speedrun.cluster.allreduce, what check runs on each task)
  TCP stream                   the baseline: one process sends the largest message's bytes to the other
                               over a TCP socket on 127.0.0.1, as fast as the kernel moves them: the
                               ceiling of anything that all-reduces over TCP here

A ring all-reduce of 2 processes moves each message once over each link (busbw = algbw x 2(n-1)/n
= algbw), so the ratio busbw / stream bandwidth says how much of the link gloo turns into
all-reduce. A CPU figure: on GPUs NCCL's figure is what counts, and it is not measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def tcp_stream_gbps(size: int, rounds: int) -> float:
    """GB/s (1e9 bytes) of `rounds` messages of `size` bytes from one process to another over loopback TCP."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    sender = subprocess.Popen([sys.executable, "-c", f"""
import socket
s = socket.create_connection(("127.0.0.1", {port}))
buf = bytes({size})
for _ in range({rounds} + 1):
    s.sendall(buf)
s.recv(1)
"""])
    conn, _ = server.accept()
    view = memoryview(bytearray(size))

    def receive_one() -> None:
        got = 0
        while got < size:
            got += conn.recv_into(view[got:], size - got)
    receive_one()  # the first message: warm-up (buffers grown, the sender started)
    start = time.perf_counter()
    for _ in range(rounds):
        receive_one()
    seconds = time.perf_counter() - start
    conn.sendall(b"x")
    sender.wait(timeout=60)
    conn.close()
    server.close()
    return size * rounds / seconds / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=float, default=64.0, help="largest message, MiB (default 64)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size (default 20)")
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args()
    src = str(Path(__file__).resolve().parents[1] / "src")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "check.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        "-m", "speedrun.cluster.allreduce", "--out", str(out), "--size", f"{args.size:g}",
                        "--iters", str(args.iters)], env=env, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
    stream = tcp_stream_gbps(int(args.size * MiB), max(3, args.iters // 2))
    print(f"all-reduce, 2 gloo processes on this machine's CPU ({os.cpu_count()} cores), {args.iters} calls per size")
    print(f"{'size (B)':>12} {'time (us)':>11} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    for r in result["results"]:
        print(f"{r['bytes']:>12} {r['time_us']:>11.1f} {r['algbw_GBps']:>13.3f} {r['busbw_GBps']:>13.3f}")
    largest = result["results"][-1]["busbw_GBps"]
    print(f"TCP stream, one process to another on 127.0.0.1, {args.size:g} MiB messages: {stream:.3f} GB/s")
    print(f"ratio: busbw / stream = {largest / stream:.2f} at {args.size:g} MiB")
    if args.json:
        args.json.write_text(json.dumps({"what": "speedrun check's all-reduce, 2 gloo processes, CPU, loopback",
                                         "cpus": os.cpu_count(), "size_mib": args.size, "iters": args.iters,
                                         "results": result["results"], "tcp_stream_GBps": stream,
                                         "busbw_over_stream": largest / stream}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
