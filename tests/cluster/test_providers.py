"""A provider is one class in one module (docs/architecture.md, "Changing speedrun"): a toy
provider from the test tree (toy_provider.py), registered the way another package registers one
(an entry point in the `speedrun.providers` group), runs a job through the CLI with its own option,
check and environment. (That nothing else in speedrun names a provider: tests/test_layout.py.)"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from cli_run import speedrun

HERE = Path(__file__).resolve().parent


@pytest.fixture
def plugin_env(tmp_path) -> dict[str, str]:
    """The environment of a Python that sees toy_provider.py as an installed package's provider
    (a dist-info with its entry point), beside a package whose provider cannot be imported."""
    site = tmp_path / "site"
    for name, entry in (("toy-provider", "toy = toy_provider:ToyProvider"),
                        ("broken-provider", "broken = no_such_module:Provider")):
        info = site / f"{name.replace('-', '_')}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[speedrun.providers]\n{entry}\n")
    path = os.pathsep.join([str(site), str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


@pytest.mark.slow
def test_a_provider_from_one_module_runs_a_job_through_the_cli(plugin_env, job_name, tmp_path):
    def cli(*args: str):
        return speedrun(*args, env=plugin_env, timeout=300)

    usage = cli("launch", "--help").stdout
    assert "--toy-label" in usage and "toy" in usage.split("--provider {", 1)[1].split("}", 1)[0]

    script = tmp_path / "say.py"
    script.write_text("import os\nprint('label', os.environ['TOY_LABEL'], 'task', os.environ['SPEEDRUN_TASK'])\n")
    r = cli("launch", job_name, "--provider", "toy", "-n", "2", "--toy-label", "hello",
            "--run-root", str(tmp_path / "runs"), "--wait", "--", str(script))
    assert r.returncode == 0, r.stderr
    r = cli("ls", job_name)
    assert [line.split()[1:4] for line in r.stdout.splitlines()[1:3]] == [["0", "local", "succeeded"],
                                                                         ["1", "local", "succeeded"]]
    r = cli("logs", job_name)
    assert sorted(line for line in r.stdout.splitlines() if "label" in line) == [
        "[0] label hello task 0", "[1] label hello task 1"]
    r = cli("down", job_name)
    assert r.returncode == 0 and "its commands were stopped" in r.stdout, r.stderr
    assert cli("ls", job_name).returncode == 2  # forgotten

    # Its option check, and its option refused elsewhere by name: from the class alone.
    for args, line in (
        (["--provider", "toy", "--toy-label", "a-b"], "toy_label 'a-b': letters and digits only"),
        (["--toy-label", "x"], "toy_label does not apply to the local provider: it is an option of "
                               "provider='toy' (--provider toy)"),
        (["--provider", "broken"], "the provider plugin broken (no_such_module:Provider) cannot be loaded: "
                                   "ModuleNotFoundError: No module named 'no_such_module'"),
    ):
        r = cli("launch", f"{job_name}-bad", *args, "--run-root", str(tmp_path / "bad"), "--", str(script))
        assert (r.returncode, r.stderr) == (2, f"speedrun: error: {line}\n")
    assert not (tmp_path / "bad").exists()
