"""Every template renders for every catalogue model and is accepted by the real tools.

Rendering goes through the run_config role (tests/playbooks/render_run.yml, as train.yml does);
parsing runs in the training venv (scripts/setup-train-venv.sh; LLAMA_CLUSTER_TRAIN_PYTHON)
with LLaMA-Factory's get_train_args, DeepSpeed's DeepSpeedConfig and accelerate's config loader.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_collections.llama.cluster.plugins.filter.run_config import run_files
from ansible_collections.llama.cluster.plugins.module_utils.planner import cost
from ansible_collections.llama.cluster.plugins.module_utils.planner.plan import Stage

ROOT = Path(__file__).resolve().parents[3]
TRAIN_PYTHON = Path(
    os.environ.get("LLAMA_CLUSTER_TRAIN_PYTHON", "/var/cache/llama-cluster/venv-train/bin/python")
)
MODELS = sorted(
    yaml.safe_load((ROOT / "group_vars/all/models.yml").read_text())["models_catalogue"]
)
# Every stage; the hybrid ones (issue 39) on these 2 nodes of 8 processes.
STAGES = [stage.value for stage in Stage]
# Every stage for a full fine-tune and a LoRA one; every other model (its template, LoRA target,
# layer class) at ZeRO-2, which test_train_yaml_reads_like_a_hand_written_file reads. Rendering
# is a playbook run per model, the slowest part of the suite: this keeps it to 29 renders.
ALL_STAGES_FOR = ("qwen2.5-0.5b", "qwen-7b")
PAIRS = [(m, s) for m in MODELS for s in (STAGES if m in ALL_STAGES_FOR else ["zero2"])]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")

# Two GPU nodes of 8 processes each; only the controller and n1 are used (ansible_connection=local).
GPU_INVENTORY = """
all:
  children:
    cluster:
      children:
        master:
          hosts:
            n1: &node {ansible_connection: local, ansible_python_interpreter: %(python)s,
                       cluster_accelerator: nvidia, nproc_per_node: %(nproc)s,
                       cluster_address: 10.0.0.1,
                       cluster_user: %(user)s, cluster_group: %(group)s,
                       ansible_local: {llama_host: {gpus: %(gpus)s, gpu_count: 8},
                                       llama_stack: {bitsandbytes: 0.50.2,
                                                     liger-kernel: 0.8.5}}}
        workers:
          hosts: %(workers)s
"""


def _inventory(tmp: Path, mib: int = 143771, nodes: int = 2, nproc: int = 8) -> Path:
    path = tmp / "inventory.yml"
    path.write_text(
        GPU_INVENTORY
        % {
            "nproc": nproc,
            "workers": "{n2: *node}" if nodes == 2 else "{}",
            "python": sys.executable,
            "user": pwd.getpwuid(os.getuid()).pw_name,
            "group": grp.getgrgid(os.getgid()).gr_name,
            # Eight GPUs (H200s by default), as roles/host_facts records them.
            "gpus": json.dumps([{"index": i, "memory_mib": mib} for i in range(8)]),
        }
    )
    return path


def _large_demo(out: Path, model: str) -> dict[str, Any]:
    """datasets_catalogue with demo_alpaca's records repeated to 4,096: 16 processes ask more
    records of a step than its 28, which the plan refuses (an effective batch beyond the
    dataset). Its entry, name and format are demo_alpaca's."""
    demo = json.loads((ROOT / "data" / "demo_alpaca.json").read_text())
    path = out / f"{model}-demo_alpaca.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([demo[i % len(demo)] for i in range(4096)]))
    return {"datasets_catalogue": {"demo_alpaca": {"file": str(path), "formatting": "alpaca"}}}


def _render(
    inventory: Path, out: Path, model: str, extra: dict[str, Any] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            str(ANSIBLE_PLAYBOOK),
            "-i",
            str(inventory),
            "-l",
            "localhost,n1",
            "tests/playbooks/render_run.yml",
            "-e",
            f"model={model}",
            "-e",
            f"render_root={out / model}",
            "-e",
            json.dumps(
                extra or {"stages": [Stage(s).properties() for m, s in PAIRS if m == model]}
            ),
            "-e",
            json.dumps(_large_demo(out, model)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


# Every test here reads the one rendering and parse of the session fixtures: under xdist they run
# on one worker, so both happen once (two parsers on two workers would also both listen on the
# parse's MASTER_PORT).
pytestmark = pytest.mark.xdist_group("templates")


@pytest.fixture(scope="session")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Render every model at its stages (PAIRS); return the run directory of each."""
    tmp = tmp_path_factory.mktemp("render")
    inventory = _inventory(tmp)
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(
            zip(MODELS, pool.map(lambda m: _render(inventory, tmp, m), MODELS), strict=True)
        )
    runs = {}
    for model, done in results.items():
        assert done.returncode == 0, f"rendering {model} failed:\n{done.stdout[-3000:]}"
    for model, stage in PAIRS:
        (run,) = (tmp / model / stage / "n1").glob("train-*")
        runs[(model, stage)] = run
    return runs


# What train.yml plans for one 24 GiB card (an RTX 4090's 24,564 MiB) whose node has the stack's
# bitsandbytes and liger-kernel: the memory-saving techniques, rendered as train.yaml.
CARD_MIB = 24564
CARD_RUNS = {
    # -e deepspeed=none: planned with the technique that makes it fit, not refused.
    "full-1.5b": ("qwen2.5-1.5b", {"finetuning_type": "full", "deepspeed": "none"}),
    "qlora-14b": ("qwen2.5-14b", {"quantization_bit": 4}),
}


@pytest.fixture(scope="session")
def card_rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The plans of CARD_RUNS on 24 GiB GPUs, rendered; the run directory of each."""
    tmp = tmp_path_factory.mktemp("cards")
    inventory = _inventory(tmp, mib=CARD_MIB, nodes=1, nproc=1)
    runs = {}
    for name, (model, extra) in CARD_RUNS.items():
        done = _render(inventory, tmp / name, model, extra)
        assert done.returncode == 0, f"rendering {name} failed:\n{done.stdout[-3000:]}"
        (runs[name],) = (tmp / name / model / "n1").glob("train-*")
    return runs


@pytest.fixture(scope="session")
def verdicts(
    rendered: dict[tuple[str, str], Path], card_rendered: dict[str, Path]
) -> dict[str, dict[str, str]]:
    """Parse every rendered run directory in the training venv, in one process."""
    if not TRAIN_PYTHON.exists():
        pytest.skip(f"no training venv at {TRAIN_PYTHON}: run scripts/setup-train-venv.sh")
    runs = [*rendered.values(), *card_rendered.values()]
    done = subprocess.run(
        [str(TRAIN_PYTHON), str(ROOT / "tests/support/parse_configs.py"), *map(str, runs)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "MASTER_PORT": "29598"},
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("VERDICTS ")]
    assert lines, f"the parser did not run:\n{done.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("VERDICTS "))


@pytest.mark.parametrize(("model", "stage"), PAIRS)
def test_rendered_configs_are_accepted_by_llamafactory_deepspeed_and_accelerate(
    rendered: dict, verdicts: dict, model: str, stage: str
) -> None:
    verdict = verdicts[str(rendered[(model, stage)])]
    assert verdict["train.yaml"] == "ok"
    assert verdict["accelerate.yaml"].startswith("ok")
    if stage.startswith("zero"):
        expected = {"zero0": 0, "zero1": 1, "zero2": 2, "zero2_offload": 2}.get(stage, 3)
        assert verdict["ds_config.json"] == f"ok stage {expected}"
    else:
        assert "ds_config.json" not in verdict
    if stage == "fsdp":
        assert verdict["fsdp_config.json"] == "ok full_shard,auto_wrap"
        assert "FSDP" in verdict["accelerate.yaml"]
    if stage == "hsdp":
        assert verdict["fsdp_config.json"] == "ok hybrid_shard,auto_wrap"
        assert "FSDP" in verdict["accelerate.yaml"]


def test_the_hybrid_stages_shard_over_a_nodes_processes(rendered: dict) -> None:
    # ZeRO++ hpZ: the secondary partition is one node's 8 processes.
    ds = json.loads((rendered[("qwen-7b", "zero3_hpz")] / "ds_config.json").read_text())
    assert ds["zero_optimization"]["zero_hpz_partition_size"] == 8
    assert ds["zero_optimization"]["stage"] == 3
    # HSDP: FSDP's hybrid shard, said in train.yaml, accelerate.yaml and the ranks' environment
    # (accelerate 1.11 takes the strategy from FSDP_SHARDING_STRATEGY alone).
    run = rendered[("qwen-7b", "hsdp")]
    assert yaml.safe_load((run / "train.yaml").read_text())["fsdp"] == "hybrid_shard auto_wrap"
    config = yaml.safe_load((run / "accelerate.yaml").read_text())
    assert config["fsdp_config"]["fsdp_sharding_strategy"] == "HYBRID_SHARD"
    assert (run / "fsdp_config.json").is_file()
    assert not (run / "ds_config.json").exists()


@pytest.mark.parametrize("name", CARD_RUNS)
def test_the_techniques_planned_for_a_24_gib_card_are_accepted_by_llamafactory(
    card_rendered: dict, verdicts: dict, name: str
) -> None:
    run = card_rendered[name]
    assert verdicts[str(run)]["train.yaml"] == "ok"
    config = yaml.safe_load((run / "train.yaml").read_text())
    plan = json.loads((run / "plan.json").read_text())
    assert "deepspeed" not in config  # plain DDP: the techniques keep everything on the GPU
    if name == "full-1.5b":
        assert config["optim"] == "adamw_8bit"
        assert plan["technique"]["numerics_changes"] == ["8-bit AdamW states"]
    else:
        assert (config["quantization_bit"], config["quantization_method"]) == (4, "bnb")
        assert config["finetuning_type"] == "lora"
    assert plan["memory"]["estimate_gib"] <= plan["memory"]["budget_gib"] < CARD_MIB / 1024


@pytest.mark.parametrize("model", MODELS)
def test_train_yaml_reads_like_a_hand_written_file(rendered: dict, model: str) -> None:
    text = (rendered[(model, "zero2")] / "train.yaml").read_text()
    assert text.startswith("#\n# Ansible managed")
    for section in ("### model", "### method", "### dataset", "### output", "### train"):
        assert section in text
    config = yaml.safe_load(text)
    assert config["output_dir"].startswith(str(rendered[(model, "zero2")]))
    assert config["deepspeed"] == str(rendered[(model, "zero2")] / "ds_config.json")
    assert config["overwrite_output_dir"] is False
    assert config["save_on_each_node"] is True
    if config["finetuning_type"] != "lora":
        assert not any(key.startswith("lora_") for key in config), "LoRA keys in a non-LoRA run"


def test_dataset_info_registers_both_demo_formats(rendered: dict) -> None:
    info = json.loads((rendered[("tiny", "zero2")] / "data/dataset_info.json").read_text())
    assert info == {"demo_alpaca": {"file_name": "demo_alpaca.json", "formatting": "alpaca"}}
    assert (rendered[("tiny", "zero2")] / "data/demo_alpaca.json").is_file()


def test_accelerate_config_gives_each_node_its_rank(rendered: dict) -> None:
    config = yaml.safe_load((rendered[("qwen-7b", "fsdp")] / "accelerate.yaml").read_text())
    assert config["machine_rank"] == 0
    assert config["num_machines"] == 2
    assert config["num_processes"] == 16
    # qwen-7b is Qwen2.5-7B-Instruct (group_vars/all/models.yml says why), not Qwen 1's QWenBlock.
    assert config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "Qwen2DecoderLayer"


# templates/deepspeed.json.j2 renders, for every DeepSpeed stage, its ZeRO stage's section of
# roles/run_config/vars/main.yml (read here as the role's data), with what the stage offloads
# and ZeRO++ hpZ's partition, the run's bucket size and overlap setting.

# What every stage shares: transformers fills the "auto" values from train.yaml.
COMMON = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "bf16": {"enabled": "auto"},
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
}
ROLE_VARS = yaml.safe_load((ROOT / "roles/run_config/vars/main.yml").read_text())
DEEPSPEED_STAGES = [stage for stage in Stage if stage.zero is not None]


def expected(stage: Stage, bucket: int, overlap: bool, nproc: int) -> dict[str, Any]:
    """The role's section for the stage, its templated values as they render."""
    values = {
        "{{ run_config_ds_bucket_size | int }}": bucket,
        "{{ run_config_ds_overlap_comm | bool }}": overlap,
        "{{ run_config_plan.nproc_per_node | int }}": nproc,
    }
    zero = dict(ROLE_VARS["__run_config_ds_zero"][stage.zero])
    if stage.offload_optimizer:
        zero.update(ROLE_VARS["__run_config_ds_offload_optimizer"])
    if stage.offload_params:
        zero.update(ROLE_VARS["__run_config_ds_offload_params"])
    if stage.hybrid:
        zero.update(ROLE_VARS["__run_config_ds_hybrid"])
    zero = {key: values.get(value, value) if isinstance(value, str) else value
            for key, value in zero.items()}  # fmt: skip
    return {**COMMON, "zero_optimization": zero}


SETTINGS = [(500000000, False), (200000000, True)]


@pytest.fixture(scope="module", params=SETTINGS, ids=str)
def deepspeed_rendered(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, int, bool]:
    bucket, overlap = request.param
    out = tmp_path_factory.mktemp("ds")
    done = subprocess.run(
        [
            str(ANSIBLE_PLAYBOOK),
            "tests/playbooks/render_deepspeed.yml",
            "-e",
            json.dumps(
                {
                    "render_root": str(out),
                    "run_config_ds_bucket_size": bucket,
                    "run_config_ds_overlap_comm": overlap,
                    "render_nproc": 4,
                    "stages": [stage.properties() for stage in DEEPSPEED_STAGES],
                }
            ),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    return out, bucket, overlap


@pytest.mark.parametrize("stage", DEEPSPEED_STAGES, ids=str)
def test_one_template_renders_each_stage_from_its_zero_section_and_what_it_offloads(
    deepspeed_rendered: tuple[Path, int, bool], stage: Stage
) -> None:
    out, bucket, overlap = deepspeed_rendered
    rendered = json.loads((out / f"{stage}.json").read_text())
    assert rendered == expected(stage, bucket, overlap, 4)
    assert rendered["zero_optimization"]["stage"] == stage.zero
    assert ("offload_optimizer" in rendered["zero_optimization"]) == stage.offload_optimizer
    assert ("offload_param" in rendered["zero_optimization"]) == stage.offload_params


def test_every_deepspeed_stage_has_its_data(deepspeed_rendered: tuple[Path, int, bool]) -> None:
    out, _, _ = deepspeed_rendered
    stages = sorted(p.stem for p in out.glob("*.json"))
    assert stages == [
        *("zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_hpz", "zero3_offload")
    ]
    # The cost model's ZeRO-3 reuse distance and bucket size are the role's (planner/cost.py).
    zero3 = ROLE_VARS["__run_config_ds_zero"][3]
    assert zero3["stage3_max_reuse_distance"] == cost.ZERO3_REUSE_DISTANCE
    defaults = yaml.safe_load((ROOT / "roles/run_config/defaults/main.yml").read_text())
    assert defaults["run_config_ds_bucket_size"] == cost.COMMUNICATION["ds_bucket_bytes"]


# -- The run_config_files filter, which feeds llama_files (tests/unit/roles/test_llama_files.py)
# the run
# directory's texts.


def test_run_config_files_skips_unused_configurations_and_ends_texts_with_a_newline() -> None:
    files = run_files({"train.yaml": "a: 1", "ds_config.json": "", "plan.json": "{}\n"}, "/r")
    assert files == [
        {"path": "/r/train.yaml", "content": "a: 1\n", "json": False},
        {"path": "/r/plan.json", "content": "{}\n", "json": True},
    ]
