"""The plan's protocol (plugins/module_utils/planner/plan.py): the stages and what each is, the
one search order per fine-tuning type, the plan's JSON and its versions (the plans the previous
release wrote, tests/data/plan_v1.json), a resumed plan, and the report of a finished run as
train.yml hands it to the API (filter job_run_report, llama_runner's TrainSummary).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.filter.job import job_run_report, ranks_line
from ansible_collections.llama.cluster.plugins.filter.run_config import train_args
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.protocol import JobStatus
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError
from ansible_collections.llama.cluster.plugins.module_utils.planner.plan import (
    PLAN_VERSION,
    Plan,
    RunReport,
    Stage,
    search_order,
    stage_of,
)

from llama_runner.results import TrainSummary, summary_of_files
from tests.support.planning import H200_GIB, make_plan, nodes

ROOT = Path(__file__).resolve().parents[3]
# Two plans as the release before plans had a version wrote them (plan.json): a full fine-tune
# of qwen2.5-7b on 2 x 2 GPUs (ZeRO-1), and the tiny model on 2 x 2 CPU ranks.
V1 = json.loads((ROOT / "tests/data/plan_v1.json").read_text())

# What each stage is: ZeRO stage, offloads (optimizer, weights), FSDP, hybrid, the stage the
# memory model and the cost model measured it as, sharded checkpoints, its configuration file.
# These were three maps (memory.py MEASURED_STAGE, cost.py COST_STAGE, search.py HYBRID) and
# checkpoints.py's sharded_checkpoints.
PROPERTIES = {
    "none": (None, False, False, False, False, "none", "none", False, ""),
    "zero0": (0, False, False, False, False, "none", "none", True, "ds_config.json"),
    "zero1": (1, False, False, False, False, "zero2", "zero1", True, "ds_config.json"),
    "zero2": (2, False, False, False, False, "zero2", "zero2", True, "ds_config.json"),
    "zero2_offload": (2, True, False, False, False, "zero2_offload", "zero2_offload", True,
                      "ds_config.json"),
    "zero3": (3, False, False, False, False, "zero3", "zero3", True, "ds_config.json"),
    "zero3_hpz": (3, False, False, False, True, "zero3", "zero3", True, "ds_config.json"),
    "zero3_offload": (3, True, True, False, False, "zero3_offload", "zero3_offload", True,
                      "ds_config.json"),
    "fsdp": (None, False, False, True, False, "zero3", "zero3", True, "fsdp_config.json"),
    "hsdp": (None, False, False, True, True, "zero3", "zero3", True, "fsdp_config.json"),
}  # fmt: skip


@pytest.mark.parametrize("name", PROPERTIES)
def test_each_stage_knows_what_it_is(name: str) -> None:
    stage = Stage(name)
    zero, optimizer, params, fsdp, hybrid, measured, cost, sharded, config = PROPERTIES[name]
    assert (stage.zero, stage.offload_optimizer, stage.offload_params) == (zero, optimizer, params)
    assert (stage.fsdp, stage.hybrid, stage.sharded, stage.config) == (
        fsdp,
        hybrid,
        sharded,
        config,
    )
    assert (stage.measured, stage.cost) == (Stage(measured), Stage(cost))
    assert stage.properties() == {
        "name": name,
        "zero": zero,
        "fsdp": fsdp,
        "hybrid": hybrid,
        "offload_optimizer": optimizer,
        "offload_params": params,
        "sharded": sharded,
        "config": config,
    }
    assert f"{stage}" == str(stage) == name  # as text, its name: -e deepspeed=<name>
    assert stage.flat.hybrid is False
    assert stage.environment == (
        {"FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"} if name == "hsdp" else {}
    )


def test_every_stage_is_listed_and_auto_is_none() -> None:
    assert sorted(PROPERTIES) == sorted(stage.value for stage in Stage)
    assert stage_of("auto") is stage_of("") is None
    assert stage_of("zero3") is Stage.ZERO3
    with pytest.raises(ValueError, match="zero4"):
        stage_of("zero4")


def test_one_search_order_per_fine_tuning_type() -> None:
    full = search_order("full")
    assert full[0] is Stage.NONE
    assert full[-2:] == (Stage.ZERO2_OFFLOAD, Stage.ZERO3_OFFLOAD)  # offload last
    assert Stage.FSDP not in full  # run when asked, never chosen
    assert Stage.ZERO0 not in full
    # ZeRO-1 and ZeRO-2 split nothing an adapter run holds much of.
    assert (
        search_order("lora")
        == search_order("freeze")
        == (
            Stage.NONE,
            Stage.ZERO3,
            Stage.ZERO3_OFFLOAD,
        )
    )


@pytest.mark.parametrize("which", ["gpu", "cpu"])
def test_a_plan_of_the_previous_release_is_read_in_this_version(which: str) -> None:
    old = V1[which]
    plan = Plan.from_dict(old)
    assert plan.version == PLAN_VERSION
    assert plan.stage.stage == old["deepspeed"]
    assert plan.stage.stage.sharded is old["sharded"]
    assert plan.stage.why == old["decisions"]["deepspeed"]
    assert (plan.batch.micro, plan.batch.accumulation) == (
        old["train_args"]["per_device_train_batch_size"],
        old["train_args"]["gradient_accumulation_steps"],
    )
    assert plan.batch.effective == old["effective_batch"]
    assert plan.batch.checkpointing is old["gradient_checkpointing"]
    assert plan.batch.why == old["decisions"]["batch"]
    assert plan.memory.budget_gib == old["memory_budget_gib"]
    assert plan.technique.label == old["technique"]["label"]
    assert plan.summary == tuple(old["summary"])
    # It renders as it did, and reads back as written.
    assert train_args(old, "/r") == train_args(plan.to_dict(), "/r")
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_a_plan_of_a_newer_release_is_refused_naming_the_versions() -> None:
    newer = {**Plan.from_dict(V1["cpu"]).to_dict(), "version": PLAN_VERSION + 1}
    with pytest.raises(PlanError, match=f"version {PLAN_VERSION + 1}; this release reads plans up"):
        Plan.from_dict(newer)


def test_a_resumed_plan_of_the_previous_release_restarts_as_asked_from_where_its_model_is() -> None:
    plan = Plan.from_dict(V1["gpu"]).resumed(2)
    assert (plan.resume, plan.max_restarts, plan.run_id) == (True, 2, V1["gpu"]["run_id"])
    assert plan.model_stage == {
        "kind": "shared",
        "name": "qwen2.5-7b",
        "path": V1["gpu"]["model"]["path"],
    }
    data = plan.to_dict()
    assert data["stage"]["sharded"] is True  # what roles/job and resume.yml read
    assert data["stage"]["name"] == "zero1"


# ---- the report of a finished run (train.yml's summary: playbooks/tasks/summarise_run.yml) ----
def _status(restarted_after: tuple[str, ...] = ()) -> dict:
    restarts = [{"attempt": i + 2, "after": {"node": node, "kind": "exited", "message": "x"}}
                for i, node in enumerate(restarted_after)]  # fmt: skip
    return {
        "job": "r",
        "phase": "succeeded",
        "max_restarts": 2,
        "restarts": restarts,
        "nodes": {
            "b": {"phase": "succeeded", "rank": 1, "ranks": [2, 3]},
            "a": {"phase": "succeeded", "rank": 0, "ranks": [0, 1]},
        },
    }


def test_the_ranks_line_names_every_node_in_rank_order():
    line = ranks_line(JobStatus.from_dict(_status()))
    assert line == "a: ranks 0-1 (node rank 0); b: ranks 2-3 (node rank 1)"
    assert ranks_line(JobStatus.from_dict({"job": "r", "phase": "succeeded", "nodes": {}})) == ""


def test_the_report_reads_the_last_attempt_of_the_log_and_the_plans_choices(tmp_path: Path):
    attempt1 = [{"current_steps": s, "total_steps": 8, "loss": 9.0} for s in range(1, 7)]
    attempt2 = [{"current_steps": s, "total_steps": 8, "loss": 1.0 + s} for s in range(5, 9)]
    closing = {"current_steps": 8, "total_steps": 8}
    log = "\n".join(json.dumps(r) for r in [*attempt1, *attempt2, closing])
    (tmp_path / "trainer_log.jsonl").write_text(log)
    (tmp_path / "all_results.json").write_text('{"train_runtime": 12.5}')
    checkpoints = ["/o/checkpoint-10", "/o/checkpoint-8", "/o/checkpoint-9"]
    done = job_run_report(
        V1["cpu"], _status(("b",)), str(tmp_path), "/r", checkpoints=checkpoints, master="a"
    )
    report = RunReport.from_dict(done["report"])
    assert (report.last_step, report.final_loss, report.runtime_s) == (8, 9.0, 12.5)
    assert report.checkpoints == ("/o/checkpoint-8", "/o/checkpoint-9", "/o/checkpoint-10")
    assert report.ranks == {"a": (0, 1), "b": (2, 3)}
    assert (report.world_size, report.effective_batch_size, report.deepspeed) == (4, 8, "none")
    assert report.gradient_checkpointing is True  # a bool, never Ansible's "True"
    assert report.loss_plot is None
    assert done["lines"] == [
        "Run train-20260101-000000-tiny finished: world size 4, effective batch 8",
        "Ranks: a: ranks 0-1 (node rank 0); b: ranks 2-3 (node rank 1)",
        "Runtime 12.5 s, 8 steps, final loss 9.0",
        "Tokens/s: not measured, not predicted",
        "Adapter and checkpoints on a: /r/output",
        "Checkpoints: checkpoint-8, checkpoint-9, checkpoint-10",
        f"Logs and loss plot: {tmp_path}/ (plot: none)",
        "Restarts: 1 of 2 (b failed)",
        "Ran without: none",
        "Warnings: none",
    ]
    assert job_run_report(V1["cpu"], None, str(tmp_path / "none"), "/r")["report"]["ranks"] == {}


def test_the_api_reads_the_report_as_it_was_written(tmp_path: Path) -> None:
    (tmp_path / "training_loss.png").write_bytes(b"png")
    written = job_run_report(V1["gpu"], _status(), str(tmp_path), "/r")["report"]
    summary = TrainSummary.from_dict(json.loads(json.dumps(written)))  # set_stats llama_run
    assert summary == RunReport.from_dict(written)
    assert summary.controller_dir == tmp_path
    assert summary.loss_plot == tmp_path / "training_loss.png"
    assert summary.deepspeed is Stage.ZERO1
    assert summary.predicted_tokens_per_s == V1["gpu"]["performance"]["tokens_per_s"]
    assert summary.to_dict() == written
    brought = summary_of_files("r", tmp_path)
    assert (brought.run_id, brought.loss_plot, brought.world_size) == ("r", summary.loss_plot, None)


# ---------------------------------------------------------------------------------------------
# The plan's shape (resume.yml and main.yml read it) and what train.yaml gets.
# ---------------------------------------------------------------------------------------------


def test_the_plan_keeps_the_shape_resume_and_the_playbooks_read() -> None:
    plan = make_plan()
    data = json.loads(json.dumps(plan.to_dict()))  # plan.json
    for key in (
        "run_id",
        "resume",
        "model_name",
        "model",
        "datasets",
        "stage",
        "nnodes",
        "nproc_per_node",
        "world_size",
        "batch",
        "train_args",
        "ranks",
        "version",
    ):
        assert key in data, key
    assert data["stage"]["sharded"] is (plan.stage.stage != "none")
    assert plan.run_id == "train-20260101-000000-qwen2-5-7b"
    assert plan.resume is False
    assert Plan.from_dict(data) == plan


def test_a_resumed_plan_keeps_its_run_and_stages_nothing() -> None:
    plan = make_plan("tiny", max_restarts=1).resumed(3)
    assert plan.run_id == "train-20260101-000000-tiny"
    assert (plan.resume, plan.max_restarts) == (True, 3)
    assert plan.model_stage == {"kind": "shared", "name": "tiny", "path": plan.model["path"]}


def test_the_plan_shown_before_launch_lists_every_decision() -> None:
    plan = make_plan(cluster=nodes(2, nproc=8), dataset_records=10**6)
    text = "\n".join(plan.summary)
    for expected in (
        "qwen2.5-7b (Qwen/Qwen2.5-7B-Instruct), lora, 7.62B parameters",
        "Nodes 2 x 8 processes = world size 16 (nvidia)",
        "Effective batch 64 = per-device 4 x accumulation 1 x world size 16",
        "Tokens per optimizer step: 8192 per process x 16 = 131072 (packed rows of 2048 tokens)",
        "DeepSpeed: none (the fastest predicted of",
        "Gradient checkpointing: off",
        "Packing: on; torch.compile: on",
        f"GPU memory planned for: {H200_GIB} GiB per GPU",
        "Datasets: demo_alpaca",
    ):
        assert expected in text, expected


def test_the_report_names_the_nodes_a_run_went_on_without_and_its_warnings() -> None:
    # -e min_nodes (issue 44): the last attempt ran without b, planned at launch for one node;
    # a rank's abort in teardown after every rank finished is a warning, not a failure.
    report = RunReport.from_dict(
        {"run_id": "r", "left_out": ["b"], "warnings": ["node a: gloo aborted in teardown"]}
    )
    assert RunReport.from_dict(report.to_dict()) == report
    lines = report.lines("a: rank 0", "a", adapter=False, failed=["b"], allowed=1,
                         without="min_nodes, from attempt 2: accumulation 2 -> 4")  # fmt: skip
    assert lines[-2:] == [
        "Ran without: b (min_nodes, from attempt 2: accumulation 2 -> 4)",
        "Warnings: node a: gloo aborted in teardown",
    ]
