"""train_runner.py (llama_runner/): real ansible-runner runs of real playbooks on localhost, no
mocks: events and artifacts, the stats a run publishes, typed errors naming host and task,
cancelling, the plan alone, a job's status and progress.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# train_runner.py and llama_runner/ sit at the repository root, not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train_runner
from train_runner import (
    EXIT_OK,
    PROJECT_DIR,
    Cluster,
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


from tests.support.runner import cli, write_playbook  # noqa: E402


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
    assert "DeepSpeed: none (CPU cluster: plain DDP over gloo)" in "\n".join(result.plan)
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
