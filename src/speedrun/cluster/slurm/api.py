"""Slurm's own clients (sbatch, squeue, scontrol, scancel), run with each failure told in one line:
what the user can fix (no Slurm client on PATH, an unknown partition or account, more nodes than a
partition has) is SpeedrunError, exit 2, quoting Slurm's own message; a controller that does not
answer is SlurmFailed, exit 3. SLURM_CONF and the rest of the environment reach the clients as they
are, so speedrun talks to whichever cluster they would."""
from __future__ import annotations

import re
import shutil
import subprocess
from typing import Sequence

from speedrun.errors import EXIT_FAILED, SpeedrunError

CLIENT_TIMEOUT_S = 60.0  # one client call; Slurm's own message timeout is 10 s, retried a few times
# What Slurm's clients say when the controller (or the way to it) failed, not the request.
UNREACHABLE = re.compile(r"Unable to contact slurm controller|Socket timed out|Connection refused|"
                         r"Zero Bytes were transmitted|Communication connection failure|munge", re.I)
_PREFIX = re.compile(r"^(?:sbatch|squeue|scontrol|scancel|sinfo|srun): (?:error: )?")  # the client's own


class SlurmFailed(SpeedrunError):
    """Slurm itself failed (its controller did not answer): the CLI exits with `exit_code` (3)."""

    exit_code = EXIT_FAILED


def slurm_message(stderr: str) -> str:
    """Slurm's reason in a client's error output, as one line: its lines without the program's
    prefix, joined ("sbatch: error: invalid partition specified: x" and "allocation failure: Invalid
    partition name specified" -> "invalid partition specified: x; allocation failure: Invalid...")."""
    lines = [_PREFIX.sub("", ln.strip()) for ln in stderr.splitlines() if ln.strip()]
    text = "; ".join(dict.fromkeys(lines)) or "no message"
    return text if len(text) <= 300 else text[:297] + "..."


def run_client(argv: Sequence[str], *, what: str, timeout: float = CLIENT_TIMEOUT_S) -> str:
    """Run one Slurm client command and return its standard output; `what` names the request in
    errors ("submit job r50"). SpeedrunError when the program is missing or Slurm refuses the
    request, SlurmFailed when the controller cannot be reached."""
    program = argv[0]
    if shutil.which(program) is None:
        raise SpeedrunError(f"{program} is not on PATH: the slurm provider runs where Slurm's clients are "
                            f"(a cluster's login node; Debian/Ubuntu: apt-get install slurm-client)")
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SlurmFailed(f"cannot {what}: {program} got no answer within {timeout:g} s; "
                          f"is the Slurm controller up? (scontrol ping)") from None
    if r.returncode != 0:
        message = slurm_message(r.stderr or r.stdout)
        if UNREACHABLE.search(message):
            raise SlurmFailed(f"cannot {what}: Slurm did not answer ({program}: {message})")
        raise SpeedrunError(f"cannot {what}: {program}: {message}")
    return r.stdout
