"""W&B offline for the tests: the settings that keep wandb on this machine, and its run files read
back with wandb's own reader (`wandb leet inspect --json`).

    env = wandb_env(tmp_path)                      # WANDB_MODE=offline, its folders in tmp_path
    [(run, config, history, exits)] = wandb_runs(run_dir)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def wandb_env(folder: Path, **more: str) -> dict[str, str]:
    """This process's environment with W&B offline, its settings and caches in `folder`, any
    address it might try on loopback (nothing is sent: offline), and its error reports (to W&B's
    telemetry service, a public address) off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    home = str(Path(folder) / "wandb-home")
    return {**env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_BASE_URL": "http://127.0.0.1:9",
            "WANDB_ERROR_REPORTING": "false", "WANDB_CONFIG_DIR": home, "WANDB_CACHE_DIR": home,
            "WANDB_DATA_DIR": home, **more}


def wandb_runs(run_dir: Path) -> list[tuple[dict, dict, dict, list]]:
    """Each offline run file in a run directory (RUN/trackers/wandb/offline-run-*), oldest first,
    read with wandb's own reader: (the run's record, its config, its history as {step: row}, its
    exit codes)."""
    runs = []
    for path in sorted((Path(run_dir) / "trackers" / "wandb").glob("offline-run-*/run-*.wandb")):
        r = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        records = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        run, config = {}, {}
        for x in records:
            if x["type"] == "run":  # it comes again when the run's tags change: the last one holds
                run.update(x["run"])
                config.update(x["run"].get("config", {}).get("update", {}))
            elif x["type"] == "config":
                config.update(x["config"].get("update", {}))
        history = {x["history"]["step"]["num"]: x["history"]["item"] for x in records if x["type"] == "history"}
        exits = [x["exit"].get("exit_code", 0) for x in records if x["type"] == "exit"]
        runs.append((run, config, history, exits))
    return runs


def wandb_series(history: dict, key: str) -> list[tuple[int, float]]:
    """(step, value) of `key` in a run's history, by step."""
    return [(step, row[key]) for step, row in sorted(history.items()) if key in row]
