"""Process-group set-up from torchrun's environment, and the few reductions the loop needs.

One process per device. Under `torchrun` the variables RANK, WORLD_SIZE, LOCAL_RANK and
MASTER_ADDR/MASTER_PORT are set and we join the group with env://; without them this is a
single process and nothing distributed is started. NCCL on CUDA, gloo on CPU.
"""
from __future__ import annotations

import datetime
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from speedrun.data.base import Shard
from speedrun.errors import SpeedrunError

# A collective that waits longer than this raises instead of hanging forever when a peer died.
DEFAULT_TIMEOUT_S = 300
# gloo's errors begin with the source file that raised them ("[.../gloo/transport/tcp/pair.cc:545]
# Read error [10.0.0.2]:41234: Connection reset by peer. ..."), and torch passes them on as plain
# RuntimeErrors, from DDP's buffer broadcast, its gradient all-reduce and any collective's wait.
GLOO_ERROR = re.compile(r"^\[[^\]]*gloo[^\]]*\]\s*")
# ... except this one: a pair that timed out waiting for a peer that stopped answering.
GLOO_TIMEOUT = "Application timeout caused pair closure"
PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")  # the other end of a gloo connection
PEER_DIED = "probably died"  # in peer_failure's line: the launcher recognises collateral failures by it


@dataclass(frozen=True)
class Peer:
    """Where one rank runs, as it said when the group formed: its host name, its host's address
    on the route to rank 0's host (MASTER_ADDR), and its process id."""

    host: str
    address: str
    pid: int

    def __str__(self) -> str:
        return f"host {self.host}, {self.address}"


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job, and the device it trains on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    peers: tuple[Peer, ...] = ()  # every rank's, by rank; empty in a single process
    timeout_s: float = DEFAULT_TIMEOUT_S  # how long a collective waits for a peer (seconds)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def shard(self) -> Shard:
        return Shard(self.rank, self.world_size)


class JobShare:
    """The processes of a job as the image-folder index needs them (`data.index.JobShare`):
    rank 0 leads, and `share` / `gather` are gloo collectives on a group of their own, created at
    first use (every rank reaches it at the same point: the data source's start). The group
    waits `timeout_s` (default 2 h), not the training collectives' minutes: building the index
    of ImageNet on a cold file system takes that long while the other ranks wait."""

    def __init__(self, ctx: DistContext, timeout_s: float = 7200.0):
        self.leader = ctx.rank == 0
        peer = ctx.peers[ctx.rank] if ctx.peers else this_peer()
        self.where = f"host {peer.host}, rank {ctx.rank}"
        self._timeout_s = timeout_s
        self._group = None

    def _the_group(self):
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self._timeout_s))
        return self._group

    def share(self, value):
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._the_group())
        return box[0]

    def gather(self, value) -> list:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, value, group=self._the_group())
        return everyone


def job_share(ctx: DistContext) -> JobShare | None:
    """The `JobShare` of a job of several processes; None for one process."""
    return JobShare(ctx) if ctx.distributed else None


def pick_device(requested: str | None) -> str:
    """"cuda" when asked or available, else "cpu"; a clear error when CUDA is asked but absent."""
    if requested in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise SpeedrunError("--device cuda was asked for, but PyTorch sees no CUDA device here; use --device cpu")
    if requested not in ("cpu", "cuda"):
        raise SpeedrunError(f"unknown device {requested!r} (use cpu or cuda)")
    return requested


def init_distributed(device_kind: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Join the process group torchrun describes (if any) and pick this process's device. A
    collective that waits `timeout_s` seconds for a peer fails (`collective_failed`)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_kind == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise SpeedrunError(
                f"local rank {local_rank} has no GPU: this machine has {torch.cuda.device_count()}; "
                "use --nproc-per-node at most that"
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device_kind == "cuda" else "gloo",
            init_method="env://",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device_kind == "cuda" else None,
        )
    peers: tuple[Peer, ...] = ()
    if world_size > 1:  # who is where, to name the rank that died when a collective fails
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, this_peer())
        peers = tuple(everyone)
    return DistContext(rank, world_size, local_rank, device, peers, timeout_s)


def this_peer() -> Peer:
    """This process as a `Peer`. The address is the one the route to MASTER_ADDR leaves from,
    which is the one other hosts see (a UDP socket's connect sends nothing)."""
    address = "?"
    try:
        family, kind, _, _, target = socket.getaddrinfo(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                                        int(os.environ.get("MASTER_PORT", "0")) or 9,
                                                        type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as s:
            s.connect(target)
            address = s.getsockname()[0]
    except OSError:  # no route or no name: the host name alone names it
        pass
    return Peer(socket.gethostname(), address, os.getpid())


def collective_failed(error: BaseException, ctx: DistContext) -> bool:
    """Whether `error` is a collective that failed because a peer went away (its process died,
    its host went down or was cut off, or it stopped answering until the timeout), rather than a
    bug: a DistError (NCCL, the store), or a RuntimeError that gloo raised (by its message's
    source location, or its timeout's words; torch does not wrap those). Only under a process group."""
    if not ctx.distributed or not isinstance(error, RuntimeError):
        return False
    return (isinstance(error, dist.DistError) or GLOO_ERROR.match(str(error)) is not None
            or str(error).startswith(GLOO_TIMEOUT))


def peer_failure(error: BaseException, ctx: DistContext) -> str:
    """One line for a failed collective (`collective_failed`): which rank probably died and
    what the backend said, e.g. "a collective failed: rank 1 (host b, 10.0.0.2) probably died
    (Read error [10.0.0.2]:41234: Connection reset by peer)"."""
    said = GLOO_ERROR.sub("", str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)
    said = said.split(". This is typically")[0]  # gloo's generic advice
    return f"a collective failed: {suspects(said, ctx)} {PEER_DIED} ({said})"


def suspects(said: str, ctx: DistContext) -> str:
    """The rank(s) that probably died, from what the backend `said` and what this rank can see:
    the address of the connection that broke, and which processes on this host are gone."""
    others = [r for r in range(ctx.world_size) if r != ctx.rank]
    if not ctx.peers:
        return "another rank"
    me = ctx.peers[ctx.rank]
    found = PEER_ADDRESS.search(said)
    address = found.group(1).removeprefix("::ffff:") if found else None  # IPv4 as IPv6 too
    candidates = [r for r in others if ctx.peers[r].address == address] or others
    # A rank on this host whose process is gone is the one, whoever else shares the address.
    gone = [r for r in candidates if (ctx.peers[r].host, ctx.peers[r].address) == (me.host, me.address)
            and process_gone(ctx.peers[r].pid)]
    candidates = gone or candidates
    if len(candidates) == 1:
        return f"rank {candidates[0]} ({ctx.peers[candidates[0]]})"
    hosts = {str(ctx.peers[r]) for r in candidates}
    where = f" ({hosts.pop()})" if len(hosts) == 1 else ""
    if address and not where:
        where = f" (at {address})"
    who = f"one of ranks {', '.join(map(str, candidates))}" if len(candidates) <= 4 else "another rank"
    return who + where


def process_gone(pid: int) -> bool:
    """Whether process `pid` of this host has ended (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum `tensor` over all ranks in place (a no-op in a single process); returns it."""
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_object(obj, ctx: DistContext):
    """Rank 0's `obj` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


@torch.no_grad()
def average_buffers(model: torch.nn.Module, ctx: DistContext) -> None:
    """Average floating-point buffers (BatchNorm running statistics) over ranks. Each rank's
    statistics come from its own batches; averaged, every rank evaluates the same model and the
    checkpoint rank 0 writes is that model."""
    if not ctx.distributed:
        return
    for buffer in model.buffers():
        if buffer.is_floating_point():
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
            buffer.div_(ctx.world_size)


def processes(n: int | None) -> str:
    """"1 process", "8 processes"."""
    return f"{n} process" if n == 1 else f"{n} processes"
