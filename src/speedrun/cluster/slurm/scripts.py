"""What speedrun gives Slurm for a job: the batch script (`batch_script`) and the script each node's
task runs (`node_script`), both written to `<run_dir>/slurm/` on the shared file system.

    <run_dir>/slurm/
        job.sbatch          the batch script: sbatch's options, then what runs on the first node
        node.sh             what `srun` runs once per node: that node's torchrun
        <name>.command.sh   the command, torchrun and all (the first start)
        <name>.resume.sh    the same with --resume (a requeued start, once a checkpoint exists)
        slurm-<jobid>.out   the batch script's own output
        requeued            between a requeue and the next start: when, what kind and why
        nodes               the last start's nodes (for the next start: was one lost?)
        output_size         where the last start's part of slurm-<jobid>.out begins
        <name>/             a one-node command of its own (command_script: tune's trials), a
                            one-off step (step_script: check's) or a job array (array_script: ablate's)

Each start of the job (the first and every requeue) gives each task a fresh numbered command
directory, `<run_dir>/task-<i>/cmds/<NNNNNN>-<name>/` (command.sh, node, log, status), as the
other providers' tmux windows do, so `ls`, `logs`, `compare` and the trainer's files work alike.

How a start ends (the batch script decides, on the first node):
- the run is complete (results.json: finished or target_reached), or the command succeeded: done;
- Slurm's warning signal came (the time limit is near, `--signal=B:USR1@lead`): the run is asked to
  stop at a step (the run directory's `stop` file: every rank stops after the same step, with a
  checkpoint), and the job requeues itself;
- the run stopped with a checkpoint, or failed after one (a node or a peer lost): requeued too;
- otherwise (a failure before any checkpoint: most likely the command itself) the job fails.
A requeued start resumes from the checkpoint and first appends what happened to recoveries.jsonl
(which the trainer copies into results.json): when the job was requeued (`at`) and warned
(`warned_at`, null for none), what kind of requeue it was (`kind`: time_limit, stopped or failed
when speedrun requeued it; preemption or requeue as slurmstepd's line in the job's output says;
node_failure when a node of the last start is down now, named in `reason`), why, and how long
Slurm took to start it again (`relaunch_s`, from the requeue to this start; null when Slurm
itself requeued it). At most `max_requeues` starts after the first.
"""
from __future__ import annotations

import shlex

from speedrun.cluster.job import interface_script
from speedrun.cluster.slurm.config import SlurmConfig
from speedrun.cluster.slurm.queue import LOST_STATES
from speedrun.cluster.tmux import SEQ_DIGITS
from speedrun.errors import EXIT_RESUMABLE

COMPLETE = ("finished", "target_reached")  # results.json statuses of a run with nothing left to train


def q(value: object) -> str:
    return shlex.quote(str(value))


# Batch script lines (bash, $python set) that name the first node's address and a free port there:
# every node's torchrun meets the others at SPEEDRUN_MASTER_ADDR:SPEEDRUN_MASTER_PORT.
RENDEZVOUS = """head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export SPEEDRUN_MASTER_ADDR=$(scontrol show node "$head" | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')
free_port='import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
export SPEEDRUN_MASTER_PORT=$("$python" -c "$free_port")
"""


# Bash lines waiting for the background command just started ($!) until it has ended, whatever
# signals this script traps meanwhile (each interrupts `wait`); its exit status is then in $s.
WAIT_FOR_COMMAND = """while :; do
    wait $!; s=$?
    kill -0 $! 2>/dev/null || break
done
"""


def exports(env: dict[str, str]) -> str:
    """Bash lines exporting `env`, quoted."""
    return "".join(f"export {k}={q(v)}\n" for k, v in env.items())


def node_environment(*, job: str, nodes: int, run_dir: str) -> str:
    """Node script lines exporting what a task's command gets: the interface that reaches the first
    node (for gloo and NCCL) and speedrun's variables."""
    test = f'[ {nodes} -gt 1 ] && [ -n "$dev" ] && [ "$dev" != lo ]'
    return f"""{interface_script('"$SPEEDRUN_MASTER_ADDR"')}if {test}; then
    # gloo and NCCL bind to the address the host name resolves to: name the one that reaches task 0.
    export GLOO_SOCKET_IFNAME="$dev" NCCL_SOCKET_IFNAME="$dev"
fi
export SPEEDRUN_JOB={q(job)} SPEEDRUN_RUN_DIR={q(run_dir)} SPEEDRUN_TASK="$SLURM_NODEID" SPEEDRUN_NUM_TASKS={nodes}
export SPEEDRUN_PROVIDER=slurm
export PYTHONUNBUFFERED=1
"""


def batch_script(*, job: str, name: str, nodes: int, run_dir: str, cwd: str, config: SlurmConfig,
                 python: str) -> str:
    """The batch script for job `job`'s command `name` on `nodes` nodes (see the module's text)."""
    options = [f"--job-name={job}", f"--nodes={nodes}", "--ntasks-per-node=1", f"--chdir={cwd}",
               f"--output={run_dir}/slurm/slurm-%j.out", "--open-mode=append", "--requeue",
               f"--signal=B:USR1@{config.signal_lead_s}", *config.sbatch_options()]
    header = "".join(f"#SBATCH {o}\n" for o in options)
    return f"""#!/bin/bash
{header}# Written by speedrun for job {job}: one torchrun per node, requeued with --resume when Slurm warns
# that the time limit is near or the run stopped or failed with a checkpoint (docs/slurm.md).
run_dir={q(run_dir)}
slurm_dir="$run_dir/slurm"
python={q(python)}
max_requeues={config.max_requeues}
restarts=${{SLURM_RESTART_COUNT:-0}}
output="$slurm_dir/slurm-$SLURM_JOB_ID.out"
say() {{ printf 'speedrun: %s\\n' "$*"; }}
now() {{ date +%s.%N; }}
rm -f "$run_dir/stop"  # a request the last start did not get to handle
# Slurm's warning may come at any moment of a start, before the run has started too (a limit already
# near when the job starts): bash's default for USR1 is to die, so the trap comes before anything
# else runs. The run, once started, sees the stop file and stops after its first step.
warned=
warn() {{
    warned=$(now)
    say "Slurm warns that the time limit is near: asking the run to stop at a step"
    touch "$run_dir/stop"
}}
trap warn USR1
run_status() {{  # results.json's status (empty without one)
    "$python" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("status", ""))' \\
        "$run_dir/results.json" 2>/dev/null
}}
checkpoint() {{ [ -e "$run_dir/checkpoint.pt" ]; }}

case "$(run_status)" in {'|'.join(COMPLETE)})
    say "the run in $run_dir is complete: nothing to start again"; exit 0;;
esac
if [ "$restarts" -gt "$max_requeues" ]; then
    say "Slurm started this job $restarts times after the first, more than max_requeues ($max_requeues): giving up"
    exit 3
fi
lost_nodes() {{  # the last start's nodes that Slurm now says are down or failing: "node2 (DOWN+NOT_RESPONDING)"
    [ -s "$slurm_dir/nodes" ] || return 0
    scontrol show node -o "$(cat "$slurm_dir/nodes")" 2>/dev/null | grep -E '{LOST_STATES}' |
        sed -E 's/^NodeName=([^ ]+).* State=([^ ]+).*/\\1 (\\2)/' | paste -sd, - | sed 's/,/, /g'
}}
slurm_said() {{  # why slurmstepd ended the last start, in the output since: "*** JOB 7 ... DUE TO PREEMPTION ***"
    tail -c +"$(( $(cat "$slurm_dir/output_size" 2>/dev/null || echo 0) + 1 ))" "$output" 2>/dev/null |
        grep -oE 'DUE TO [A-Z ]*[A-Z]' | tail -n 1
}}
if [ "$restarts" -gt 0 ]; then
    # What requeued it: speedrun (its note says when, what kind and why), or Slurm: slurmstepd's
    # line says preemption or a requeue; a node of the last start that is down now, a node failure.
    at=null; warned_at=null; relaunch=null; kind=requeue
    why="Slurm requeued the job"
    if [ -s "$slurm_dir/requeued" ]; then
        read -r at warned_at kind why < "$slurm_dir/requeued"
        relaunch=$(awk -v a="$at" -v b="$(now)" 'BEGIN {{ printf "%.3f", b - a }}')
    else
        case "$(slurm_said)" in
            *PREEMPTION) kind=preemption; why="Slurm preempted the job (requeued)";;
            *"JOB REQUEUE") why="requeued (scontrol requeue, by hand or by an administrator)";;
            *"NODE FAILURE") kind=node_failure; why="Slurm requeued the job after a node failure";;
        esac
    fi
    lost=$(lost_nodes)
    if [ -n "$lost" ]; then
        kind=node_failure; why="node(s) lost: $lost; $why"
    fi
    resumed=false; checkpoint && resumed=true
    fields='"at": %s, "kind": "%s", "reason": "%s", "replaced": {{}}, "resumed": %s, "relaunch_s": %s'
    printf "{{$fields, \\"price_per_hour\\": null, \\"slurm_job\\": %s, \\"requeue\\": %s, \\"warned_at\\": %s}}\\n" \\
        "$at" "$kind" "$why" "$resumed" "$relaunch" "$SLURM_JOB_ID" "$restarts" "$warned_at" \\
        >> "$run_dir/recoveries.jsonl"
    rm -f "$slurm_dir/requeued"
    say "start $restarts after a requeue ($why)"
fi
# What the next start looks at to say why it came: this start's nodes and where its output begins.
echo "$SLURM_JOB_NODELIST" > "$slurm_dir/nodes"
stat -c %s "$output" > "$slurm_dir/output_size" 2>/dev/null

{RENDEZVOUS}export SPEEDRUN_RESUME=; checkpoint && SPEEDRUN_RESUME=1

srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash "$slurm_dir/node.sh" &
step=$!
# Slurm ends a start (a node failure, a requeue, scancel) by signalling this script's processes; srun
# then cancels its step and waits for it up to KillWait + 2 s. It must not outlive this script: where
# nothing else kills it (proctrack/linuxproc loses an orphan), it would cancel the step of the next
# start, which has the same id (<job>.0), half a minute into it.
trap 'kill -KILL "$step" 2>/dev/null; exit 143' TERM
while :; do  # a trapped signal ends `wait` early: wait again until the step has ended
    wait "$step"; s=$?
    kill -0 "$step" 2>/dev/null || break
done

status=$(run_status)
case "$status" in {'|'.join(COMPLETE)}) say "the run is complete ($status)"; exit 0;; esac
[ "$s" = 0 ] && exit 0
if [ -n "$warned" ]; then kind=time_limit; why="the time limit was near (Slurm's warning signal): stopped at a step"
elif [ "$status" = stopped ]; then kind=stopped; why="the run stopped at a step"
else kind=failed; why="the step failed (exit $s)"
fi
if [ "$restarts" -lt "$max_requeues" ] && {{ [ -n "$warned" ] || [ "$status" = stopped ] || checkpoint; }}; then
    printf '%s %s %s %s\\n' "$(now)" "${{warned:-null}}" "$kind" "$why" > "$slurm_dir/requeued"
    say "$why; requeueing ($((restarts + 1)) of at most $max_requeues), to resume from the checkpoint"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
    say "scontrol requeue failed: the job ends here"
    rm -f "$slurm_dir/requeued"
elif [ "$restarts" -ge "$max_requeues" ]; then
    say "$why; not requeued: $restarts requeue(s) made, max_requeues is $max_requeues"
else
    say "$why; not requeued: no checkpoint to resume from"
fi
exit "$s"
"""


def node_script(*, job: str, name: str, nodes: int, run_dir: str, env: dict[str, str], python: str = "python3") -> str:
    """What each node's task runs: a fresh command directory for the task (SLURM_NODEID), the
    command's text (`<name>.resume.sh` when the start resumes), and the command with its output
    in `log` and its exit status in `status`. A run that stopped at a step (results.json, written
    during this command, says `stopped`) is exit 75 with "stopped at step N" as the log's last
    line on every node, whatever torchrun made of it: its agent reports workers that exit 75, or a
    signal it was sent itself (a requeue, preemption), as its own failure, exit 1."""
    environment = node_environment(job=job, nodes=nodes, run_dir=run_dir) + exports(env)
    pattern = "[0-9]" * SEQ_DIGITS
    return f"""#!/bin/bash
# Written by speedrun for job {job}: runs one node's command in a numbered directory of its task.
run_dir={q(run_dir)}
i=$SLURM_NODEID
base="$run_dir/task-$i/cmds"
mkdir -p "$base" || exit 3
n=1
for f in "$base"/{pattern}-*; do
    [ -d "$f" ] || continue
    b=${{f##*/}}; b=$((10#${{b%%-*}}))
    [ "$b" -ge "$n" ] && n=$((b + 1))
done
while :; do
    printf -v d '%s/%0{SEQ_DIGITS}d-%s' "$base" "$n" {q(name)}
    mkdir "$d" 2>/dev/null && break
    n=$((n + 1))
done
text="$run_dir/slurm/"{q(name)}.command.sh
[ -n "${{SPEEDRUN_RESUME:-}}" ] && text="$run_dir/slurm/"{q(name)}.resume.sh
cp "$text" "$d/command.sh"
echo "${{SLURMD_NODENAME:-$(hostname)}}" > "$d/node"
{environment}# Slurm signals every process of the step (scancel, a requeue, preemption): the command acts on it
# (a run stops at a step); this script and tee wait for it to end, so that its last lines reach the
# log and its exit status is the command's. (A trap, not an ignored signal: the command must get
# the signals' default handling.)
trap : TERM INT HUP
set -o pipefail
bash "$d/command.sh" 2>&1 | (trap '' TERM INT HUP; exec tee -a "$d/log") &
{WAIT_FOR_COMMAND}if [ "$s" != 0 ] && [ "$run_dir/results.json" -nt "$d/command.sh" ]; then
    step=$({q(python)} -c 'import json, sys; r = json.load(open(sys.argv[1]))
print(r["steps"] if r.get("status") == "stopped" else "")' "$run_dir/results.json" 2>/dev/null)
    if [ -n "$step" ]; then
        echo "stopped at step $step: the run's checkpoint holds it (the command's own exit status was $s)" >> "$d/log"
        s={EXIT_RESUMABLE}
    fi
fi
echo "$s" > "$d/status"
exit "$s"
"""


def command_text(*, python: str, nodes: int, nproc_per_node: int, join_timeout_s: int, command: str) -> str:
    """A node's command: torchrun (its node rank and rendezvous from the batch script's variables)
    followed by `command`, shell text."""
    return (f"exec {python} -m torch.distributed.run --nnodes={nodes} --node-rank=\"$SLURM_NODEID\" "
            f"--nproc-per-node={nproc_per_node} --master-addr=\"$SPEEDRUN_MASTER_ADDR\" "
            f"--master-port=\"$SPEEDRUN_MASTER_PORT\" --rdzv-conf=timeout={join_timeout_s} {command}\n")


def array_script(*, job: str, name: str, count: int, limit: int, run_dir: str, cwd: str, config: SlurmConfig) -> str:
    """A job array of `count` independent commands, at most `limit` at once, one node each:
    element k runs `<run_dir>/slurm/<name>/<k>.sh` in `cwd`. Requeued (preempted, a node lost), an
    element runs its command again from the top: commands that resume (ablate's do) lose nothing."""
    options = [f"--job-name={job}-{name}", f"--array=0-{count - 1}%{limit}", "--nodes=1", "--ntasks=1",
               f"--chdir={cwd}", f"--output={run_dir}/slurm/{name}/%a.out", "--open-mode=append", "--requeue",
               *config.sbatch_options()]
    header = "".join(f"#SBATCH {o}\n" for o in options)
    return f"""#!/bin/bash
{header}# Written by speedrun for job {job}: one of {count} independent commands ({name}), by array index.
exec bash {q(run_dir)}/slurm/{q(name)}/"$SLURM_ARRAY_TASK_ID".sh
"""


def command_script(*, job: str, name: str, task: int, nodes: int, run_dir: str, cwd: str, config: SlurmConfig,
                   env: dict[str, str]) -> str:
    """A batch script running one command on one node in `cwd`, in place of task `task` of job
    `job` (`speedrun tune`'s trials: SlurmJob.start_command), never requeued. Its folder
    `<run_dir>/slurm/<name>/` holds the command (command.sh), its output (log), the node it ran on
    (node) and, once it has ended, its exit status (status)."""
    folder = f"{run_dir}/slurm/{name}"
    options = [f"--job-name={job}-{name}", "--nodes=1", "--ntasks=1", f"--chdir={cwd}", f"--output={folder}/log",
               "--no-requeue", *config.sbatch_options()]
    header = "".join(f"#SBATCH {o}\n" for o in options)
    return f"""#!/bin/bash
{header}# Written by speedrun for job {job}: {name}, one command on one node, as task {task}.
export SPEEDRUN_JOB={q(job)} SPEEDRUN_RUN_DIR={q(run_dir)} SPEEDRUN_TASK={task} SPEEDRUN_NUM_TASKS={nodes}
export SPEEDRUN_PROVIDER=slurm
export PYTHONUNBUFFERED=1
{exports(env)}echo "${{SLURMD_NODENAME:-$(hostname)}}" > {q(folder)}/node
# scancel signals every process of the job: the command acts on it (a run stops at a step) and this
# script waits for it to end, so that its exit status is written.
trap : TERM INT HUP
bash {q(folder)}/command.sh &
{WAIT_FOR_COMMAND}echo "$s" > {q(folder)}/status
"""


def step_script(*, job: str, name: str, nodes: int, run_dir: str, cwd: str, config: SlurmConfig, python: str,
                nproc_per_node: int, join_timeout_s: int, command: str) -> str:
    """A batch script running `command` once under one torchrun per node, beside the job's own
    Slurm job (never requeued): `speedrun check`'s. Its folder `<run_dir>/slurm/<name>/` gets the
    output (slurm-<jobid>.out, lines labelled by node) and `status`, the step's exit status."""
    folder = f"{run_dir}/slurm/{name}"
    options = [f"--job-name={job}-{name}", f"--nodes={nodes}", "--ntasks-per-node=1", f"--chdir={cwd}",
               f"--output={folder}/slurm-%j.out", "--no-requeue", *config.sbatch_options()]
    header = "".join(f"#SBATCH {o}\n" for o in options)
    node = (node_environment(job=job, nodes=nodes, run_dir=run_dir) +
            command_text(python=python, nodes=nodes, nproc_per_node=nproc_per_node, join_timeout_s=join_timeout_s,
                         command=command))
    return f"""#!/bin/bash
{header}# Written by speedrun for job {job}: {name}, once, one torchrun per node.
python={q(python)}
{RENDEZVOUS}srun --ntasks-per-node=1 --label bash -c {q(node)}
echo $? > {q(folder)}/status
"""
