"""The tmux runner: bash scripts that run a command in a named tmux window and report on it.

A command is never typed into tmux (no send-keys). Instead, in the task's command directory

    <run_dir>/task-<i>/cmds/<NNNNNN>-<name>/
        command.sh   the command text, verbatim: quotes, #, &, newlines, heredocs all just work
        run.sh       the wrapper: runs command.sh, copies its output to `log` (and the window),
                     then writes `status`: the exit status, or "killed" if it was stopped by a signal
        pid          the wrapper's process id, to wait on
        log, status

and a tmux window named <name> runs `bash run.sh` in the task's session. One tmux server per
host (socket name `speedrun` unless told otherwise), one session per task, one window per command;
a session's first window is an idle shell, so the session outlives its commands.

Every function here returns the text of a bash script that a Host runs (Host.shell); each script
prints `key=value` lines, read back with `parse_fields`. They run the tmux client, mkdir and
cat a few times and otherwise use bash builtins, because every process started costs round-trip
time in `task.run`.
"""
from __future__ import annotations

import shlex
from typing import Mapping

SEQ_DIGITS = 6  # command directories are numbered 000001, 000002, ... so that they sort by age
KILL_WAIT_S = 5.0  # how long stop_command waits for SIGKILLed processes to be gone, seconds
LOG_TAIL_LINES = 80  # lines of a failed command's log that task_status reports, to find the reason in


def q(value: object) -> str:
    """Quote a value for bash."""
    return shlex.quote(str(value))


def host_path(path: str) -> str:
    """A bash word for a path on the host: `~/x` and relative paths are taken from $HOME there."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + q(path[2:])
    if not path.startswith("/"):
        return '"$HOME"/' + q(path)
    return q(path)


# Helpers every script gets. Liveness is read from /proc because a process that has exited but not
# yet been reaped (tmux can be slow to reap a pane whose window stays open) still answers `kill -0`.
HELPERS = r"""alive() {  # is process $1 running? (a zombie is not)
    local st
    if [ -d /proc/self ]; then
        { read -r st < "/proc/$1/stat"; } 2>/dev/null || return 1
        st=${st##*) }; [ "${st%% *}" != Z ]
    else
        kill -0 "$1" 2>/dev/null
    fi
}
cmd_running() {  # is the command in directory $1 running? (no status yet, and its wrapper alive)
    local p
    [ ! -s "$1/status" ] && { read -r p < "$1/pid"; } 2>/dev/null && alive "$p"
}
group_alive() {  # is any process of process group $1 running?
    ps -e -o pgid=,stat= | { while read -r g st; do [ "$g" = "$1" ] && [ "${st#Z}" = "$st" ] && exit 0; done; exit 1; }
}
descendants() {  # the processes process $1 started, at any depth, whichever group or session they are in
    local -A kids=(); local pid ppid i=0; local -a queue=("$1")
    while read -r pid ppid; do kids[$ppid]+=" $pid"; done < <(ps -e -o pid=,ppid=)
    while [ "$i" -lt "${#queue[@]}" ]; do
        for pid in ${kids[${queue[$i]}]}; do echo "$pid"; queue+=("$pid"); done
        i=$((i + 1))
    done
}
any_alive() {  # is any of the processes $@ running?
    local p; for p in "$@"; do alive "$p" && return 0; done; return 1
}
"""


def script(body: str, socket: str = "speedrun") -> str:
    """Wrap a script body: `tm` runs the client of our tmux server (`tmux -L socket`); the body is
    read in full before it runs (a function), and no command in it can eat the rest of the script
    from standard input."""
    return f"tm() {{ tmux -L {q(socket)} \"$@\"; }}\n{HELPERS}main() {{\n{body}\n}}\nmain </dev/null\n"


def parse_fields(text: str) -> dict[str, str]:
    """`key=value` lines into a dict (the first `=` splits; lines without one are skipped);
    keys that repeat, such as `window`, collect their values in order separated by newlines."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key] = f"{fields[key]}\n{value}" if key in fields else value
    return fields


def probe(socket: str, session: str, task_index: int, setup_mark: str, local: bool) -> str:
    """What make_job needs to know about a task's host: home, address, tmux, its session (and the
    run directory, age and windows of that session: `window=<dead> <name>`, dead 1 also for a window
    whose command wrote its exit status), the last command number and the setup mark."""
    address = "echo ip=127.0.0.1" if local else (
        'set -- ${SSH_CONNECTION:-}\n'
        'if [ $# -ge 3 ]; then echo "ip=$3"; else set -- $(hostname -I 2>/dev/null); echo "ip=${1:-127.0.0.1}"; fi'
    )
    return script(socket=socket, body=f"""
echo "home=$HOME"
{address}
if command -v tmux >/dev/null; then echo tmux=1; else echo tmux=0; return; fi
echo "now=$(date +%s)"
if [ -r {host_path(setup_mark)} ]; then read -r h < {host_path(setup_mark)}; echo "setup_hash=$h"; fi
S={q(session)}
tm has-session -t "=$S" 2>/dev/null || return 0
echo session=1
rd=$(tm show-options -t "=$S:" -qv @speedrun_run_dir)
echo "run_dir=$rd"
tm display-message -p -t "=$S:" 'created=#{{session_created}}'
last=0
declare -A ended=()
for f in "$rd/task-{task_index}/cmds"/{"[0-9]" * SEQ_DIGITS}-*; do
    [ -d "$f" ] || continue
    b=${{f##*/}}; n=$((10#${{b%%-*}}))
    [ "$n" -gt "$last" ] && last=$n
    # Its wrapper's pid (the window's process): ended once a status is written. The newest command
    # of a pid decides, should the pid have been used before.
    {{ read -r p < "$f/pid"; }} 2>/dev/null && [ -n "$p" ] || continue
    if [ -s "$f/status" ]; then ended[$p]=1; else unset "ended[$p]"; fi
done
echo "last_seq=$last"
# A window whose command wrote its status is dead, though tmux may show it alive for a moment
# yet (the wrapper exits just after, and tmux closes the window later still, on a busy machine
# long enough for a new run to be taken for the old one still running).
tm list-panes -s -t "=$S:" -F '#{{pane_dead}} #{{pane_pid}} #{{window_name}}' | while read -r dead p name; do
    [ -n "${{ended[$p]:-}}" ] && dead=1
    echo "window=$dead $name"
done
""")


def allocate_run_dir(run_root: str, job: str, run_name: str) -> str:
    """Make and print the next free `<run_root>/<job>/<run_name>.<NN>` (mkdir is the atomic claim)."""
    return script(f"""
base={q(run_root)}/{q(job)}
mkdir -p "$base" || exit 3
n=1
while :; do
    printf -v d '%s/%s.%02d' "$base" {q(run_name)} "$n"
    [ ! -e "$d" ] && mkdir "$d" 2>/dev/null && break
    [ -d "$base" ] || exit 3
    n=$((n+1))
done
echo "run_dir=$d"
""")


def new_session(socket: str, session: str, job: str, run_dir: str, task_dir: str, cwd: str, replace: bool) -> str:
    """Make the task's directories and its tmux session (first window: an idle shell in cwd), recording
    the run directory on the session; with replace, a session of that name is replaced.

    The new session is made before the old one is killed (under a temporary name, then renamed):
    a tmux server exits when its last session goes, and a client that talks to it at that moment
    fails. For the same reason making a session is retried a few times."""
    make = """local try
for try in 1 2 3 4; do
    new_session "$1" 2>/dev/null && return 0
    sleep 0.1
done
new_session "$1"  # the last try shows its error"""
    replace_existing = """    T="$S-new-$$"
    make "$T" || exit 3
    tm kill-session -t "=$S" 2>/dev/null
    tm rename-session -t "=$T" "$S" || exit 3""" if replace else "    :"
    return script(socket=socket, body=f"""
S={q(session)}
new_session() {{
    tm new-session -d -s "$1" -n shell -c {q(cwd)} \\; \\
        set-option -t "=$1:" @speedrun_run_dir {q(run_dir)} \\; \\
        set-option -t "=$1:" @speedrun_job {q(job)}
}}
make() {{
{make}
}}
mkdir -p {q(task_dir)}/cmds {q(cwd)} || exit 3
if tm has-session -t "=$S" 2>/dev/null; then
{replace_existing}
else
    make "$S" || exit 3
fi
""")


def kill_session(socket: str, session: str) -> str:
    """Kill the task's session (its commands get SIGHUP); print killed=1 if there was one."""
    return script(f'tm kill-session -t ={q(session)} 2>/dev/null && echo killed=1; return 0', socket)


def wrapper(*, cwd: str, env: Mapping[str, str], signal_channel: str | None, keep_window: bool) -> tuple[str, str]:
    """run.sh, in two parts: the driver writes `export PATH=<its own PATH>` between them, so that
    commands find programs the way a fresh shell on that host does, whatever the tmux server's age."""
    signal = f"    tmux wait-for -S {q(signal_channel)} 2>/dev/null\n" if signal_channel else ""
    keep = 'tmux set-option -w -t "$TMUX_PANE" remain-on-exit on 2>/dev/null\n' if keep_window else ""
    exports = "".join(f"export {k}={q(v)}\n" for k, v in env.items())
    head = f"""#!/usr/bin/env bash
# Written by speedrun: runs command.sh in this directory, copies its output to `log` and to the
# terminal, and writes the exit status to `status` ("killed" when stopped by a signal).
d=${{0%/*}}
s=killed
finish() {{
    trap - EXIT HUP INT TERM
    echo "$s" > "$d/status"
{signal}}}
trap finish EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM
{keep}"""
    tail = f"""export PYTHONUNBUFFERED=1
{exports}if ! cd {q(cwd)} 2>>"$d/log"; then s=1; exit 1; fi
# pipefail: the pipeline's status is the command's (unless tee fails). In the background and waited
# for, so that a signal is handled at once rather than when the command ends.
set -o pipefail
bash "$d/command.sh" 2>&1 | tee -a "$d/log" &
wait $!
s=$?
"""
    return head, tail


def start_command(socket: str, session: str, task_dir: str, seq: int, name: str, command: str,
                  run_sh: tuple[str, str], wait_channel: str | None, unique_window: bool) -> str:
    """Write a command's files into a fresh numbered directory and start its window.

    Prints dir=, window= and pid=; with wait_channel, then waits for the command (the wrapper
    signals that tmux channel when it ends) and prints status= followed by the whole log.
    Exit status 4: a live window already has this name (only checked when unique_window).
    """
    busy = (f'tm list-panes -s -t "=$S:" -F "#{{pane_dead}} #{{window_name}}" | grep -qxF {q("0 " + name)} '
            f'&& {{ echo "a command named {name} is still running" >&2; exit 4; }}') if unique_window else ""
    wait = f"""tm wait-for {q(wait_channel)}
if [ -s "$d/status" ]; then read -r s < "$d/status"; else s=lost; fi
echo "status=$s"
# The log: read by bash itself when small (most are), which spares starting `cat`.
if {{ IFS= read -r -d '' -N 16384 out < "$d/log"; }} 2>/dev/null; [ "${{#out}}" -lt 16384 ]; then
    printf '%s' "$out"
else
    cat "$d/log"
fi""" if wait_channel else ""
    return script(socket=socket, body=f"""
S={q(session)}
{busy}
umask 077
base={q(task_dir)}/cmds
[ -d "$base" ] || mkdir -p "$base" || exit 3
n={seq}
while :; do
    printf -v nn '%0{SEQ_DIGITS}d' "$n"
    d="$base/$nn-"{q(name)}
    mkdir "$d" 2>/dev/null && break
    [ -d "$base" ] || exit 3
    n=$((n+1))
done
printf '%s' {q(command)} > "$d/command.sh"
{{ printf '%s' {q(run_sh[0])}; printf 'export PATH=%q\\n' "$PATH"; printf '%s' {q(run_sh[1])}; }} > "$d/run.sh"
umask 022
w=$(tm new-window -d -t "=$S:" -n {q(name)} -P -F '#{{window_id}} #{{pane_pid}}' bash "$d/run.sh") || exit 5
echo "${{w#* }}" > "$d/pid"
echo "dir=$d"
echo "window=${{w% *}}"
echo "pid=${{w#* }}"
{wait}
""")


STATE = """
if cmd_running "$d"; then echo status=running
elif [ -s "$d/status" ]; then read -r s < "$d/status"; echo "status=$s"
elif [ -d "$d" ]; then echo status=lost
else echo status=missing
fi"""


def command_state(cmd_dir: str) -> str:
    """Print status= with the command's exit status, `killed`, `running`, `lost` (no status and no
    process: the host rebooted or the process was SIGKILLed) or `missing`."""
    return script(f"d={q(cmd_dir)}{STATE}")


def wait_command(cmd_dir: str, poll_s: float = 0.2, max_s: int | None = None) -> str:
    """Block until the command has ended (checked every poll_s seconds), or for at most max_s
    whole seconds (then its state is `running`), then print its state."""
    within = "" if max_s is None else f' && [ "$SECONDS" -lt {int(max_s)} ]'
    return script(f"""d={q(cmd_dir)}
while cmd_running "$d"{within}; do sleep {poll_s}; done{STATE}""")


def latest_body(task_dir: str, name: str) -> str:
    pattern = "[0-9]" * SEQ_DIGITS
    return f"""d=
for f in {q(task_dir)}/cmds/{pattern}-{q(name)}; do [ -d "$f" ] && d=$f; done
[ -n "$d" ] || return 0
echo "dir=$d"{STATE}"""


def latest_command(task_dir: str, name: str) -> str:
    """Print dir= of the newest command called `name` in the task (nothing if there is none), then its state."""
    return script(latest_body(task_dir, name))


def task_status(socket: str, session: str, task_dir: str, name: str) -> str:
    """For `ls`/status: whether the session exists and since when, and the newest `name` command's state."""
    return script(socket=socket, body=f"""
echo "now=$(date +%s)"
if tm has-session -t ={q(session)} 2>/dev/null; then
    echo session=1
    tm display-message -p -t ={q(session)}: 'created=#{{session_created}}'
fi
{latest_body(task_dir, name)}
[ -s "$d/status" ] || return 0
# Ended: when (the status file's age), whether speedrun stopped it and why, and for a failure the
# end of its log, where the reason is.
echo "ended=$(stat -c %.3Y "$d/status")"
[ -s "$d/stopped" ] && {{ read -r w < "$d/stopped"; echo "stopped=$w"; }}
# A carriage return (a progress bar's redraw) becomes a line break before each line is prefixed:
# parse_fields splits at both, and a piece after a bare one would otherwise be read as a field.
[ "$s" = 0 ] || tail -n {LOG_TAIL_LINES} "$d/log" 2>/dev/null | tr '\\r' '\\n' | sed 's/^/logline=/'""")


def stop_command(cmd_dir: str, grace_s: float = 10.0, reason: str | None = None) -> str:
    """SIGHUP the command's process group (as closing its window would) and every process it
    started, wherever they went, and return once all of them have ended; SIGKILL what is left
    after grace_s seconds (then wait up to KILL_WAIT_S seconds for them to go). A reason (one
    line) goes to `stopped` in the command's directory first, for task_status to report."""
    note = f"printf '%s\\n' {q(reason)} > \"$d/stopped\"\n" if reason else ""
    return script(f"""d={q(cmd_dir)}
{{ read -r p < "$d/pid"; }} 2>/dev/null || return 0
cmd_running "$d" || group_alive "$p" || return 0
{note}# tmux makes each pane's first process a process-group leader: signal the whole group, and every
# process the command started that left it (torchrun starts each worker in a session of its own;
# once torchrun is gone they could no longer be found). A worker left running would hold the run
# directory's lock and its GPU against the next run.
tree=$(descendants "$p")
gone_within() {{  # all of them ended within $1 polls of 0.05 s?
    for _ in $(seq "$1"); do group_alive "$p" || any_alive $tree || return 0; sleep 0.05; done; return 1
}}
kill -HUP -- "-$p" 2>/dev/null || kill -HUP "$p" 2>/dev/null
[ -z "$tree" ] || kill -HUP $tree 2>/dev/null
gone_within {int(grace_s / 0.05)} && return 0
kill -KILL -- "-$p" 2>/dev/null; [ -z "$tree" ] || kill -KILL $tree 2>/dev/null
# SIGKILL takes effect soon, not at once: return when they are gone (bounded: a process in an
# uninterruptible wait goes only when that wait ends).
gone_within {int(KILL_WAIT_S / 0.05)}; return 0""")


def follow_log(cmd_dir: str, poll_s: float = 0.2) -> str:
    """Print the command's log and keep printing what is added until the command ends."""
    return script(f"""d={q(cmd_dir)}
if cmd_running "$d"; then
    # tail stops when this watcher does, after printing what was left.
    ( while cmd_running "$d"; do sleep {poll_s}; done ) &
    tail -n +1 -s {poll_s} --pid=$! -F "$d/log" 2>/dev/null
else
    cat "$d/log" 2>/dev/null
fi""")
