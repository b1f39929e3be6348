"""Host settings the 2018 record applied before multi-machine training: larger TCP socket buffers
(gradients cross the network every step) and a higher open-file limit (many loader workers,
each with many image files open). Opt-in: `speedrun tune-host` shows the plan, `--apply` writes
it (root needed). Nothing here runs unless a user asks for it.
"""
from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

from speedrun.errors import SpeedrunError

BUFFER_BYTES = 16 * 2**20  # 16 MiB, as in the record's setup
SYSCTLS = {
    "net.core.rmem_max": str(BUFFER_BYTES),
    "net.core.wmem_max": str(BUFFER_BYTES),
    "net.ipv4.tcp_rmem": f"4096 87380 {BUFFER_BYTES}",
    "net.ipv4.tcp_wmem": f"4096 65536 {BUFFER_BYTES}",
}
OPEN_FILES = 65536


@dataclass(frozen=True)
class Setting:
    name: str
    current: str
    wanted: str

    @property
    def ok(self) -> bool:
        # For the buffer sysctls, larger than wanted is fine too.
        cur, want = self.current.split(), self.wanted.split()
        if len(cur) != len(want) or not all(c.isdigit() for c in cur):
            return self.current == self.wanted
        return all(int(c) >= int(w) for c, w in zip(cur, want))


def sysctl_path(name: str, root: Path = Path("/proc/sys")) -> Path:
    return root / name.replace(".", "/")


def plan(root: Path = Path("/proc/sys")) -> list[Setting]:
    """Each setting with its current and wanted value (current "unavailable" where the kernel
    does not expose it, e.g. in some containers)."""
    settings = []
    for name, wanted in SYSCTLS.items():
        path = sysctl_path(name, root)
        current = " ".join(path.read_text().split()) if path.exists() else "unavailable"
        settings.append(Setting(name, current, wanted))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    settings.append(Setting("open files (ulimit -n, hard limit)", str(hard), str(OPEN_FILES)))
    return settings


def apply(root: Path = Path("/proc/sys")) -> list[Setting]:
    """Write every sysctl that is below its wanted value. Returns what was changed.

    The open-file limit is per process: raise it in the shell that starts training
    (`ulimit -n 65536`, or /etc/security/limits.conf); this only reports it.
    """
    changed = []
    for setting in plan(root):
        if setting.name not in SYSCTLS or setting.ok or setting.current == "unavailable":
            continue
        try:
            sysctl_path(setting.name, root).write_text(setting.wanted + "\n")
        except OSError as e:
            raise SpeedrunError(f"cannot set {setting.name} ({e.strerror}); "
                                "run `speedrun tune-host --apply` as root") from None
        changed.append(setting)
    return changed
