"""train_runner.py (llama_runner/): real ansible-runner runs of real playbooks, no mocks.

The fast tests run playbooks on localhost (the project's own where one exists, else a few lines
written here for the behaviour under test). The tests marked `lab` drive the lab cluster
(inventory/lab.yml) through the API and the CLI; they skip when the lab is not up.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

# train_runner.py and llama_runner/ sit at the repository root, not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train_runner
from llama_runner.results import RunResult
from llama_runner.scaling import (
    MEASURE_ARGS,
    Point,
    Scaling,
    first_nodes,
    master_only,
    one_node_inventory,
    pinned,
    ranked_nodes,
)
from train_runner import (
    DEFAULT_INVENTORY,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_INVALID_INPUT,
    EXIT_OK,
    EXIT_UNREACHABLE,
    PROJECT_DIR,
    Cluster,
    FailureKind,
    HostUnreachable,
    InvalidInput,
    JobStatus,
    Phase,
    PlaybookFailed,
    RunInterrupted,
    TrainSummary,
)

TRAIN_PLAYBOOK = PROJECT_DIR / "train.yml"
needs_train = pytest.mark.skipif(
    not TRAIN_PLAYBOOK.is_file(), reason="train.yml is not in this checkout yet"
)


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------
@pytest.fixture
def local_inventory(tmp_path: Path) -> Path:
    """A cluster of one host, the controller itself (no SSH)."""
    path = tmp_path / "local.yml"
    path.write_text(
        "all:\n"
        "  children:\n"
        "    cluster:\n"
        "      children:\n"
        "        master:\n"
        "          hosts:\n"
        "            localhost:\n"
        "              ansible_connection: local\n"
        "              ansible_python_interpreter: '{{ ansible_playbook_python }}'\n"
    )
    return path


@pytest.fixture
def cluster(tmp_path: Path, local_inventory: Path) -> Cluster:
    return Cluster(local_inventory, private_data_dir=tmp_path / "runner", keep_artifacts=3)


def write_playbook(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def cli(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PROJECT_DIR / "train_runner.py"), *args],
        cwd=PROJECT_DIR,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# --------------------------------------------------------------------------------------------
# Fast: localhost only
# --------------------------------------------------------------------------------------------
def test_argument_spec_failure_raises_invalid_input_naming_host_and_task(cluster: Cluster):
    # playbooks/lab.yml validates lab_state with the role's argument spec before touching Docker.
    with pytest.raises(InvalidInput) as caught:
        cluster.run_playbook("playbooks/lab.yml", {"lab_state": "bogus"}, inventory=False)
    error = caught.value
    assert error.host == "localhost"
    assert "Validating arguments" in (error.task or "")
    assert "bogus" in error.message
    assert error.result is not None
    assert error.result.hosts["localhost"].failed == 1
    assert error.result.status == "failed"


@needs_train
def test_unknown_model_raises_invalid_input_from_the_validation_play(cluster: Cluster):
    with pytest.raises(InvalidInput) as caught:
        cluster.train("no-such-model")
    assert caught.value.host == "localhost"
    assert "no-such-model" in caught.value.message


def test_event_handler_keeps_every_event_and_passes_it_on(cluster: Cluster):
    seen: list[str] = []
    with pytest.raises(InvalidInput) as caught:
        cluster.run_playbook(
            "playbooks/lab.yml",
            {"lab_state": "bogus"},
            inventory=False,
            on_event=lambda event: seen.append(event["event"]),
        )
    result = caught.value.result
    assert result is not None
    assert seen == [event["event"] for event in result.events]
    assert next(name for name in seen if name != "verbose") == "playbook_on_start"
    assert "runner_on_failed" in seen
    assert seen[-1] == "playbook_on_stats"
    # ansible-runner writes an event only when the handler returned True.
    assert len(list((result.artifact_dir / "job_events").glob("*.json"))) == len(seen)


def test_artifacts_rotate_and_no_env_files_are_written(cluster: Cluster):
    idents = []
    for _ in range(5):
        with pytest.raises(InvalidInput) as caught:
            cluster.run_playbook("playbooks/lab.yml", {"lab_state": "bogus"}, inventory=False)
        assert caught.value.result is not None
        idents.append(caught.value.result.ident)
        time.sleep(0.05)  # rotation orders by mtime
    assert len(set(idents)) == 5
    kept = sorted(p.name for p in (cluster.private_data_dir / "artifacts").iterdir())
    assert kept == sorted(idents[-3:])
    assert not (cluster.private_data_dir / "env").exists()


def test_stale_env_files_are_refused(cluster: Cluster):
    (cluster.private_data_dir / "env").mkdir(parents=True)
    (cluster.private_data_dir / "env" / "extravars").write_text('{"lab_state": "absent"}')
    with pytest.raises(train_runner.RunnerError, match="env"):
        cluster.run_playbook("playbooks/lab.yml", {"lab_state": "bogus"}, inventory=False)


def test_set_stats_data_becomes_the_train_summary(cluster: Cluster, tmp_path: Path):
    # The shape train.yml ends with: set_stats data reaches the stats event's artifact_data.
    playbook = write_playbook(
        tmp_path,
        "summary.yml",
        """
- name: Summary
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Report the run
      ansible.builtin.set_stats:
        data:
          llama_run:
            run_id: train-20260101-000000-tiny
            world_size: 2
            effective_batch_size: 16
            runtime_s: 12.5
            final_loss: 1.25
            output_dir: /opt/llama-cluster/runs/train-20260101-000000-tiny/output
            checkpoints: [checkpoint-10, checkpoint-20]
            controller_dir: /tmp/runs/train-20260101-000000-tiny
            loss_plot: /tmp/runs/train-20260101-000000-tiny/training_loss.png
""",
    )
    result = cluster.run_playbook(playbook)
    assert result.ok
    assert result.rc == 0
    assert result.run_id == "train-20260101-000000-tiny"
    assert result.summary == TrainSummary(
        run_id="train-20260101-000000-tiny",
        world_size=2,
        effective_batch_size=16,
        runtime_s=12.5,
        final_loss=1.25,
        output_dir="/opt/llama-cluster/runs/train-20260101-000000-tiny/output",
        checkpoints=("checkpoint-10", "checkpoint-20"),
        controller_dir=Path("/tmp/runs/train-20260101-000000-tiny"),
        loss_plot=Path("/tmp/runs/train-20260101-000000-tiny/training_loss.png"),
    )
    assert result.hosts["localhost"].ok == 1


def test_the_run_id_is_the_llama_run_id_stat_as_soon_as_it_is_set(cluster: Cluster, tmp_path: Path):
    # train.yml names its run with set_stats llama_run_id right after the plan; other facts
    # that happen to hold a run_id are not the run's.
    playbook = write_playbook(
        tmp_path,
        "named.yml",
        """
- name: Named
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Name the run
      ansible.builtin.set_stats:
        data:
          llama_run_id: train-20260101-000000-tiny
        per_host: false
    - name: Set a fact that holds another run_id
      ansible.builtin.set_fact:
        other_plan:
          run_id: not-this-one
    - name: Carry on
      ansible.builtin.debug:
        msg: later
""",
    )
    seen: list[str | None] = []

    def on_event(event: dict) -> None:
        if event["event"] == "runner_on_start" and event["event_data"]["task"] == "Carry on":
            seen.append(cluster.current_run_id)

    result = cluster.run_playbook(playbook, on_event=on_event)
    assert seen == ["train-20260101-000000-tiny"]
    assert result.run_id == "train-20260101-000000-tiny"
    assert result.data == {"llama_run_id": "train-20260101-000000-tiny"}
    assert result.summary is None
    assert result.hosts["localhost"].ok == 3


@needs_train
def test_plan_is_train_yml_in_check_mode_its_lines_and_no_run(tmp_path: Path):
    # One CPU node, the controller itself: the tiny model's plan, through the API and the CLI.
    inventory = tmp_path / "cpu.yml"
    inventory.write_text(
        "all:\n  children:\n    cluster:\n      children:\n        master:\n          hosts:\n"
        "            localhost:\n              ansible_connection: local\n"
        "              ansible_python_interpreter: '{{ ansible_playbook_python }}'\n"
        "              cluster_accelerator: cpu\n              nproc_per_node: 1\n"
    )
    runs = tmp_path / "runs"
    cluster = Cluster(inventory, private_data_dir=tmp_path / "runner")
    result = cluster.plan("tiny", controller_runs_dir=str(runs))
    assert result.ok
    assert "--check" in json.loads((result.artifact_dir / "command").read_text())["command"]
    assert any(
        line.startswith("Plan only (--check, no run started): tiny (") for line in result.plan
    )
    assert "DeepSpeed: none (chosen by the rule" in "\n".join(result.plan)
    # Nothing started: no run id published or claimed, no run directory.
    assert (result.run_id, result.summary, result.controller_dir) == (None, None, None)
    assert set(result.data) == {"llama_plan"}
    assert not runs.exists()
    # A request train() refuses is refused here the same way.
    with pytest.raises(InvalidInput) as caught:
        cluster.plan("tiny", deepspeed="zero4")
    assert 'Unknown deepspeed="zero4"' in caught.value.message
    shown = cli(
        *("--private-data-dir", str(tmp_path / "runner"), "-i", str(inventory)),
        *("plan", "--model", "tiny", "-e", f"controller_runs_dir={runs}"),
    )
    assert shown.returncode == EXIT_OK, shown.stdout[-2000:]
    assert "plan only (--check): nothing was changed" in shown.stdout
    assert "Plan only (--check, no run started): tiny" in " ".join(shown.stdout.split())
    assert not runs.exists()


def test_failed_task_raises_playbook_failed_naming_host_task_and_message(
    cluster: Cluster, tmp_path: Path
):
    playbook = write_playbook(
        tmp_path,
        "fail.yml",
        """
- name: Break
  hosts: cluster
  gather_facts: false
  tasks:
    - name: Run a command that fails
      ansible.builtin.command: sh -c 'echo the disk is full >&2; exit 3'
      changed_when: false
""",
    )
    with pytest.raises(PlaybookFailed) as caught:
        cluster.run_playbook(playbook)
    error = caught.value
    assert type(error) is PlaybookFailed
    assert error.host == "localhost"
    assert error.task == "Run a command that fails"
    assert "the disk is full" in error.message
    assert "localhost" in str(error)
    assert "Run a command that fails" in str(error)


def test_unreachable_host_raises_host_unreachable(tmp_path: Path):
    inventory = tmp_path / "ghost.yml"
    inventory.write_text(
        "all:\n  hosts:\n    ghost-node:\n      ansible_host: 127.0.0.1\n      ansible_port: 1\n"
    )
    playbook = write_playbook(
        tmp_path,
        "ping.yml",
        "- name: Ping\n  hosts: all\n  gather_facts: false\n  tasks:\n"
        "    - name: Reach the node\n      ansible.builtin.ping:\n",
    )
    cluster = Cluster(inventory, private_data_dir=tmp_path / "runner")
    with pytest.raises(HostUnreachable) as caught:
        cluster.run_playbook(playbook)
    assert caught.value.host == "ghost-node"
    assert caught.value.task == "Reach the node"
    assert caught.value.result is not None
    assert caught.value.result.hosts["ghost-node"].unreachable == 1


def test_cancel_interrupts_a_running_playbook_and_kills_its_processes(
    cluster: Cluster, tmp_path: Path
):
    marker = "983.25"  # an unusual sleep argument to find the process by
    playbook = write_playbook(
        tmp_path,
        "slow.yml",
        f"""
- name: Slow
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Wait a long time
      ansible.builtin.command: sleep {marker}
      changed_when: false
""",
    )

    def on_event(event: dict) -> None:
        if event["event"] == "runner_on_start":
            threading.Timer(1.0, cluster.cancel).start()

    started = time.monotonic()
    with pytest.raises(RunInterrupted) as caught:
        cluster.run_playbook(playbook, on_event=on_event)
    assert time.monotonic() - started < 30
    assert caught.value.result is not None
    assert caught.value.result.status == "canceled"
    assert caught.value.stopped is False
    time.sleep(0.5)
    leftovers = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, check=False)
    assert leftovers.returncode == 1, leftovers.stdout


def test_an_on_event_error_cancels_the_run_and_is_raised(cluster: Cluster):
    def on_event(event: dict) -> None:
        if event["event"] == "playbook_on_play_start":
            raise RuntimeError("consumer broke")

    with pytest.raises(RuntimeError, match="consumer broke"):
        cluster.run_playbook(
            "playbooks/lab.yml", {"lab_state": "bogus"}, inventory=False, on_event=on_event
        )


def test_missing_inventory_is_invalid_input(tmp_path: Path):
    cluster = Cluster(tmp_path / "nowhere.yml", private_data_dir=tmp_path / "runner")
    with pytest.raises(InvalidInput, match=r"nowhere\.yml"):
        cluster.provision()


def test_progress_reads_the_leading_ranks_trainer_log_record():
    progress = train_runner.TrainProgress.from_result(
        "node1",
        {
            "progress": "step 3/10",
            "lead": {
                "phase": "running",
                "progress": {
                    "current_steps": 3,
                    "total_steps": 10,
                    "loss": 2.5,
                    "elapsed_time": "0:01:02",
                    "remaining_time": "0:02:30",
                    "throughput": 120.0,
                },
            },
        },
    )
    assert progress is not None
    assert (progress.step, progress.elapsed_s, progress.remaining_s) == (3, 62, 150)
    assert (progress.text, progress.tokens_per_s) == ("step 3/10", 120.0)
    assert progress.fraction == pytest.approx(0.3)
    assert train_runner.TrainProgress.from_result("node1", {"msg": "no progress"}) is None
    assert train_runner.TrainProgress.from_result("node1", {"progress": "x", "lead": None}) is None


def test_status_returns_the_job_status_that_status_yml_publishes(cluster: Cluster):
    playbook = cluster.project_dir / ".runner-test-status.yml"
    published = {
        "job": "train-a",
        "phase": "running",
        "progress": {"current_steps": 3, "total_steps": 10, "loss": 1.5},
        "nodes": {"node1": {"phase": "running"}, "node2": {"phase": "waiting"}},
    }
    playbook.write_text(
        "- name: Status | Publish\n  hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - name: Status | Hand the run's status to ansible-runner\n"
        "      ansible.builtin.set_stats:\n"
        f"        data: {{llama_status: {json.dumps(published)}}}\n"
        "        per_host: false\n"
    )
    try:
        result = cluster.run_playbook(playbook.name, {}, inventory=False)
    finally:
        playbook.unlink()
    job = JobStatus.from_dict(result.data["llama_status"])
    assert (job.job, job.phase, job.step, job.total_steps) == ("train-a", Phase.RUNNING, 3, 10)
    assert job.nodes["node2"].phase is Phase.WAITING
    assert job.phase.in_progress()


# ---- the CLI -------------------------------------------------------------------------------
def test_cli_exits_2_on_bad_input(tmp_path: Path):
    runner_dir = ("--private-data-dir", str(tmp_path / "runner"))
    missing = cli(*runner_dir, "--inventory", str(tmp_path / "nowhere.yml"), "provision")
    assert missing.returncode == EXIT_INVALID_INPUT
    assert "does not exist" in missing.stdout
    bad_value = cli("lab", "--nodes", "0")
    assert bad_value.returncode == EXIT_INVALID_INPUT
    too_short = cli(*runner_dir, "scaling", "--model", "tiny", "--steps", "1")
    assert too_short.returncode == EXIT_INVALID_INPUT
    assert "steps must be at least 2" in too_short.stdout
    local = tmp_path / "local.yml"
    local.write_text("all:\n  hosts:\n    localhost:\n      ansible_connection: local\n")
    bad_spec = cli(
        *runner_dir, "--inventory", str(local), "run", "playbooks/lab.yml", "-e", "lab_state=bogus"
    )
    assert bad_spec.returncode == EXIT_INVALID_INPUT
    assert "localhost" in bad_spec.stdout


def test_cli_exits_0_1_and_3_and_reports_json(tmp_path: Path, local_inventory: Path):
    ok = write_playbook(
        tmp_path,
        "ok.yml",
        "- name: Fine\n  hosts: cluster\n  gather_facts: false\n  tasks:\n"
        "    - name: Reach the node\n      ansible.builtin.ping:\n",
    )
    fail = write_playbook(
        tmp_path,
        "fail.yml",
        "- name: Break\n  hosts: cluster\n  gather_facts: false\n  tasks:\n"
        "    - name: Fail on purpose\n      ansible.builtin.fail:\n"
        "        msg: broken on purpose\n",
    )
    ghost = tmp_path / "ghost.yml"
    ghost.write_text(
        "all:\n  children:\n    cluster:\n      hosts:\n        ghost-node:\n"
        "          ansible_host: 127.0.0.1\n          ansible_port: 1\n"
    )

    runner_dir = ("--private-data-dir", str(tmp_path / "runner"))
    succeeded = cli(*runner_dir, "--json", "-i", str(local_inventory), "run", str(ok))
    assert succeeded.returncode == EXIT_OK, succeeded.stderr
    assert '"status": "successful"' in succeeded.stdout
    assert "PLAY Fine" in succeeded.stderr

    failed = cli(*runner_dir, "-i", str(local_inventory), "run", str(fail))
    assert failed.returncode == EXIT_FAILED
    assert "broken on purpose" in failed.stdout
    assert "Fail on purpose" in failed.stdout

    unreachable = cli(*runner_dir, "-i", str(ghost), "run", str(ok))
    assert unreachable.returncode == EXIT_UNREACHABLE
    assert "ghost-node" in unreachable.stdout


def test_cli_ctrl_c_exits_130(tmp_path: Path, local_inventory: Path):
    sleep = f"sleep {os.getpid() % 1000 + 1000}.25"  # this test's own, to find it and to end it
    playbook = write_playbook(
        tmp_path,
        "slow.yml",
        "- name: Slow\n  hosts: cluster\n  gather_facts: false\n  tasks:\n"
        f"    - name: Wait\n      ansible.builtin.command: {sleep}\n"
        "      changed_when: false\n",
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "train_runner.py",
            "--private-data-dir",
            str(tmp_path / "runner"),
            "-i",
            str(local_inventory),
            "run",
            str(playbook),
        ],
        cwd=PROJECT_DIR,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # Interrupt once the play runs its task, however long start-up takes on a busy machine.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            found = subprocess.run(["pgrep", "-f", sleep], capture_output=True, check=False)
            if found.returncode == 0:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        subprocess.run(["pkill", "-f", sleep], check=False)
    assert proc.returncode == EXIT_INTERRUPTED, out
    assert "INTERRUPTED" in out


# --------------------------------------------------------------------------------------------
# scaling: the plan on every node, then on the master alone
# --------------------------------------------------------------------------------------------
THREE_NODES = """\
all:
  vars:
    ansible_user: debian
  children:
    cluster:
      vars:
        nproc_per_node: 1
      children:
        master:
          hosts:
            node1:
              ansible_host: 10.0.0.1
        workers:
          hosts:
            node2:
            node3:
              ansible_host: 10.0.0.3
"""


def test_one_node_inventory_keeps_the_master_its_groups_and_their_variables():
    document = yaml.safe_load(THREE_NODES)
    pruned, master = one_node_inventory(document, "hosts.yml")
    assert master == "node1"
    cluster = pruned["all"]["children"]["cluster"]
    assert cluster["vars"] == {"nproc_per_node": 1}
    assert cluster["children"]["master"]["hosts"] == {"node1": {"ansible_host": "10.0.0.1"}}
    assert cluster["children"]["workers"]["hosts"] == {}
    assert pruned["all"]["vars"] == {"ansible_user": "debian"}
    assert yaml.safe_load(THREE_NODES) == document  # the user's document is left as it was


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("cluster:\n  hosts: {a: null}\n", "no top-level 'all'"),
        ("all:\n  children:\n    workers:\n      hosts: {a: null}\n", "found: none"),
        (
            "all:\n  children:\n    master:\n      hosts: {a: null, b: null}\n",
            "found: a, b",
        ),
    ],
)
def test_one_node_inventory_refuses_an_inventory_without_one_master(text: str, found: str):
    with pytest.raises(InvalidInput, match=found):
        one_node_inventory(yaml.safe_load(text), "hosts.yml")


def test_the_master_only_copy_loads_in_ansible_with_the_inventorys_group_vars(tmp_path: Path):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(THREE_NODES)
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "workers.yml").write_text("worker_setting: 1\n")
    (tmp_path / "group_vars" / "cluster.yml").write_text("cluster_setting: 2\n")
    with master_only(inventory) as (copy, master):
        assert copy.parent == tmp_path
        assert copy.name.startswith(".")  # a directory inventory skips it (hidden)
        listed = subprocess.run(
            [str(Path(sys.executable).parent / "ansible-inventory"), "-i", str(copy), "--list"],
            capture_output=True, text=True, check=True, cwd=tmp_path,
        )  # fmt: skip
    assert master == "node1"
    assert not copy.exists()
    graph = json.loads(listed.stdout)
    assert graph["master"]["hosts"] == ["node1"]
    assert "hosts" not in graph.get("workers", {})
    assert set(graph["_meta"]["hostvars"]) == {"node1"}
    assert graph["_meta"]["hostvars"]["node1"]["cluster_setting"] == 2


def test_first_nodes_keeps_the_nodes_of_the_lowest_ranks_and_refuses_a_count_out_of_range(
    tmp_path: Path,
):
    # train --nodes N: the way out the go/no-go names for fewer nodes (issue 39).
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(THREE_NODES)
    with first_nodes(inventory, 2) as (copy, kept):
        assert kept == ["node1", "node2"]
        document = yaml.safe_load(copy.read_text())
        assert copy.name.startswith(".")
    assert not copy.exists()
    cluster = document["all"]["children"]["cluster"]
    assert cluster["vars"] == {"nproc_per_node": 1}
    assert cluster["children"]["workers"]["hosts"] == {"node2": None}
    for count in (0, 4):
        with pytest.raises(InvalidInput, match="has 3 nodes"), first_nodes(inventory, count):
            pass


def test_master_only_refuses_a_directory_or_a_file_that_is_not_yaml(tmp_path: Path):
    with pytest.raises(InvalidInput, match="one YAML file"), master_only(tmp_path):
        pass
    ini = tmp_path / "hosts.ini"
    ini.write_text("[master]\nnode1\n")
    with pytest.raises(InvalidInput, match="one YAML file"), master_only(ini):
        pass


def _summary(nodes: int, tokens_per_s: float | None, **more: object) -> TrainSummary:
    return TrainSummary(
        run_id=f"train-{nodes}",
        world_size=nodes,
        nnodes=nodes,
        tokens_per_s=tokens_per_s,
        deepspeed="zero2",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        gradient_checkpointing=True,
        torch_compile=False,
        **more,  # type: ignore[arg-type]
    )


def test_the_one_node_run_pins_the_plan_of_the_run_on_every_node():
    stage, args = pinned(_summary(3, 900.0))
    assert stage == "zero2"
    assert args == {
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "disable_gradient_checkpointing": False,
        "torch_compile": False,
    }
    assert pinned(TrainSummary(run_id="r")) == (None, {})


def test_scaling_reports_the_speedup_its_share_of_linear_and_whether_nodes_pay():
    fast = Scaling(one=Point(1, _summary(1, 1000.0)), every=Point(3, _summary(3, 2400.0)))
    assert fast.speedup == pytest.approx(2.4)
    assert fast.efficiency == pytest.approx(0.8)
    assert fast.pays is True
    lines = fast.lines()
    assert lines[0] == "Plan: zero2, micro-batch 2 x accumulation 4 per rank"
    assert lines[1] == "1 node: 1,000 tokens/s (run train-1, world size 1, - steps, final loss -)"
    assert lines[-1] == "Scaling: x2.40 on 3 nodes, 80% of linear; adding nodes pays"
    slow = Scaling(one=Point(1, _summary(1, 1000.0)), every=Point(2, _summary(2, 700.0)))
    assert slow.pays is False
    assert slow.lines()[-1].endswith("does not pay: fewer nodes train faster")
    unknown = Scaling(one=Point(1, _summary(1, None)), every=Point(2, _summary(2, 700.0)))
    assert (unknown.speedup, unknown.efficiency, unknown.pays) == (None, None, None)
    assert unknown.lines()[-1] == "Scaling: not measured (a run logged no token counts)"
    nodeless = Scaling(one=Point(1, _summary(1, 1000.0)), every=Point(0, _summary(0, 700.0)))
    assert nodeless.efficiency is None  # a summary without its node count: no share of linear


def test_summary_reads_the_measured_speed_and_the_plan_from_the_stats():
    summary = TrainSummary.from_stats(
        {
            "run_id": "r",
            "tokens_per_s": "1234.5",
            "predicted_tokens_per_s": 2000,
            "nnodes": "2",
            "deepspeed": "none",
            "per_device_train_batch_size": "4",
            "gradient_accumulation_steps": 2,
            "gradient_checkpointing": "True",
            "torch_compile": False,
        }
    )
    assert (summary.tokens_per_s, summary.predicted_tokens_per_s) == (1234.5, 2000.0)
    assert pinned(summary) == (
        "none",
        {
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "disable_gradient_checkpointing": False,
            "torch_compile": False,
        },
    )


def test_scaling_refuses_fewer_than_two_steps_or_a_run_it_cannot_follow_before_any_run(
    cluster: Cluster,
):
    with pytest.raises(InvalidInput, match="at least 2"):
        cluster.scaling("tiny", steps=1)
    with pytest.raises(InvalidInput, match="it takes no detach, run_id"):
        cluster.scaling("tiny", detach=True, run_id="r")
    with pytest.raises(InvalidInput, match="train_args must be a mapping"):
        cluster.scaling("tiny", train_args=["max_steps=3"])
    assert not (cluster.private_data_dir / "artifacts").exists()


def test_scaling_runs_the_pinned_plan_on_this_cluster_with_the_master_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Cluster.scaling's own steps, with train() replaced: the real runs are the lab test's
    (test_lab_scaling_...); the refusal of a plan that the master cannot hold alone needs GPU
    memory, which the CPU lab does not plan."""
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(THREE_NODES)
    cluster = Cluster(inventory, private_data_dir=tmp_path / "runner")
    calls: list[dict] = []

    def train(self: Cluster, model: str, dataset: str | None = None, **kw: object) -> RunResult:
        groups = yaml.safe_load(self.inventory.read_text())["all"]["children"]["cluster"]
        calls.append({"inventory": self.inventory, "groups": groups, **kw})
        nodes = 3 if len(calls) == 1 else 1
        if refuse and len(calls) == 2:
            raise InvalidInput("it needs 90.0 GiB of GPU memory, node1 has 80.0", host="node1")
        return RunResult(
            playbook="train.yml", ident=str(len(calls)), status="successful", rc=0, hosts={},
            artifact_dir=tmp_path, summary=_summary(nodes, 1000.0 * nodes ** 0.5),
        )  # fmt: skip

    monkeypatch.setattr(Cluster, "train", train)
    refuse = False
    scaling = cluster.scaling("tiny", steps=5, train_args={"learning_rate": 1e-4})
    every, one = calls
    assert every["inventory"] == inventory
    assert every["allow_slow_scaling"] is True
    assert "deepspeed" not in every
    assert one["inventory"].parent == tmp_path
    assert one["inventory"].name.startswith(".")
    assert one["groups"]["children"]["workers"]["hosts"] == {}
    assert one["deepspeed"] == "zero2"
    assert one["train_args"] == {
        "learning_rate": 1e-4,
        **MEASURE_ARGS,
        "max_steps": 5,
        **pinned(_summary(3, None))[1],
    }
    assert cluster.inventory == inventory
    assert not one["inventory"].exists()
    assert scaling.speedup == pytest.approx(3**0.5)

    calls.clear()
    refuse = True
    with pytest.raises(InvalidInput) as refused:
        cluster.scaling("tiny", steps=5)
    assert refused.value.message.startswith(
        "the plan of the run on every node (train-3: zero2, micro-batch 2 x accumulation 4) "
        "cannot run on node1 alone, so its scaling cannot be measured against one node: "
        "it needs 90.0 GiB"
    )
    assert refused.value.host == "node1"
    assert cluster.inventory == inventory
    assert not calls[1]["inventory"].exists()


# --------------------------------------------------------------------------------------------
# The lab: real nodes over SSH
# --------------------------------------------------------------------------------------------
@pytest.mark.lab
def test_lab_provision_reports_every_node(provisioned: Cluster):
    # The fixture asserted it; a second run must change nothing (idempotence through the API).
    result = provisioned.provision()
    assert all(s.changed == 0 for s in result.hosts.values()), result.hosts


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


def test_a_failed_runs_status_says_where_it_ended_and_where_to_continue():
    published = {
        "job": "train-1-tiny",
        "phase": "failed",
        "reason": {"node": "node2", "kind": "exited", "exit_status": -9, "message": "killed"},
        "progress": {"current_steps": 29, "total_steps": 90},  # no loss: the closing record
        "nodes": {"node1": {"phase": "failed"}, "node2": {"phase": "failed"}},
        "summary": {
            "step": 29,
            "total_steps": 90,
            "final_loss": 1.25,
            "time_s": 760.0,
            "time_from": "llama-job",
            "restarts": 2,
            "max_restarts": 2,
            "restarted_after": ["node2", "node1"],
            "resume": {
                "checkpoint": "checkpoint-20",
                "command": "ansible-playbook train.yml -e resume=true -e run_id=train-1-tiny",
                "message": "Continue from checkpoint-20: ...",
            },
        },
    }
    job = JobStatus.from_dict(published)
    assert (job.phase, job.node, job.exit_status, job.step) == (Phase.FAILED, "node2", -9, 29)
    assert job.reason is not None
    assert job.reason.kind is FailureKind.EXITED
    assert job.summary is not None
    assert (job.summary.final_loss, job.summary.restarted_after) == (1.25, ("node2", "node1"))
    assert job.summary.resume is not None
    assert job.summary.resume.checkpoint == "checkpoint-20"
    progress = train_runner.TrainProgress.of_job(job)
    assert (progress.step, progress.total_steps, progress.text) == (29, 90, "failed step 29/90")
    assert not job.phase.in_progress()


def test_the_summary_from_the_controller_dir_reads_the_last_attempt(tmp_path: Path):
    # Killed at step 7 after checkpoint-5: attempt 2 logs 6 and 7 again, then 8, then closes.
    attempt1 = [{"current_steps": s, "total_steps": 8, "loss": 9.0} for s in range(1, 8)]
    attempt2 = [{"current_steps": s, "total_steps": 8, "loss": float(s)} for s in (6, 7, 8)]
    closing = {"current_steps": 8, "total_steps": 8}
    records = [*attempt1, *attempt2, closing]
    (tmp_path / "trainer_log.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in records))
    (tmp_path / "all_results.json").write_text('{"train_runtime": 12.5}')
    summary = train_runner.TrainSummary.from_controller_dir("r", tmp_path)
    assert (summary.last_step, summary.final_loss, summary.runtime_s) == (8, 8.0, 12.5)
    empty = train_runner.TrainSummary.from_controller_dir("r", tmp_path / "absent")
    assert (empty.last_step, empty.final_loss) == (None, None)
