"""train_runner.py (llama_runner/) on the lab: real nodes over SSH, through the API and the CLI.
The tests skip when the lab (inventory/lab.yml) is not up.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

# train_runner.py and llama_runner/ sit at the repository root, not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train_runner
from llama_runner.scaling import (
    pinned,
    ranked_nodes,
)
from train_runner import (
    DEFAULT_INVENTORY,
    EXIT_INTERRUPTED,
    EXIT_INVALID_INPUT,
    EXIT_OK,
    PROJECT_DIR,
    Cluster,
    InvalidInput,
    Phase,
    PlaybookFailed,
)

TRAIN_PLAYBOOK = PROJECT_DIR / "train.yml"
needs_train = pytest.mark.skipif(
    not TRAIN_PLAYBOOK.is_file(), reason="train.yml is not in this checkout yet"
)


from tests.support.runner import cli  # noqa: E402


# --------------------------------------------------------------------------------------------
# The lab: real nodes over SSH
# --------------------------------------------------------------------------------------------
@pytest.mark.lab
@needs_train
def test_lab_scaling_trains_the_plan_on_every_node_then_on_the_master_alone(
    provisioned: Cluster,
    lab_hosts: list[str],
    lab_ranks: dict[str, list[int]],
):
    nodes = len(lab_hosts)
    world = sum(len(r) for r in lab_ranks.values())  # the lab runs two processes per node
    master = len(lab_ranks[lab_hosts[0]])
    events: list[dict] = []
    progress: list[train_runner.TrainProgress] = []
    # Two watched runs through train(): a progress line every 2 s reaches both callbacks.
    scaling = provisioned.scaling(
        "tiny", steps=8, on_event=events.append, on_progress=progress.append, job_report_every=2
    )
    every, one = scaling.every.summary, scaling.one.summary
    assert any(e["event"] == "runner_retry" for e in events)
    assert progress
    # Each run's summary, brought back to the controller.
    for summary in (every, one):
        assert (summary.effective_batch_size or 0) > 0
        assert (summary.runtime_s or 0) > 0
        assert isinstance(summary.final_loss, float)
        assert summary.controller_dir is not None
        assert summary.controller_dir.is_dir()
        assert summary.controller_dir.name == summary.run_id
        assert summary.loss_plot is None or summary.loss_plot.is_file()
    assert (scaling.every.nodes, every.nnodes, every.world_size) == (nodes, nodes, world)
    assert (scaling.one.nodes, one.nnodes, one.world_size) == (1, 1, master)
    assert every.ranks == {h: tuple(r) for h, r in lab_ranks.items()}  # the summary names them
    assert one.run_id != every.run_id
    # The same plan: the runs differ in their node count alone.
    assert pinned(one) == pinned(every)
    assert one.last_step == every.last_step == 8
    assert (one.tokens_per_s or 0) > 0
    assert (every.tokens_per_s or 0) > 0
    assert scaling.speedup == pytest.approx(every.tokens_per_s / one.tokens_per_s)
    assert scaling.lines()[-1].startswith(f"Scaling: x{scaling.speedup:.2f} on {nodes} nodes")
    assert not list(DEFAULT_INVENTORY.parent.glob(".*.one-node.yml"))  # the copy is gone


@pytest.mark.lab
@needs_train
def test_lab_unknown_model_raises_invalid_input(lab: Cluster):
    with pytest.raises(InvalidInput) as caught:
        lab.train("no-such-model")
    assert caught.value.host == "localhost"
    assert caught.value.result is not None
    assert not any(h.startswith("llama-lab") for h in caught.value.result.hosts)


LONG_RUN = {"num_train_epochs": 2000, "save_steps": 100000}  # runs until stopped


def run_units(host: str, run_id: str) -> str:
    """The systemd units of a run that are still running on a lab node."""
    return subprocess.run(
        [
            "docker",
            "exec",
            host,
            "systemctl",
            "list-units",
            "--no-legend",
            "--plain",
            "--state=running",
            f"llama-{run_id}-*",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout


@pytest.mark.lab
@needs_train
def test_lab_killed_rank_raises_playbook_failed_naming_the_node(
    provisioned: Cluster, lab_hosts: list[str]
):
    victim = lab_hosts[-1]  # the last worker
    run_ids: list[str] = []
    killed = threading.Event()

    def kill_rank() -> None:
        subprocess.run(
            [
                "docker",
                "exec",
                victim,
                "systemctl",
                "kill",
                "--signal=KILL",
                f"llama-{run_ids[-1]}-*",
            ],
            check=False,
        )

    def on_event(event: dict) -> None:
        if provisioned.current_run_id and not run_ids:
            run_ids.append(provisioned.current_run_id)
        # Kill once rank 0 reports a training step (a report every 2 s): every rank is up by then.
        res = event["event_data"].get("res") or {}
        progress = train_runner.TrainProgress.from_result("", res)
        if progress and progress.step is not None and run_ids and not killed.is_set():
            killed.set()
            threading.Thread(target=kill_rank).start()

    watchdog = threading.Timer(900, provisioned.cancel)  # never let the long run go on
    watchdog.start()
    try:
        with pytest.raises(PlaybookFailed) as caught:
            provisioned.train("tiny", on_event=on_event, train_args=LONG_RUN, job_report_every=2)
    finally:
        watchdog.cancel()
    assert killed.is_set(), "the job finished before it could be killed"
    error = caught.value
    assert error.host == victim
    assert victim in error.failed_hosts
    assert victim in error.message
    assert error.result is not None
    assert error.result.run_id == run_ids[-1]
    for host in lab_hosts:
        assert run_units(host, run_ids[-1]) == "", host


def tutorial_ini(path: Path, inventory: Path, *extra: str) -> Path:
    """The lab as a tutorial's INI inventory: a [cluster] group of the nodes' addresses, the
    user and the key file (the lab's known_hosts standing in for the user's own); no master or
    workers group, and `extra` lines under [cluster:vars]."""
    document = yaml.safe_load(inventory.read_text())
    settings = document["all"]["vars"]
    hosts = ranked_nodes(inventory)
    hostvars = {
        host: vars_
        for group in ("master", "workers")
        for host, vars_ in (document["all"]["children"]["cluster"]["children"][group]["hosts"]
                            or {}).items()
    }  # fmt: skip
    lines = ["[cluster]", *(hostvars[h]["ansible_host"] for h in hosts), "", "[cluster:vars]"]
    lines += [
        f"ansible_user={settings['ansible_user']}",
        f"ansible_ssh_private_key_file={settings['ansible_ssh_private_key_file']}",
        "ansible_become=true",
        f"ansible_ssh_common_args='{settings['ansible_ssh_common_args']}'",
        *extra,
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.lab
@needs_train
def test_lab_cli_train_shows_progress_and_exits_0_then_2(provisioned: Cluster, tmp_path: Path):
    # Issue 39: the lab as a tutorial writes an inventory. Without saying the nodes train on
    # their CPUs it is refused naming the one setting that fixes it; with it (and the lab's two
    # processes per node), the first address is the master and the run trains.
    bare = tutorial_ini(tmp_path / "hosts.ini", DEFAULT_INVENTORY)
    refused = cli("-i", str(bare), "plan", "--model", "tiny")
    said = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode == EXIT_INVALID_INPUT, said[-3000:]
    assert "set cluster_accelerator=cpu for the cluster" in said, said[-3000:]
    ini = tutorial_ini(
        tmp_path / "hosts.ini", DEFAULT_INVENTORY, "cluster_accelerator=cpu", "nproc_per_node=2"
    )
    ok = cli("-i", str(ini), "train", "--model", "tiny")
    assert ok.returncode == EXIT_OK, ok.stdout[-3000:]
    assert "step " in ok.stdout
    assert "loss " in ok.stdout
    assert "training summary" in ok.stdout
    bad = cli("train", "--model", "no-such-model")
    assert bad.returncode == EXIT_INVALID_INPUT
    assert "no-such-model" in bad.stdout


LONG_TINY_RUN = {
    "train_args": {"num_train_epochs": 2000, "save_steps": 100000},
    "job_report_every": 2,
}


def _interrupted_at_the_first_step(argv: list[str], progress: str) -> tuple[int, str]:
    """Train the tiny model for long with `argv`, press Ctrl-C at the first progress line (one
    every 2 s; `progress` finds it); the exit status and the whole output. The run's settings go
    as one JSON -e, which ansible-playbook and train_runner.py both read as data. Ctrl-C as a
    terminal sends it: to the command's whole process group (ansible-playbook's workers and their
    ssh connections too; the main process alone could wait on a worker following the run)."""
    proc = subprocess.Popen(
        [*argv, "-e", json.dumps(LONG_TINY_RUN)],
        cwd=PROJECT_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "ANSIBLE_NOCOLOR": "1"}, process_group=0,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(progress, line):
            break
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=600)
    return proc.returncode, "".join(lines) + out


@pytest.mark.lab
@needs_train
def test_lab_cli_ctrl_c_stops_every_rank(provisioned: Cluster, lab_hosts: list[str]):
    code, out = _interrupted_at_the_first_step(
        [sys.executable, "train_runner.py", "train", "--model", "tiny"], " step "
    )
    assert code == EXIT_INTERRUPTED, out[-3000:]
    assert "stopped on every node" in out, out[-3000:]
    run_id = re.search(r"run (train-\S+) was interrupted", out)
    assert run_id, out[-3000:]
    for host in lab_hosts:
        assert run_units(host, run_id.group(1)) == "", host


@pytest.mark.lab
@needs_train
def test_lab_ctrl_c_on_ansible_playbook_leaves_the_run_going_and_says_how_to_stop_it(
    provisioned: Cluster, lab_hosts: list[str]
):
    # train_runner.py stops every rank on Ctrl-C (above); a plain ansible-playbook train.yml
    # cannot do so reliably (its workers are interrupted with it): the run goes on, and the
    # play's last line says so, with the commands that follow and stop it (docs/faults.md).
    playbook = str(Path(sys.executable).with_name("ansible-playbook"))
    code, out = _interrupted_at_the_first_step(
        [playbook, "train.yml", "-e", "model=tiny"], r"^\[\S+\] step \d+/"
    )
    assert code == 99, out[-3000:]  # ansible-playbook's "User interrupted execution"
    note = re.search(r"^Run (train-\S+) goes on on every node: Ctrl-C stopped this play", out, re.M)
    assert note, out[-3000:]
    run_id = note.group(1)
    assert out.rstrip().endswith(
        f"stop it: ansible-playbook playbooks/stop.yml -e run_id={run_id}."
    ), out[-3000:]
    try:
        for host in lab_hosts:
            assert run_units(host, run_id) != "", f"{host}: the run did not go on"
    finally:
        stopped = cli("stop", "--run-id", run_id, timeout=600)
    assert stopped.returncode == EXIT_OK, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    for host in lab_hosts:
        assert run_units(host, run_id) == "", host


@pytest.mark.lab
@needs_train
def test_lab_detached_run_is_followed_by_status_and_attach(provisioned: Cluster):
    started = provisioned.train("tiny", detach=True, train_args={"logging_steps": 5})
    run_id = started.run_id
    assert run_id
    assert started.summary is None
    progress: list[train_runner.TrainProgress] = []
    result = provisioned.attach(run_id, poll_s=5, on_progress=progress.append)
    assert result.run_id == run_id
    assert result.job is not None
    assert (result.job.job, result.job.phase) == (run_id, Phase.SUCCEEDED)
    assert progress
    assert progress[-1].step is not None
    assert progress[-1].step == progress[-1].total_steps
    summary = result.summary
    assert summary is not None
    assert summary.run_id == run_id
    assert isinstance(summary.final_loss, float)
    assert summary.controller_dir is not None
    assert (summary.controller_dir / "trainer_log.jsonl").is_file()
    status = cli("--json", "status", "--run-id", run_id, timeout=300)
    assert status.returncode == EXIT_OK, status.stderr[-3000:]
    assert '"phase": "succeeded"' in status.stdout
