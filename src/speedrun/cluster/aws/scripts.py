"""Preparing an AWS host: one idempotent shell script (`prepare_script`, run by `prepare_host`)
that checks for libfabric's EFA provider where the host has EFA, mounts EFS, mounts or syncs the
data, and starts the autostop watcher, written for the host's distribution family (apt-get or
yum)."""
from __future__ import annotations

import shlex
from typing import Any

from speedrun.cluster.aws.config import DATA_DEVICE, AWSConfig
from speedrun.cluster.aws.efa import efa_check_script
from speedrun.cluster.hosts import Host
from speedrun.errors import SpeedrunError, last_line


def os_id(host: Host) -> str:
    """The host's distribution family: the ID (or ID_LIKE) of /etc/os-release, e.g. ubuntu, amzn."""
    r = host.shell(". /etc/os-release && echo \"$ID $ID_LIKE\"")
    return r.text.strip() or "unknown"


def install_command(os_ids: str, debian: str, redhat: str) -> str:
    """The command installing a package on this distribution family (apt-get or yum)."""
    words = os_ids.split()
    if any(w in ("ubuntu", "debian") for w in words):
        return f"$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q {debian}"
    if any(w in ("amzn", "rhel", "fedora", "centos") for w in words):
        return f"$SUDO yum install -y -q {redhat}"
    raise SpeedrunError(f"speedrun does not know how to install packages on {os_ids!r}: use an Ubuntu or "
                        f"Amazon Linux image")


def efs_mount_script(os_ids: str, address: str, path: str) -> str:
    """Mount an EFS file system (by its mount target's address, so no DNS is needed) at `path` over
    NFS 4.1 with AWS's recommended options, installing the NFS client for the host's OS first.
    Does nothing where `path` is already a mount point."""
    p = shlex.quote(path)
    return f"""if ! mountpoint -q {p}; then
  command -v mount.nfs4 >/dev/null || {install_command(os_ids, "nfs-common", "nfs-utils")}
  $SUDO mkdir -p {p}
  $SUDO mount -t nfs4 -o nfsvers=4.1,rsize=1048576,wsize=1048576,hard,timeo=600,retrans=2,noresvport {address}:/ {p}
  $SUDO chown "$(id -u):$(id -g)" {p}
fi
"""


def data_volume_script(volume_id: str, path: str) -> str:
    """Mount the data volume read-only at `path`: on Nitro instances the NVMe device whose serial is
    the volume id, else the Xen name of /dev/sdf."""
    p, serial = shlex.quote(path), volume_id.replace("-", "")
    return f"""if ! mountpoint -q {p}; then
  dev=$(lsblk -ndpo NAME,SERIAL | awk '$2 == "{serial}" {{print $1}}')
  [ -n "$dev" ] || dev=/dev/xvdf
  $SUDO mkdir -p {p}
  $SUDO mount -o ro "$dev" {p}
fi
"""


def s3_sync_script(os_ids: str, url: str, path: str) -> str:
    """Sync the s3:// prefix `url` to `path`, installing the AWS CLI for the host's OS first."""
    p = shlex.quote(path)
    return f"""command -v aws >/dev/null || {install_command(os_ids, "awscli", "awscli")}
$SUDO mkdir -p {p} && $SUDO chown "$(id -u):$(id -g)" {p}
aws s3 sync --only-show-errors {shlex.quote(url)} {p}
"""


def autostop_script(minutes: float, tmux_socket: str = "speedrun", poweroff: str = "$SUDO shutdown -h now",
                    every_s: float = 60.0) -> str:
    """Start a watcher in the background that powers the host off (`poweroff`) once no job command
    (a live tmux window other than the idle `shell`) has run on `tmux_socket` for `minutes`.
    It checks every `every_s` seconds and writes "<checks> busy|idle <seconds idle>" to
    ~/.speedrun/autostop/status; starting it again replaces the previous watcher."""
    state = "$HOME/.speedrun/autostop"
    new, status = f'"{state}/status.new"', f'"{state}/status"'
    panes = f"tmux -L {tmux_socket} list-panes -a -F '#{{pane_dead}} #{{window_name}}' 2>/dev/null"
    loop = f"""idle_since=$(date +%s); checks=0
while true; do
  busy=$({panes} | awk '$1 == 0 && $2 != "shell"' | head -n 1)
  # One reading of the clock per check: two could straddle a second's tick, and a host seen busy
  # would count as idle for that second.
  now=$(date +%s)
  [ -n "$busy" ] && idle_since=$now
  idle=$(( now - idle_since )); checks=$((checks + 1))
  # Written whole, then renamed: a reader never sees the file empty.
  echo "$checks $([ -n "$busy" ] && echo busy || echo idle) $idle" > {new} && mv -f {new} {status}
  if [ -z "$busy" ] && [ "$idle" -ge {max(1, round(minutes * 60))} ]; then {poweroff}; exit 0; fi
  sleep {every_s:g}
done"""
    return f"""mkdir -p "{state}"
[ -f "{state}/pid" ] && kill "$(cat "{state}/pid")" 2>/dev/null
SUDO="${{SUDO:-}}" nohup setsid bash -c {shlex.quote(loop)} >"{state}/log" 2>&1 </dev/null &
echo $! >"{state}/pid"
"""


def prepare_script(os_ids: str, inst: dict[str, Any], config: AWSConfig, efs: tuple[str, str] | None, *,
                   efa: bool = False) -> str:
    """The host's preparation: the EFA check (efa: launched with EFA), shared storage, data and
    the autostop watcher (idempotent)."""
    parts = ['set -e\nSUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo\n']
    if efa:
        parts.append(efa_check_script(config.instance_type))
    if efs is not None:
        parts.append(efs_mount_script(os_ids, efs[1], config.efs_mount))
    volume = next((m["Ebs"]["VolumeId"] for m in inst.get("BlockDeviceMappings", [])
                   if m["DeviceName"] == DATA_DEVICE), None)
    if config.data_snapshot and volume:
        parts.append(data_volume_script(volume, config.data_mount))
    if config.data_s3:
        parts.append(s3_sync_script(os_ids, config.data_s3, config.data_mount))
    if config.autostop:
        parts.append(autostop_script(config.autostop))
    return "".join(parts)


def prepare_host(host: Host, inst: dict[str, Any], config: AWSConfig, efs: tuple[str, str] | None, *,
                 efa: bool = False) -> None:
    """Run the host's preparation script there; SpeedrunError naming the instance when it fails."""
    script = prepare_script(os_id(host), inst, config, efs, efa=efa)
    r = host.shell(script)
    if r.returncode != 0:
        raise SpeedrunError(f"preparing {host.name} ({inst['InstanceId']}) failed: {last_line(r.stderr, 'no message')}")
