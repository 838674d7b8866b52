"""The action that plans a new run (llama.cluster.run_plan), in the pieces that
tests/test_train_validation.py does not reach: its argument spec, the dataset list, the hub's
answer and where the token may go (a stand-in hub on 127.0.0.1), a model on shared storage read
from the master, and the tiny model generated once.

The playbook runs use TEST-NET nodes (192.0.2.0/24) that nothing answers: train.yml's first play
and the action run on the controller only.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from ansible_collections.llama.cluster.plugins.action import run_plan as action
from ansible_collections.llama.cluster.plugins.module_utils.planner.model import (
    model_stage_token_policy,
)

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
NODE = '{"ansible_host": "%s", "cluster_accelerator": "cpu", "nproc_per_node": 1}'
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_secretsecretsecret0123456789"
CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 400,
    "tie_word_embeddings": True,
}
CATALOGUE = {"demo_alpaca": {"file": "data/demo_alpaca.json", "formatting": "alpaca"}}
FORMATS = {"alpaca": {"formatting": "alpaca"}, "sharegpt": {"formatting": "sharegpt"}}


# ---- pieces --------------------------------------------------------------------------------
def test_the_argument_spec_is_the_documented_options() -> None:
    spec = action.option_spec(action.DOCUMENTATION)
    assert spec["model"] == {"type": "str", "default": ""}
    assert spec["model_shared"] == {"type": "bool", "default": False}
    assert spec["train_args"] == {"type": "raw", "default": {}}
    assert spec["deepspeed"] == {"type": "str"}  # absent: training_deepspeed
    assert spec["probe_model"] == {"type": "bool", "default": True}


def _asked(dataset: str = "", dataset_file: str = "", dataset_format: str = "alpaca") -> dict:
    return {"dataset": dataset, "dataset_file": dataset_file, "dataset_format": dataset_format}


def test_the_dataset_list_is_the_catalogue_entries_then_the_users_file() -> None:
    listed = action.dataset_list(
        _asked(" demo_alpaca ,", "/data/mine.json", "sharegpt"), CATALOGUE, FORMATS, "x"
    )
    assert listed == [
        {"file": "data/demo_alpaca.json", "formatting": "alpaca", "name": "demo_alpaca"},
        {"formatting": "sharegpt", "name": "user_data", "file": "/data/mine.json"},
    ]
    assert action.dataset_list(_asked(), CATALOGUE, FORMATS, "demo_alpaca")[0]["name"] == (
        "demo_alpaca"
    )
    # A file of one's own replaces the default dataset.
    only = action.dataset_list(_asked("", "/data/mine.json"), CATALOGUE, FORMATS, "demo_alpaca")
    assert [d["name"] for d in only] == ["user_data"]


def test_an_unknown_dataset_or_format_is_refused_with_what_is_known() -> None:
    with pytest.raises(action.Refused, match=r"Unknown dataset nope\. Known datasets: demo_alpaca"):
        action.dataset_list(_asked("demo_alpaca,nope"), CATALOGUE, FORMATS, "")
    with pytest.raises(action.Refused, match=r'must be one of alpaca, sharegpt \(got "csv"\)'):
        action.dataset_list(_asked("", "/data/x", "csv"), CATALOGUE, FORMATS, "")


@pytest.mark.parametrize(
    ("hub", "endpoint", "to_any", "sent"),
    [
        ("huggingface", "https://huggingface.co", False, True),
        ("huggingface", "https://HuggingFace.co:443/", False, True),
        ("huggingface", "https://hf-mirror.com", False, False),
        ("huggingface", "https://huggingface.co.evil.example", False, False),
        ("huggingface", "https://hf-mirror.com", True, True),
        ("modelscope", "https://www.modelscope.cn", False, True),
    ],
)
def test_the_hugging_face_token_goes_to_huggingface_co_only_unless_allowed(
    hub: str, endpoint: str, to_any: bool, sent: bool
) -> None:
    # The action and the nodes' token files follow the one policy (module_utils/planner/model.py).
    assert model_stage_token_policy(hub, endpoint, True, to_any)["send"] is sent


def test_a_config_that_is_not_a_models_is_refused_naming_the_file() -> None:
    request = {"name": "m", "source": "/data/m"}
    assert action.parse_config('{"model_type": "x"}', request) == {"model_type": "x"}
    with pytest.raises(action.Refused, match=r"/data/m/config.json is not valid JSON"):
        action.parse_config("{", request)
    with pytest.raises(action.Refused, match="not a JSON object, so not a model configuration"):
        action.parse_config("[1]", request)


# ---- a stand-in hub on 127.0.0.1 -----------------------------------------------------------
class _Hub(BaseHTTPRequestHandler):
    """config.json of one repo, as the Hugging Face Hub answers /<repo>/resolve/<rev>/...:
    with X-Repo-Commit, or 404 with X-Error-Code for anything else."""

    seen: ClassVar[list[tuple[str, str]]] = []

    def log_message(self, *_: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("Authorization", "")))
        if self.path == "/org/mine/resolve/main/config.json":
            body, status = json.dumps(CONFIG).encode(), 200
            headers = {"X-Repo-Commit": COMMIT}
        else:
            body, status, headers = b"{}", 404, {"X-Error-Code": "RepoNotFound"}
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def hub() -> Iterator[str]:
    _Hub.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_hubs_answer_is_shaped_as_the_uri_module_registers_it(hub: str) -> None:
    found = action.hub_answer(f"{hub}/org/mine/resolve/main/config.json", {}, 5, "")
    assert (found["status"], found["x_repo_commit"]) == (200, COMMIT)
    assert json.loads(found["content"]) == CONFIG
    missing = action.hub_answer(f"{hub}/org/absent/resolve/main/config.json", {}, 5, "")
    assert (missing["status"], missing["x_error_code"]) == (404, "RepoNotFound")
    closed = action.hub_answer("http://127.0.0.1:9/x", {}, 5, "")
    assert closed["status"] == -1
    assert closed["msg"].startswith("Request failed: ")


# ---- through train.yml's first play, on the controller -------------------------------------
def _inventory(tmp: Path) -> Path:
    path = tmp / "inventory.yml"
    path.write_text(
        "all:\n  children:\n    cluster:\n      children:\n"
        f"        master:\n          hosts:\n            a: {NODE % '192.0.2.1'}\n"
        f"        workers:\n          hosts:\n            b: {NODE % '192.0.2.2'}\n"
    )
    return path


def _playbook(tmp: Path, playbook: str | Path, *extra: str) -> tuple[int, str]:
    done = subprocess.run(
        # The runs train.yml plans are claimed (made) under the test's own directory.
        [
            *(str(ANSIBLE_PLAYBOOK), "-i", str(_inventory(tmp)), str(playbook)),
            *("-e", f"controller_runs_dir={tmp / 'runs'}", *extra),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={"ANSIBLE_NOCOLOR": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp)},
    )
    return done.returncode, done.stdout + done.stderr


def _plan_only(tmp: Path, *extra: str) -> tuple[int, str]:
    """train.yml's first play alone (the others are tagged train): -v shows every result. Its
    nodes answer nothing, so the plan is made from their facts (no read of what they hold)."""
    return _playbook(
        tmp, "train.yml", "--tags", "none", "-v", "-e", "plan_free_memory=false", *extra
    )


@pytest.mark.parametrize("to_endpoint", [False, True])
def test_a_hub_model_is_asked_for_once_and_the_token_never_shows(
    tmp_path: Path, hub: str, to_endpoint: bool
) -> None:
    extra = ["-e", "model=mine", "-e", "model_path=org/mine", "-e", "model_template=qwen"]
    extra += ["-e", f"hf_endpoint={hub}", "-e", f"hf_token={TOKEN}"]
    extra += ["-e", f"hf_token_to_endpoint={str(to_endpoint).lower()}"]
    rc, out = _plan_only(tmp_path, *extra)
    assert rc == 0, out[-3000:]
    assert _Hub.seen == [
        ("/org/mine/resolve/main/config.json", f"Bearer {TOKEN}" if to_endpoint else "")
    ]
    assert TOKEN not in out
    said = " ".join(out.split())
    assert f"org/mine from {hub} (huggingface), revision main = commit 0123456789ab" in said
    # The plan reads the model where every node will have it: the hub cache, at the commit.
    path = f"/opt/llama-cluster/models/hub/huggingface/org--mine/{COMMIT}"
    assert f"mine ({path}), lora" in said
    # The size is counted from the config.json the hub returned.
    assert "(counted from config.json)" in said


def test_a_model_the_hub_lacks_fails_naming_it_and_nothing_follows(
    tmp_path: Path, hub: str
) -> None:
    extra = ["-e", "model=mine", "-e", "model_path=org/absent", "-e", f"hf_endpoint={hub}"]
    rc, out = _plan_only(tmp_path, *extra)
    said = " ".join(out.split())
    assert rc != 0
    assert f"Model mine: (org/absent, revision main, at {hub}) the hub has no model org/absent" in (
        said
    )
    assert "Keep the plan" not in said


def _call(tmp: Path, args: dict[str, object]) -> tuple[int, str]:
    """The action alone, in a playbook of its own on localhost; prints its result as JSON."""
    playbook = tmp / "plan.yml"
    task = {"llama.cluster.run_plan": args, "register": "planned", "name": "Plan"}
    show = {"ansible.builtin.debug": {"msg": "RESULT {{ planned | to_json }}"}, "name": "Show"}
    play = {"hosts": "localhost", "gather_facts": False, "tasks": [task, show]}
    playbook.write_text(json.dumps([play]))
    return _playbook(tmp, playbook)


def _result(out: str) -> dict:
    found = re.search(r"RESULT (\{.*\})", " ".join(out.split()))
    assert found, out[-3000:]
    return json.loads(found.group(1))


def test_a_shared_model_the_controller_does_not_mount_is_read_from_the_masters_copy(
    tmp_path: Path,
) -> None:
    slurped = base64.b64encode(json.dumps(CONFIG).encode()).decode()
    asked = {"model": "mine", "model_path": "/mnt/nowhere/mine", "model_template": "qwen"}
    rc, out = _call(tmp_path, {**asked, "model_shared": True, "shared_config": slurped})
    assert rc == 0, out[-3000:]
    staged = _result(out)["plan"]["model_stage"]
    assert (staged["kind"], staged["path"]) == ("shared", "/mnt/nowhere/mine")
    assert "config" not in staged
    # Without the master's copy, the refusal names the master.
    rc, out = _call(tmp_path, {**asked, "model_shared": True})
    assert rc != 0
    said = " ".join(out.split())
    assert "/mnt/nowhere/mine/config.json is neither on the controller nor on the master (a)" in (
        said
    )


def test_a_shared_model_not_mounted_here_is_asked_of_the_master_with_ask_master(
    tmp_path: Path,
) -> None:
    # train.yml's first call: the action names the file to read on the master and plans nothing.
    asked = {"model": "mine", "model_path": "/mnt/nowhere/mine", "model_template": "qwen"}
    rc, out = _call(tmp_path, {**asked, "model_shared": True, "ask_master": True})
    assert rc == 0, out[-3000:]
    result = _result(out)
    assert result["read_on_master"] == "/mnt/nowhere/mine/config.json"
    assert "plan" not in result


def test_the_tiny_model_is_generated_on_the_controller_once(tmp_path: Path) -> None:
    rc, out = _call(tmp_path, {"model": "tiny"})
    assert rc == 0, out[-3000:]
    first = _result(out)
    made = tmp_path / ".cache" / "llama-cluster" / "models" / "tiny"
    assert (made / "tiny_model.json").is_file()
    assert first["changed"] is True
    assert first["plan"]["model_stage"]["source"] == str(made)
    assert first["plan"]["model"]["path"] == "/opt/llama-cluster/models/tiny"
    assert first["notes"][0].startswith(f"Model tiny: {made} (generated on the controller)")
    rc, out = _call(tmp_path, {"model": "tiny"})
    assert rc == 0, out[-3000:]
    assert _result(out)["changed"] is False


# ---- the run's id ----------------------------------------------------------------------------
def test_a_run_planned_in_the_same_second_as_another_gets_the_next_free_second(
    tmp_path: Path,
) -> None:
    runs = tmp_path / "runs"
    planned = "train-20261204-235958-qwen-7b"
    assert action.claim_run_id(runs, "20261204-235958", "qwen-7b") == planned
    assert (runs / planned).is_dir()
    # Two more in the same second: each takes the next second that no run holds, across midnight.
    assert action.claim_run_id(runs, "20261204-235958", "qwen-7b") == (
        "train-20261204-235959-qwen-7b"
    )
    assert action.claim_run_id(runs, "20261204-235958", "qwen-7b") == (
        "train-20261205-000000-qwen-7b"
    )
    assert sorted(p.name for p in runs.iterdir()) == [
        planned,
        "train-20261204-235959-qwen-7b",
        "train-20261205-000000-qwen-7b",
    ]


def test_a_minute_of_runs_in_the_way_is_refused_with_what_to_do(tmp_path: Path) -> None:
    for second in range(action.CLAIM_SECONDS):
        (tmp_path / f"train-20261204-1200{second:02d}-tiny").mkdir()
    with pytest.raises(action.Refused, match="start this run again in a minute"):
        action.claim_run_id(tmp_path, "20261204-120000", "tiny")
