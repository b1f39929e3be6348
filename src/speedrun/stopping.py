"""Stopping a run at a step, so that `--resume` continues from exactly there.

Three things ask a run to stop:

- SIGTERM (what a scheduler, torchrun's agent or `kill` sends first). A second SIGTERM does not
  wait: it interrupts at once, as Ctrl-C does; but one within DUPLICATE_S of the first is the same
  request delivered twice (Slurm signals every process of a job, and torchrun's agent forwards its
  own copy to the workers), which must not cost the checkpoint of the step.
- A spot interruption notice: a thread polls the instance metadata endpoint's
  `spot/instance-action` every 5 s (`notice_url`; AWS gives two minutes between the notice and
  the end). Off unless a URL is given (`--spot-notice-url`, or SPEEDRUN_SPOT_NOTICE_URL, which
  the AWS provider sets for spot jobs): nothing is polled on machines that are not spot instances.
- A request: a file named `stop` in the run directory (`touch RUN_DIR/stop`).

A notice, a request or SIGTERM seen by any rank stops all of them after the same step: after every
step the ranks agree (an all-reduce of one small integer, over gloo so that it never waits on the
GPU's stream). A scheduler's SIGTERM reaches the ranks a few milliseconds apart, so a rank that has
it still asks: one that did not would leave the others waiting in the question for it. But it
waits at most AGREE_S for an answer: torchrun also sends SIGTERM when a rank died, and then each
survivor stops alone, at once. Every rank has the same weights after each step, so rank 0 alone
can write the checkpoint of the last step it finished.
Either way rank 0's checkpoint holds the position in the epoch's sample order, and the process
exits with EXIT_RESUMABLE.
"""
from __future__ import annotations

import datetime
import json
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from speedrun.dist import DistContext

# torch is imported where it is used: `speedrun train`'s parser reads this module's names, and
# `speedrun --help` should not pay for importing torch.

POLL_S = 5.0  # how often the notice URL is asked, seconds (AWS's advice)
DUPLICATE_S = 2.0  # a SIGTERM this soon after the first is the same request, seconds
AGREE_S = 10.0  # after SIGTERM, how long a rank waits for the others to agree on the step, seconds
STOP_FILE = "stop"

# Why a run stops, as the integer the ranks agree on (the largest wins).
SIGNAL, REQUEST, NOTICE = 1, 2, 3
REASONS = {SIGNAL: "SIGTERM", REQUEST: "a stop request (the run directory's `stop` file)",
           NOTICE: "a spot interruption notice"}


class StopRequests:
    """Watches for the three requests above while the training loop runs; `agreed()` after each
    step says whether to stop now. Use as a context manager (it installs the SIGTERM
    handler and the polling thread, and removes them)."""

    def __init__(self, ctx: DistContext, run_dir: Path, notice_url: str | None):
        self.ctx, self.stop_file, self.notice_url = ctx, run_dir / STOP_FILE, notice_url
        self.code = 0  # this rank's request (0: none)
        self.decided = 0  # what the ranks agreed on after the last step (0: go on)
        self.sigterm: float | None = None  # when SIGTERM came (time.monotonic())
        self.alone = False  # after SIGTERM the others did not answer: stop without asking them again
        self.notice: str | None = None  # the notice's text, when one came
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous_handler = None
        self.settled = False  # the run's outcome is on disk (settle())
        # A control group on gloo when the training group is NCCL: agreeing on the CPU does not
        # wait for the GPU's queued work. Every rank makes it, in the same order.
        # Its timeout is the run's: a new group's default is gloo's own (30 minutes).
        self._group = None
        import torch.distributed as dist
        if ctx.world_size > 1 and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=ctx.timeout_s))

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._thread = threading.Thread(target=self._poll, name="stop-requests", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._previous_handler is not None:
            # Settled: what is left is clean-up, which a SIGTERM must not turn into another exit
            # code. The caller puts its own handler back when it is done (engine.train).
            signal.signal(signal.SIGTERM, signal.SIG_IGN if self.settled else self._previous_handler)

    def settle(self) -> None:
        """The run's outcome is decided and results.json written (by rank 0): from now on a
        SIGTERM changes nothing on this rank, also after this context ends (CI: a scheduler's
        second one, come while the run plotted or shut its process group down, turned "stopped",
        exit 75, into exit 130). A clean-up that hangs is left to SIGKILL, which torchrun and
        Slurm send after their grace period."""
        self.settled = True

    @property
    def reason(self) -> str:
        return REASONS.get(self.decided, "nothing")

    def request(self, code: int) -> None:
        self.code = max(self.code, code)

    def _on_sigterm(self, signum, frame) -> None:
        if self.settled:
            return
        now = time.monotonic()
        if self.sigterm is not None and now - self.sigterm >= DUPLICATE_S:  # asked again: do not wait for the step
            raise KeyboardInterrupt("stopped by a second SIGTERM")
        if self.sigterm is None:
            self.sigterm = now
        self.request(SIGNAL)

    def _poll(self) -> None:
        """The stop file every second; the notice URL every POLL_S seconds."""
        ticks = 0
        while not self._done.wait(0 if ticks == 0 else 1.0):
            if self.stop_file.exists():
                self.request(REQUEST)
            if self.notice_url and ticks % int(POLL_S) == 0:
                notice = spot_notice(self.notice_url)
                if notice is not None:
                    self.notice = notice
                    self.request(NOTICE)
            ticks += 1

    def agreed(self) -> bool:
        """Whether to stop after this step (called after each step, on every rank): when any rank
        has a request. A rank that got SIGTERM asks the others too (a scheduler signals every rank,
        not all at the same instant: one that skipped the question would leave the others waiting
        in it), but for at most AGREE_S seconds: torchrun also sends SIGTERM when a rank died, and
        then it stops alone, at once. A request that comes while the ranks are asking (a signal's
        handler runs when the all-reduce returns) is not in their answer: it waits for the next
        step's, so that every rank takes the same decision."""
        code = self.code
        if self.ctx.world_size > 1 and not self.alone:
            import torch
            import torch.distributed as dist

            flag = torch.tensor([code], dtype=torch.int32)
            if self.sigterm is None:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
                code = int(flag.item())
            elif self._bounded(dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)):
                code = int(flag.item())
            else:  # no answer: this rank stops alone, on its own request
                code = self.code
        self.decided = code
        self.code = max(self.code, code)
        return self.decided != 0

    def _bounded(self, work) -> bool:
        """Wait for a collective on the control group for at most AGREE_S; False (and this rank
        stops alone from now on) when a peer is gone or does not answer."""
        try:
            work.wait(timeout=datetime.timedelta(seconds=AGREE_S))
            return True
        except RuntimeError:  # gloo: the peer's connection closed, or the time ran out
            self.alone = True
            return False

    def barrier(self) -> None:
        """Wait until every rank gets here (on the control group); after SIGTERM for at most
        AGREE_S, and not at all once this rank stops alone (a rank may be gone)."""
        if self.ctx.world_size > 1 and not self.alone:
            import torch.distributed as dist
            if self.sigterm is None:
                dist.barrier(group=self._group)
            else:
                self._bounded(dist.barrier(group=self._group, async_op=True))

    def clear(self) -> None:
        """Forget a handled stop file, so that the resumed run does not stop at once."""
        self.stop_file.unlink(missing_ok=True)


def spot_notice(url: str, timeout: float = 2.0) -> str | None:
    """The spot interruption notice at `url` ("terminate at 2026-...T...Z"), or None when there
    is none (404) or the endpoint cannot be reached. Speaks IMDSv2: a session token is asked for
    first (PUT /latest/api/token); without one the plain GET is tried."""
    parts = urllib.parse.urlsplit(url)
    headers = {}
    try:
        token_url = f"{parts.scheme}://{parts.netloc}/latest/api/token"
        request = urllib.request.Request(token_url, method="PUT",
                                         headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
        with urllib.request.urlopen(request, timeout=timeout) as r:
            headers["X-aws-ec2-metadata-token"] = r.read().decode().strip()
    except (OSError, ValueError):
        pass
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            body = r.read().decode()
    except (OSError, ValueError):  # 404 (HTTPError is an OSError): no notice
        return None
    try:
        notice = json.loads(body)
        return f"{notice.get('action', 'stop')} at {notice.get('time', '?')}"
    except (ValueError, AttributeError):
        return body.strip()[:100] or "notice"
