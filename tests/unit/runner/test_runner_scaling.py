"""`train_runner.py scaling` (llama_runner/scaling.py): the inventories of fewer nodes, the plan
pinned from the run on every node, what the speed-up says.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

# train_runner.py and llama_runner/ sit at the repository root, not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llama_runner.results import RunResult
from llama_runner.scaling import (
    MEASURE_ARGS,
    Point,
    Scaling,
    first_nodes,
    master_only,
    one_node_inventory,
    pinned,
)
from train_runner import (
    PROJECT_DIR,
    Cluster,
    InvalidInput,
    TrainSummary,
)

TRAIN_PLAYBOOK = PROJECT_DIR / "train.yml"
needs_train = pytest.mark.skipif(
    not TRAIN_PLAYBOOK.is_file(), reason="train.yml is not in this checkout yet"
)


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
    # train.yml's report (filter job_run_report) as set_stats hands it over: typed JSON, read
    # as it was written (no coercion of Jinja's text).
    summary = TrainSummary.from_dict(
        {
            "run_id": "r",
            "tokens_per_s": 1234.5,
            "predicted_tokens_per_s": 2000,
            "nnodes": 2,
            "deepspeed": "none",
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "gradient_checkpointing": True,
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
