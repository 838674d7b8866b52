"""The plan for what is free at train time (issue 38): the planner, from what every node's GPUs
and memory hold now, and who holds the rest; llama.cluster.run_plan planning a run again for it,
and train.yml reading every node before it does."""

from __future__ import annotations

import json
import pwd
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.planner.assembly import (
    RUN_STAMP,
    new_run_id,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError
from ansible_collections.llama.cluster.plugins.module_utils.planner.nodes import (
    BUSY_GPU_MIB,
    describe_nodes,
    node_gpu_usage,
    node_host_memory,
    usage_by_host,
)

from tests.support.node_usage import H100, NOBODY, read
from tests.support.playbooks import _inventory, _node, _train


# ---- the planner: what is free now, and who holds the rest ---------------------------------------
def _hostvars(
    mib: list[int],
    nproc: int | None = None,
    host_mib: int = 2_000_000,
    **extra: Any,
) -> dict[str, Any]:
    """A GPU node's hostvars, its facts as roles/host_facts records them."""
    gpus = [{"index": i, "memory_mib": m, "name": H100} for i, m in enumerate(mib)]
    facts = {"gpus": gpus, "gpu_count": len(gpus), "host_memory_mib": host_mib}
    node = {"cluster_accelerator": "nvidia", "ansible_local": {"llama_host": facts}}
    node["nproc_per_node"] = len(mib) if nproc is None else nproc
    return {**node, **extra}


def _describe(nodes: dict[str, dict[str, Any]], found: dict[str, Any]) -> list[dict[str, Any]]:
    ranks = {host: rank for rank, host in enumerate(nodes)}
    nprocs = {host: node["nproc_per_node"] for host, node in nodes.items()}
    return describe_nodes(ranks, nodes, nprocs, found)


def test_an_idle_node_is_planned_for_what_is_free_now(proc: Path) -> None:
    (node,) = _describe({"g1": _hostvars([81559] * 8)}, {"g1": read("idle-8x-h100", proc)})
    # 81,559 - 1 MiB used = 81,558 MiB = 79.65 GiB, rounded down.
    assert node["gpu_memory_gib"] == 79.6
    assert node["memory_source"] == "free now (nvidia-smi at train time), smallest of 8 GPUs"


def test_a_gpu_another_user_holds_stops_the_plan_naming_process_memory_and_ways_out(
    proc: Path,
) -> None:
    with pytest.raises(PlanError) as refused:
        _describe({"g1": _hostvars([81559] * 8)}, {"g1": read("other-user-gpu1", proc)})
    said = str(refused.value)
    user = pwd.getpwuid(NOBODY).pw_name
    assert said.startswith("Other work holds GPUs this run needs")
    assert "g1: another process holds a GPU this run needs (it trains on GPUs 0, 1, 2, 3, 4, 5" in (
        said
    )
    assert (
        f"GPU 1 ({H100}) is held by pid 48213 (user {user}: python3 finetune.py --config "
        "big.yaml), 52.5 GiB; 27.1 of 79.6 GiB free now"
    ) in said
    assert "Stop it, leave it out with gpu_ids (e.g. gpu_ids=[0, 2, 3, 4, 5, 6, 7] for g1" in said
    assert "-e gpu_memory_gib=N (N <= 27.1, the least free on a GPU this run needs" in said


@pytest.mark.parametrize(
    ("settings", "gpus"),
    [({"gpu_ids": [0, 2, 3]}, 3), ({"nproc": 1}, 1)],
    ids=["gpu_ids leave it out", "one process trains on GPU 0"],
)
def test_a_held_gpu_the_run_does_not_use_is_no_obstacle(
    proc: Path, settings: dict[str, Any], gpus: int
) -> None:
    nproc = settings.pop("nproc", None)
    hostvars = _hostvars([81559] * 8, nproc=nproc, **settings)
    (node,) = _describe({"g1": hostvars}, {"g1": read("other-user-gpu1", proc)})
    assert node["gpu_memory_gib"] == 79.6
    which = "GPU" if gpus == 1 else f"smallest of {gpus} GPUs"
    assert node["memory_source"] == f"free now (nvidia-smi at train time), {which}"


def test_gpu_memory_gib_accepts_a_share_no_larger_than_what_is_free(proc: Path) -> None:
    found = {"g1": read("other-user-gpu1", proc)}
    (node,) = _describe({"g1": _hostvars([81559] * 8, gpu_memory_gib=20)}, found)
    assert node["gpu_memory_gib"] == 20.0
    assert node["memory_source"] == (
        f"gpu_memory_gib (inventory or -e): a share of GPU 1 ({H100}), which other processes "
        "hold (27.1 GiB free now, nvidia-smi at train time)"
    )
    with pytest.raises(PlanError, match=r"g1: gpu_memory_gib = 40 GiB is more than is free now"):
        _describe({"g1": _hostvars([81559] * 8, gpu_memory_gib="40")}, found)
    with pytest.raises(PlanError, match=r"Set gpu_memory_gib to at most 27.1, stop those"):
        _describe({"g1": _hostvars([81559] * 8, gpu_memory_gib="40")}, found)


def test_gpu_memory_gib_still_wins_on_an_idle_node(proc: Path) -> None:
    hostvars = _hostvars([81559] * 8, gpu_memory_gib=40)
    (node,) = _describe({"g1": hostvars}, {"g1": read("idle-8x-h100", proc)})
    assert (node["gpu_memory_gib"], node["memory_source"]) == (
        40.0,
        "gpu_memory_gib (inventory or -e), over the facts",
    )


def test_memory_in_use_with_no_process_listed_is_held_by_another_container(proc: Path) -> None:
    assert 512 < BUSY_GPU_MIB < 30211
    with pytest.raises(PlanError) as refused:
        _describe({"g2": _hostvars([46068] * 4)}, {"g2": read("other-container", proc)})
    said = str(refused.value)
    # GPU 0 is held; GPU 2's 512 MiB are not counted as another's work.
    assert (
        "GPU 0 (NVIDIA L40S) is 29.5 GiB in use, held by processes this node cannot see "
        "(another container?); 15.4 of 45.0 GiB free now"
    ) in said
    assert "GPU 2" not in said
    assert "e.g. gpu_ids=[1, 2, 3] for g2" in said


def test_several_nodes_are_refused_in_one_message(proc: Path) -> None:
    nodes = {"g1": _hostvars([81559] * 8), "g2": _hostvars([46068] * 4)}
    found = {"g1": read("other-user-gpu1", proc), "g2": read("other-container", proc)}
    with pytest.raises(PlanError) as refused:
        _describe(nodes, found)
    assert re.search(r"g1: another process .* g2: another process", str(refused.value))


def test_a_run_of_this_cluster_on_the_gpu_is_named_with_status_and_stop(proc: Path) -> None:
    found = read("other-user-gpu1", proc)
    found["gpus"][1]["processes"][0]["command"] = (
        "/opt/llama-cluster/env/bin/python -m llamafactory.launcher "
        "/opt/llama-cluster/runs/train-20261204-120000-qwen-7b/train.yaml"
    )
    hostvars = _hostvars([81559] * 8, cluster_runs_dir="/opt/llama-cluster/runs")
    with pytest.raises(PlanError, match=r"a run of this cluster: playbooks/status.yml shows it"):
        _describe({"g1": hostvars}, {"g1": found})


def test_mig_gpus_without_a_used_figure_need_gpu_memory_gib(proc: Path) -> None:
    found = {"m": read("mig", proc)}
    # GPU 0 has a process (of another namespace, its memory not reported): refused.
    with pytest.raises(PlanError) as refused:
        _describe({"m": _hostvars([81920] * 2)}, found)
    said = str(refused.value)
    assert "pid 30417 (no name reported, memory not reported), which this node cannot see" in said
    assert "accept a share with -e gpu_memory_gib=N (nvidia-smi reports no free figure)" in said
    # GPU 1 alone: no process listed, no used figure: the facts, and the knob to set.
    (node,) = _describe({"m": _hostvars([81920] * 2, gpu_ids=[1])}, found)
    assert node["gpu_memory_gib"] == 80.0
    assert node["memory_source"] == (
        "facts, GPU (at train time nvidia-smi reports no used memory for GPU 1 "
        "(NVIDIA A100-SXM4-80GB): a MIG GPU? set gpu_memory_gib to its slice)"
    )
    (node,) = _describe({"m": _hostvars([81920] * 2, gpu_memory_gib=10)}, found)
    assert node["gpu_memory_gib"] == 10.0
    assert "free memory not reported" in node["memory_source"]


def test_a_node_whose_read_failed_or_did_not_answer_is_planned_from_its_facts() -> None:
    hostvars = _hostvars([81559])
    facts = (79.6, "facts, GPU")
    reads = {
        "no answer": {"unreachable": True, "msg": "Failed to connect to the host via ssh"},
        "failed": {"failed": False, "msg": "sudo: a password is required", "item": "g1"},
        "nvidia-smi failed": {
            "gpus": [],
            "nvidia_smi_error": "--query-gpu=...: exit status 9: NVIDIA-SMI has failed",
        },
        "not asked for": {"skipped": True, "item": "g1"},
    }
    said = {case: node_gpu_usage("g1", hostvars, found, 1, facts) for case, found in reads.items()}
    assert said == {
        "no answer": (
            79.6,
            "facts, GPU; the node did not answer the read of its usage at train time",
            "",
        ),
        "failed": (
            79.6,
            "facts, GPU; the read of its usage at train time failed: sudo: a password is required",
            "",
        ),
        "nvidia-smi failed": (
            79.6,
            "facts, GPU (at train time nvidia-smi failed: --query-gpu=...: exit status 9: "
            "NVIDIA-SMI has failed)",
            "",
        ),
        "not asked for": (79.6, "facts, GPU", ""),
    }


def test_gpu_ids_that_nvidia_smi_no_longer_lists_are_refused(proc: Path) -> None:
    with pytest.raises(PlanError, match=r"g1: gpu_ids \[0, 9\] name GPUs \[9\] that nvidia-smi"):
        node_gpu_usage(
            "g1", _hostvars([81559] * 10, gpu_ids=[0, 9]), read("idle-8x-h100", proc), 2, (1.0, "")
        )


def test_host_memory_is_the_smaller_of_the_facts_and_what_is_available_now() -> None:
    hostvars = _hostvars([81559], host_mib=128_000)
    now = {"gpus": [], "host_memory": {"available_mib": 60_000, "source": "MemAvailable"}}
    assert node_host_memory("g1", hostvars, now) == (
        58.5,
        "available now (MemAvailable at train time), of 125 GiB in the facts",
    )
    more = {"gpus": [], "host_memory": {"available_mib": 200_000, "source": "MemAvailable"}}
    assert node_host_memory("g1", hostvars, more) == (125.0, "facts (no less is available now)")
    # host_memory_gib still wins; without a read, the facts as before.
    assert node_host_memory("g1", {**hostvars, "host_memory_gib": 64}, now)[0] == 64.0
    assert node_host_memory("g1", hostvars) == (125.0, "facts")
    assert node_host_memory("g1", hostvars, {"unreachable": True}) == (
        125.0,
        "facts; the node did not answer the read of its usage at train time",
    )


def test_a_cpu_node_is_planned_for_the_host_memory_available_now() -> None:
    cpu = {"cluster_accelerator": "cpu", "nproc_per_node": 1}
    now = {"gpus": [], "host_memory": {"available_mib": 23_157, "source": "MemAvailable"}}
    (node,) = _describe({"c1": cpu}, {"c1": now})
    assert (node["gpu_memory_gib"], node["memory_source"]) == (None, "CPU node")
    assert (node["host_memory_gib"], node["host_memory_source"]) == (
        22.6,
        "available now (MemAvailable at train time)",
    )


def test_the_registered_loop_is_read_by_node() -> None:
    results = [{"item": "a", "gpus": []}, {"item": "b", "unreachable": True}, {"no": "item"}]
    assert usage_by_host(results) == {"a": results[0], "b": results[1]}
    assert usage_by_host(None) == {}


# ---- the action: plan from the facts, then again for what the nodes hold now ---------------------
def _plan_twice(tmp: Path, found: list[dict[str, Any]], *extra: str) -> tuple[int, str]:
    """llama.cluster.run_plan as train.yml calls it: from the facts (the request checked, the
    run's id claimed), then again with the nodes' reads; both results kept in results.json. One GPU
    node, g1, whose facts are in the inventory (tests/unit/planner/test_train_validation.py's
    nodes)."""
    inventory = _inventory(tmp, {"g1": _node("192.0.2.1", [81559])}, {})
    asked = {"model": "qwen2.5-1.5b", "probe_model": False, "claim_run_id": True}
    first = {"llama.cluster.run_plan": asked, "register": "first", "name": "Plan"}
    again = {"replan": "{{ first }}", "node_usage": found}
    second = {"llama.cluster.run_plan": again, "register": "now", "name": "Plan again"}
    keep = {"content": "{{ [first, now] | to_json }}", "dest": str(tmp / "results.json")}
    kept = {"ansible.builtin.copy": keep, "name": "Keep both results"}
    play = {"hosts": "localhost", "gather_facts": False, "tasks": [first, second, kept]}
    (tmp / "plan.yml").write_text(json.dumps([play]))
    return _train(inventory, *extra, playbook=str(tmp / "plan.yml"))


def _one_gpu(found: dict[str, Any]) -> dict[str, Any]:
    """The recorded read of the 8-GPU node cut to its GPU 1 (the other user's python on it),
    as node g1's only GPU, GPU 0; as the task looped over the nodes registers it."""
    return {**found, "gpus": [{**found["gpus"][1], "index": 0}], "item": "g1"}


def test_the_action_plans_again_for_what_is_free_keeping_the_run(
    tmp_path: Path, proc: Path
) -> None:
    # Other runs hold the next 30 seconds' ids: the first call claims a later one, which the
    # second keeps (planned again from the same request, it would name the first second).
    start = datetime.now(UTC)
    taken = {
        new_run_id(f"{start + timedelta(seconds=s):{RUN_STAMP}}", "qwen2.5-1.5b") for s in range(30)
    }
    for run_id in taken:
        (tmp_path / "runs" / run_id).mkdir(parents=True)
    held = _one_gpu(read("other-user-gpu1", proc))
    rc, out = _plan_twice(tmp_path, [held], "-e", "gpu_memory_gib=20")
    assert rc == 0, out[-3000:]
    first, now = json.loads((tmp_path / "results.json").read_text())
    assert first["plan"]["memory"]["gpu_gib"] == 20.0  # -e wins over the facts, as before
    assert now["plan"]["memory"]["gpu_gib"] == 20.0
    assert now["plan"]["memory"]["nodes"]["g1"]["memory_source"].startswith(
        f"gpu_memory_gib (inventory or -e): a share of GPU 0 ({H100}), which other processes"
    )
    assert now["plan"]["memory"]["nodes"]["g1"]["host_memory_gib"] == 96.0
    # The same run: its id (claimed once), nothing checked or made a second time.
    assert now["plan"]["run_id"] == first["plan"]["run_id"]
    assert first["plan"]["run_id"] not in taken
    claimed = {p.name for p in (tmp_path / "runs").iterdir() if p.name.startswith("train-")}
    assert claimed - taken == {first["plan"]["run_id"]}
    assert (first["changed"], now["changed"]) == (True, False)
    assert any("(27.1 GiB free now" in line for line in now["notes"])


def test_planned_again_without_reads_the_plan_is_the_same(tmp_path: Path) -> None:
    # What the first call checked comes back through Ansible's registered result unchanged.
    rc, out = _plan_twice(tmp_path, [])
    assert rc == 0, out[-3000:]
    first, now = json.loads((tmp_path / "results.json").read_text())
    assert (now["plan"], now["notes"]) == (first["plan"], first["notes"])


def test_the_action_refuses_a_held_gpu_after_the_request_was_checked(
    tmp_path: Path, proc: Path
) -> None:
    held = _one_gpu(read("other-user-gpu1", proc))
    rc, out = _plan_twice(tmp_path, [held])
    assert rc != 0
    assert "Other work holds GPUs this run needs" in out
    assert f"GPU 0 ({H100}) is held by pid 48213 (user {pwd.getpwuid(NOBODY).pw_name}:" in out
    assert "-e gpu_memory_gib=N (N <= 27.1" in out


def test_train_yml_reads_every_node_and_plans_the_run_again_for_what_is_free(
    tmp_path: Path,
) -> None:
    # Two CPU nodes on this machine (a local connection): the read runs for real on each, after
    # the request was checked and planned from the facts; the plan is then made again with it.
    local = {"ansible_connection": "local", "cluster_accelerator": "cpu", "nproc_per_node": 1}
    inventory = _inventory(tmp_path, {"a": json.dumps(local)}, {"b": json.dumps(local)})
    rc, out = _train(inventory, "-e", "model=tiny", "--tags", "none", "-v")
    assert rc == 0, out[-3000:]
    task = "TASK [run_config : Run config | "
    read = out.index(f"{task}Read what the GPUs and memory of every node hold now]")
    assert out.index(f"{task}Check the model, datasets, cluster") < read
    assert "ok: [localhost -> a] => (item=a)" in out[read:]
    assert "ok: [localhost -> b] => (item=b)" in out[read:]
    again = out.index(f"{task}Plan the run again for what is free on every node now]")
    assert re.search(r"host_memory_source: available now \((MemAvailable|the cgroup)", out[again:])
    assert out.index(f"{task}Show the plan]") > again
    # -e plan_free_memory=false: the facts alone, no read.
    rc, out = _train(
        inventory, "-e", "model=tiny", "--tags", "none", "-e", "plan_free_memory=false"
    )
    assert rc == 0, out[-3000:]
    assert "ok: [localhost -> a]" not in out
