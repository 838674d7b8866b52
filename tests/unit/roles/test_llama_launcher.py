"""roles/run_config/files/llama_launcher.py's trainer callback in a real LLaMA-Factory run (the
controller's training venv, the nodes' stack): two ranks under torchrun on the CPU train the tiny
model, save a checkpoint every 2 steps and evaluate every 3. Every checkpoint is whole by
llama-job's rule (its marker written after the files were synced), the Trainer's own rotation is
off (llama-job rotates by the declared save_total_limit), rank 0 said when it saved and
evaluated, and every rank when it reached the last step."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import checkpoints, whole
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.saves import finished

ROOT = Path(__file__).resolve().parents[3]
LAUNCHER = ROOT / "roles/run_config/files/llama_launcher.py"
TRAIN_BIN = Path(
    os.environ.get("LLAMA_CLUSTER_TRAIN_PYTHON", "/var/cache/llama-cluster/venv-train/bin/python")
).parent
# Each rank runs the launcher's own main(), its mark writer also keeping every mark in a
# history (the activity file is rewritten, so the test would see only its last state).
RANK = f"""
import json, os, runpy, sys
launcher = runpy.run_path({str(LAUNCHER)!r}, run_name="llama_launcher")["main"].__globals__
write_mark = launcher["write_mark"]
def kept(name, record):
    write_mark(name, record)
    with open(os.path.join(os.environ["LLAMA_JOB_MARKS"], "history.jsonl"), "a") as out:
        out.write(json.dumps({{"name": name, **record}}) + "\\n")
launcher["write_mark"] = kept
launcher["main"]()
"""
pytestmark = pytest.mark.skipif(
    not (TRAIN_BIN / "torchrun").exists(), reason=f"no training venv at {TRAIN_BIN.parent}"
)


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 6 steps: checkpoints 2, 4 and 6 with save_total_limit 1, evaluations at 3, 6."""
    run = tmp_path_factory.mktemp("run")
    model = run / "tiny"
    made = subprocess.run(
        [sys.executable, str(ROOT / "scripts/make_tiny_model.py"), str(model), "--hidden=16"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    (run / "data").mkdir()
    (run / "data/demo.json").write_text((ROOT / "data/demo_alpaca.json").read_text())
    (run / "data/dataset_info.json").write_text(json.dumps({"demo": {"file_name": "demo.json"}}))
    config = {
        "model_name_or_path": str(model), "stage": "sft", "do_train": True,
        "finetuning_type": "full", "template": "qwen", "dataset": "demo",
        "dataset_dir": str(run / "data"), "cutoff_len": 64, "output_dir": str(run / "output"),
        "per_device_train_batch_size": 1, "max_steps": 6, "save_steps": 2, "save_total_limit": 1,
        "save_on_each_node": True, "logging_steps": 1, "report_to": "none", "use_cpu": True,
        "val_size": 0.3, "eval_strategy": "steps", "eval_steps": 3,
        "per_device_eval_batch_size": 1, "dataloader_num_workers": 0, "ddp_timeout": 300,
    }  # fmt: skip
    (run / "train.yaml").write_text(json.dumps(config))
    (run / "rank.py").write_text(RANK)
    (run / "marks").mkdir()
    env = {
        **os.environ, "PATH": f"{TRAIN_BIN}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1", "LLAMA_JOB_MARKS": str(run / "marks"), "FORCE_TORCHRUN": "1",
    }  # fmt: skip
    done = subprocess.run(
        [str(TRAIN_BIN / "torchrun"), "--nnodes=1", "--nproc_per_node=2",
         f"--master_port={_port()}", str(run / "rank.py"), str(run / "train.yaml")],
        cwd=run, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return run


def test_every_checkpoint_is_whole_and_marked_after_its_files_were_synced(trained: Path) -> None:
    output = trained / "output"
    entries = checkpoints.listing(str(output))
    assert [e["path"].rsplit("/", 1)[1] for e in entries if e["isdir"]] == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
    ]
    assert all("problem" not in e for e in entries), entries
    marker = json.loads((output / "checkpoint-6" / whole.MARKER).read_text())
    assert {"optimizer.pt", "rng_state_0.pth", "rng_state_1.pth", "model.safetensors"} <= set(
        marker["files"]
    )


def test_the_trainers_rotation_is_off_and_llama_job_rotates_by_the_declared_limit(
    trained: Path,
) -> None:
    # save_total_limit 1: the Trainer would have kept checkpoint-6 alone; llama-job's agent
    # rotates instead, once the newer ones are whole.
    declared = json.loads((trained / "output" / whole.MARKERS).read_text())
    assert declared["save_total_limit"] == 1
    assert checkpoints.rotation(str(trained / "output"), nodes=1) == [
        "checkpoint-2",
        "checkpoint-4",
    ]


def test_rank_0_says_when_it_saves_and_evaluates_and_every_rank_when_it_finished(
    trained: Path,
) -> None:
    history = [json.loads(x) for x in (trained / "marks/history.jsonl").read_text().splitlines()]
    said = [(h["what"], h["step"]) for h in history if h["name"] == "activity.json"]
    for step in (2, 4):
        assert ("saving", step) in said
        assert said[said.index(("saving", step)) + 1] == ("training", step)
    assert ("evaluating", 3) in said
    assert said[-1] == ("training", 6)
    assert finished(str(trained / "marks"), [0, 1], str(trained / "output")) == (
        "every rank reached the last step (6) and checkpoint-6 is whole"
    )
