"""The action that plans a new run (llama.cluster.run_plan), in the pieces that
tests/unit/planner/test_train_validation.py does not reach: its argument spec, the dataset list,
the hub's
answer and where the token may go (a stand-in hub on 127.0.0.1), a hub the controller cannot
reach (asked from the master, or planned with the catalogue's config), a model on shared storage
read from the master, the tiny model generated once, and train.yml --check (the plan alone).

The playbook runs use TEST-NET nodes (192.0.2.0/24) that nothing answers: train.yml's first play
and the action run on the controller only. Where the master must answer (it asks the hub), it is
this machine (a local connection).
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
from urllib.parse import urlsplit

import pytest
from ansible_collections.llama.cluster.plugins.action import run_plan as action
from ansible_collections.llama.cluster.plugins.module_utils.planner.model import (
    model_stage_token_policy,
)

ROOT = Path(__file__).resolve().parents[3]
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
    spec = action.option_spec()  # plugins/modules/run_plan.py, where ansible-doc reads them
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
        # A proxy is asked for the whole URL: the master reaches the hub through it.
        path = urlsplit(self.path).path
        self.seen.append((path, self.headers.get("Authorization", "")))
        if path == "/org/mine/resolve/main/config.json":
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
def _inventory(
    tmp: Path, master: str = NODE % "192.0.2.1", worker: str = NODE % "192.0.2.2"
) -> Path:
    path = tmp / "inventory.yml"
    path.write_text(
        "all:\n  children:\n    cluster:\n      children:\n"
        f"        master:\n          hosts:\n            a: {master}\n"
        f"        workers:\n          hosts:\n            b: {worker}\n"
    )
    return path


def _gpu_node(**settings: object) -> str:
    """A node with one 24 GiB GPU in its facts (the planner searches stages and batches)."""
    gpus = [{"index": 0, "memory_mib": 24564}]
    facts = {"llama_host": {"gpus": gpus, "gpu_count": 1}}
    node = {"cluster_accelerator": "nvidia", "nproc_per_node": 1, "ansible_local": facts}
    return json.dumps({**node, **settings})


# The master as this machine: the GET it makes for the controller runs here.
LOCAL_MASTER = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}


def _playbook(
    tmp: Path, playbook: str | Path, *extra: str, inventory: Path | None = None
) -> tuple[int, str]:
    done = subprocess.run(
        # The runs train.yml plans are claimed (made) under the test's own directory.
        [
            *(str(ANSIBLE_PLAYBOOK), "-i", str(inventory or _inventory(tmp)), str(playbook)),
            *("-e", f"controller_runs_dir={tmp / 'runs'}", *extra),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={
            "ANSIBLE_NOCOLOR": "1",
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp),
            # set_stats in the recap: what a caller (train_runner.py) would read.
            "ANSIBLE_SHOW_CUSTOM_STATS": "true",
            # A master at a TEST-NET address that drops packets fails in seconds, not in 30.
            "ANSIBLE_TIMEOUT": "5",
            "TMPDIR": str(_scratch(tmp)),
        },
    )
    return done.returncode, done.stdout + done.stderr


def _scratch(tmp: Path) -> Path:
    """The temporary directory of the test's playbook runs (nothing may be left in it)."""
    scratch = tmp / "scratch"
    scratch.mkdir(exist_ok=True)
    return scratch


def _plan_only(tmp: Path, *extra: str) -> tuple[int, str]:
    """train.yml --check (the plan alone: no node play runs); -v shows every result. Its nodes
    answer nothing, so the plan is made from their facts (no read of what they hold)."""
    return _playbook(tmp, "train.yml", "--check", "-v", "-e", "plan_free_memory=false", *extra)


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


# ---- a hub the controller cannot reach -----------------------------------------------------
CLOSED = "http://127.0.0.1:9"  # nothing listens: no answer, at once


def _offline(tmp: Path, *extra: str) -> tuple[int, str]:
    """train.yml --check with a hub that neither the controller nor the master (this machine)
    reaches; GPU nodes, so that the plan searches."""
    inventory = _inventory(tmp, _gpu_node(**LOCAL_MASTER), _gpu_node(ansible_host="192.0.2.2"))
    asked = ("--check", "-e", f"hf_endpoint={CLOSED}", *extra)
    rc, out = _playbook(tmp, "train.yml", *asked, inventory=inventory)
    return rc, " ".join(out.split())


def test_a_catalogue_model_is_planned_with_its_config_when_no_hub_answers(
    tmp_path: Path,
) -> None:
    rc, said = _offline(tmp_path, "-e", "model=qwen2.5-1.5b", "-e", "finetuning_type=full")
    assert rc == 0, said[-3000:]
    # The controller got no answer, so the master was asked; it got none either.
    assert "Ask the hub for the model's config.json from the master" in said
    assert (
        f"Qwen/Qwen2.5-1.5B-Instruct from {CLOSED} (huggingface), revision main, not pinned to a "
        "commit: neither the controller nor the master a gets an answer from the hub (the "
        "master a: [Errno 111] Connection refused); planned with the config that "
        "group_vars/all/models.yml carries" in said
    )
    # What the nodes then download, said as it is: the revision by its name, not one commit.
    path = "/opt/llama-cluster/models/hub/huggingface/Qwen--Qwen2.5-1.5B-Instruct/main"
    assert (
        f"Each node downloads main as the hub serves it when its download starts, into {path}"
        in (said)
    )
    assert "so nodes can hold different commits: -e model_revision=<commit>" in said
    # The plan is the one the hub's config.json would give: the catalogue carries its shape.
    assert "qwen2.5-1.5b (" + path + "), full, 1.54B parameters" in said
    assert "Runner-up: deepspeed=" in said


def test_a_commit_given_as_the_revision_pins_every_node_without_the_hub(tmp_path: Path) -> None:
    rc, said = _offline(tmp_path, "-e", "model=qwen2.5-1.5b", "-e", f"model_revision={COMMIT}")
    assert rc == 0, said[-3000:]
    path = f"/opt/llama-cluster/models/hub/huggingface/Qwen--Qwen2.5-1.5B-Instruct/{COMMIT}"
    assert f"revision {COMMIT} (a commit): neither the controller nor the master a" in said
    assert f"every node that lacks it downloads that commit into {path}" in said
    assert "not pinned" not in said


def test_a_model_outside_the_catalogue_still_needs_the_hub_or_its_size(tmp_path: Path) -> None:
    mine = ("-e", "model=mine", "-e", "model_path=org/mine", "-e", "model_template=qwen")
    rc, said = _offline(tmp_path, *mine)
    assert rc != 0
    assert (
        f"Model mine: (org/mine, revision main, at {CLOSED}) the endpoint is unreachable from the "
        "controller, and from the master a ([Errno 111] Connection refused). Check hf_endpoint"
    ) in said
    assert "Without the hub, -e model_params_b=<billions> plans it from its size." in said
    # A catalogue model's config describes its own path, not another one given with model_path.
    rc, said = _offline(tmp_path, "-e", "model=qwen2.5-1.5b", "-e", "model_path=org/mine")
    assert rc != 0
    assert "the endpoint is unreachable from the controller, and from the master a" in said
    rc, said = _offline(tmp_path, *mine, "-e", "model_params_b=0.5")
    assert rc == 0, said[-3000:]
    assert "planned from the size given (-e model_params_b), without config.json" in said
    assert (
        "mine (/opt/llama-cluster/models/hub/huggingface/org--mine/main), lora, 500M parameters"
        in said
    )


@pytest.mark.parametrize("to_endpoint", [False, True])
def test_the_master_asks_the_hub_the_controller_cannot_reach_and_every_node_gets_its_commit(
    tmp_path: Path, hub: str, to_endpoint: bool
) -> None:
    # The controller cannot resolve the hub's name; the master reaches it through a proxy (the
    # stand-in hub answers proxy requests too), as nodes behind a company proxy do.
    endpoint = "http://hub.invalid"
    proxy = json.dumps({"http_proxy": hub, "HTTP_PROXY": hub})
    master = _gpu_node(**LOCAL_MASTER, hub_download_environment=json.loads(proxy))
    inventory = _inventory(tmp_path, master, _gpu_node(ansible_host="192.0.2.2"))
    extra = ["-e", "model=mine", "-e", "model_path=org/mine", "-e", "model_template=qwen"]
    extra += ["-e", f"hf_endpoint={endpoint}", "-e", f"hf_token={TOKEN}"]
    extra += ["-e", f"hf_token_to_endpoint={str(to_endpoint).lower()}"]
    rc, out = _playbook(tmp_path, "train.yml", "--check", "-v", *extra, inventory=inventory)
    assert rc == 0, out[-3000:]
    # One GET, from the master, with the token only where it may go; the token never shows.
    assert _Hub.seen == [
        ("/org/mine/resolve/main/config.json", f"Bearer {TOKEN}" if to_endpoint else "")
    ]
    assert TOKEN not in out
    said = " ".join(out.split())
    assert (
        f"org/mine from {endpoint} (huggingface), revision main = commit 0123456789ab, downloaded "
        f"once into /opt/llama-cluster/models/hub/huggingface/org--mine/{COMMIT} on every node "
        "that lacks it (the master a asked: the controller cannot reach it)"
    ) in said
    assert "(counted from config.json)" in said


# ---- train.yml --check: the plan, and nothing else ------------------------------------------
def test_train_yml_check_prints_the_plan_and_leaves_nothing_behind(
    tmp_path: Path, hub: str
) -> None:
    inventory = _inventory(
        tmp_path, _gpu_node(ansible_host="192.0.2.1"), _gpu_node(ansible_host="192.0.2.2")
    )
    extra = ["-e", "model=mine", "-e", "model_path=org/mine", "-e", "model_template=qwen"]
    extra += ["-e", "finetuning_type=full", "-e", f"hf_endpoint={hub}"]
    # Its nodes answer nothing (TEST-NET): the plan is made from their facts, not a read.
    extra += ["-e", "plan_free_memory=false"]
    rc, out = _playbook(tmp_path, "train.yml", "--check", *extra, inventory=inventory)
    assert rc == 0, out[-3000:]
    said = " ".join(out.split())
    for line in (
        "Plan only (--check, no run started): mine (",
        "Effective batch ",
        "DeepSpeed: ",
        "Runner-up: deepspeed=",
        "GPU memory planned for: 24.0 GiB per GPU",
        "the go/no-go is not decided: run playbooks/check.yml first",
        "Disk per node: up to ",
        "plan only (--check): nothing was changed",
    ):
        assert line in said, line
    # No node play ran, no run id was published, no run directory claimed, nothing left over.
    for play in ("Prepare every node", "Run"):
        assert f"PLAY [Train | {play}] ********" in out
    assert said.count("skipping: no hosts matched") == 3
    assert "UNREACHABLE" not in said
    published = said[said.index("CUSTOM STATS") :]
    assert "llama_plan" in published
    assert "llama_run_id" not in published
    assert "PREVIEW (" not in said  # the provision preview's block: no node's change to list
    assert not (tmp_path / "runs").exists()
    assert list(_scratch(tmp_path).iterdir()) == []


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


def test_min_nodes_stays_with_the_request_when_the_run_is_planned_again(tmp_path: Path) -> None:
    # train.yml plans a run, then again for what the nodes hold now (replan): the second plan
    # once dropped -e min_nodes, so the run went on without its plan for fewer nodes.
    playbook = tmp_path / "plan.yml"
    first = {"llama.cluster.run_plan": {"model": "tiny", "min_nodes": 1}, "register": "asked"}
    again = {"llama.cluster.run_plan": {"replan": "{{ asked }}"}, "register": "planned"}
    show = {"ansible.builtin.debug": {"msg": "RESULT {{ planned | to_json }}"}}
    playbook.write_text(
        json.dumps([{"hosts": "localhost", "gather_facts": False, "tasks": [first, again, show]}])
    )
    rc, out = _playbook(tmp_path, playbook)
    assert rc == 0, out[-3000:]
    plan = _result(out)["plan"]
    assert plan["min_nodes"] == 1
    assert plan["fewer_nodes"]["1"]["args"][1].startswith("gradient_accumulation_steps=")
