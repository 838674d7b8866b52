"""Serving, services and tracking decisions (filter/serve.py, tracking.py), case by case, and
bad requests to serve.yml, tensorboard.yml and train.yml's trackers refused on the controller
before any node is contacted (the inventory's TEST-NET addresses answer nothing, so a request that
got past the checks would fail on "unreachable" instead of the message asserted here).

The lab proves the rest end to end: molecule/train/tests/test_serve.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.filter.serve import (
    ServeError,
    controller_address,
    export_request,
    serve_api_key_source,
    serve_backend,
    serve_model,
    serve_request,
    service_listen_address,
    service_request,
    service_sources,
    service_url_host,
    url,
)
from ansible_collections.llama.cluster.plugins.filter.tracking import (
    tracking_plan,
    tracking_train_args,
)

from tests.support.playbooks import _inventory, _node, _train

CATALOGUE = {
    "tiny": {"path": "/opt/llama-cluster/models/tiny", "template": "qwen"},
    "qwen-7b": {"path": "Qwen/Qwen2.5-7B-Instruct", "template": "qwen"},
}
RESERVED = {"master_port": 29500, "watchdog_port": 29499}
RUN = {
    "run_id": "train-20261201-100000-tiny",
    "run_dir": "/opt/llama-cluster/runs/train-20261201-100000-tiny",
    "plan": {
        "model": {
            "path": "/opt/llama-cluster/models/tiny",
            "template": "qwen",
            "finetuning_type": "lora",
        }
    },
}


def _ask(**given: object) -> dict:
    asked = {"state": "present", "port": 8000, "backend": "auto", "sources": [], "max_restarts": 3}
    asked.update(given)
    return serve_request(asked, CATALOGUE, RESERVED)


# ---------------------------------------------------------------------------------------------
# The request
# ---------------------------------------------------------------------------------------------
def test_nothing_named_serves_the_latest_run():
    request = _ask()
    assert (request["source"], request["run_id"], request["port"]) == ("run", "", 8000)


def test_a_catalogue_model_and_an_export_directory_are_sources_of_their_own():
    assert _ask(model="tiny")["source"] == "model"
    assert _ask(export_dir="/data/m", model_template="qwen")["source"] == "dir"


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"port": 70000}, "serve_port=70000: a TCP port"),
        ({"port": 29500}, "serve_port=29500 is master_port"),
        ({"backend": "sglang"}, "serve_backend='sglang': use auto, huggingface, vllm"),
        ({"sources": ["10.0.0.0/8", "lab-host"]}, "serve_sources lab-host: write 'any'"),
        ({"sources": "10.0.0.1"}, "serve_sources must be a list"),
        ({"max_restarts": -1}, "serve_max_restarts=-1"),
        ({"state": "stopped"}, "serve_state='stopped': use present (start) or absent (stop)"),
        ({"run_id": "r", "model": "tiny"}, "-e run_id and -e model: serve one thing"),
        ({"model": "tiny", "merged": "true"}, "-e merged and -e checkpoint pick a run's model"),
        ({"checkpoint": "500"}, "checkpoint='500': write checkpoint-<step>"),
        ({"checkpoint": "checkpoint-5/../../x"}, "write checkpoint-<step>"),
        ({"run_id": "../../etc"}, "run_id='../../etc': a run's id (letters, digits"),
        ({"export_dir": "models/m", "model_template": "qwen"}, "an absolute path"),
        ({"export_dir": "/data/../etc", "model_template": "qwen"}, "without '.' or '..' parts"),
        ({"export_dir": "/data/m"}, "-e export_dir needs -e model_template"),
        ({"model": "llama-9"}, "Unknown model 'llama-9'. Known models: qwen-7b, tiny"),
    ],
)
def test_a_bad_request_is_refused_naming_the_fix(given, message):
    with pytest.raises(ServeError, match="Nothing was changed") as refused:
        _ask(**given)
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"run_id": "train-1-x/../.."}, "run_id='train-1-x/../..': a run's id"),
        ({"run_id": ".."}, "run_id='..': a run's id"),
        ({"checkpoint": "../../../etc"}, "checkpoint='../../../etc': write checkpoint-<step>"),
        ({"export_dir": "/"}, "export_dir='/': an absolute path on the node, not /"),
        ({"export_dir": "merged"}, "export_dir='merged': an absolute path"),
        ({"export_dir": "/opt/x/../../etc"}, "without '.' or '..' parts"),
        ({"export_dir": "/data/./m"}, "without '.' or '..' parts"),
        ({"export_dir": "//data/m"}, "export_dir='//data/m'"),
        ({"export_dir": "/data/m\nx"}, "export_dir='/data/m\\nx'"),
    ],
)
def test_export_refuses_values_that_would_be_paths_outside_their_place(given, said):
    with pytest.raises(ServeError, match="Cannot export") as refused:
        export_request(given)
    assert said in str(refused.value)
    assert "Nothing was changed on any node" in str(refused.value)


def test_export_takes_a_run_a_checkpoint_and_a_plain_directory():
    asked = {"run_id": "train-20261201-100000-tiny", "checkpoint": "checkpoint-500"}
    assert export_request({**asked, "export_dir": "/data/models/mine/"}) == {
        **asked,
        "export_dir": "/data/models/mine/",
    }
    assert export_request({}) == {"run_id": "", "checkpoint": "", "export_dir": ""}


def test_every_problem_is_listed_at_once():
    with pytest.raises(ServeError) as refused:
        _ask(port="x", backend="tgi", model="llama-9")
    assert str(refused.value).count("\n- ") == 3


def test_stopping_needs_only_a_port():
    request = _ask(state="absent", model="llama-9", backend="tgi")
    assert (request["state"], request["port"]) == ("absent", 8000)
    with pytest.raises(ServeError, match="Cannot stop serving"):
        _ask(state="absent", port=0)


def test_a_plain_service_request_names_its_own_variables():
    asked = {"state": "present", "port": 6006, "sources": []}
    assert service_request(asked, RESERVED, "tensorboard")["port"] == 6006
    with pytest.raises(ServeError, match="tensorboard_port=29499 is watchdog_port"):
        service_request({**asked, "port": 29499}, RESERVED, "tensorboard")


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
def test_a_lora_run_serves_its_base_model_with_the_adapter():
    model = serve_model(_ask(), CATALOGUE, RUN)
    assert model["path"] == "/opt/llama-cluster/models/tiny"
    assert model["adapter"] == f"{RUN['run_dir']}/output"
    assert (model["template"], model["name"]) == ("qwen", RUN["run_id"])
    assert model["must_exist"] == [
        "/opt/llama-cluster/models/tiny/config.json",
        f"{RUN['run_dir']}/output/adapter_config.json",
    ]


def test_a_checkpoint_and_the_merged_export_are_served_from_the_run_directory():
    checkpoint = serve_model(_ask(checkpoint="checkpoint-5"), CATALOGUE, RUN)
    assert checkpoint["adapter"] == f"{RUN['run_dir']}/output/checkpoint-5"
    merged = serve_model(_ask(merged=True), CATALOGUE, RUN)
    assert (merged["path"], merged["adapter"]) == (f"{RUN['run_dir']}/merged", "")
    assert merged["name"] == f"{RUN['run_id']}-merged"
    assert merged["must_exist"] == [f"{RUN['run_dir']}/merged/config.json"]


def test_a_full_fine_tune_serves_its_own_output_and_has_nothing_merged():
    full = {**RUN, "plan": {"model": {**RUN["plan"]["model"], "finetuning_type": "full"}}}
    model = serve_model(_ask(), CATALOGUE, full)
    assert (model["path"], model["adapter"]) == (f"{RUN['run_dir']}/output", "")
    with pytest.raises(ServeError, match="fine-tuned full, not LoRA: nothing was merged"):
        serve_model(_ask(merged=True), CATALOGUE, full)


def test_a_catalogue_model_may_be_a_hub_id_and_keeps_its_template():
    model = serve_model(_ask(model="qwen-7b"), CATALOGUE)
    assert (model["path"], model["template"], model["local"]) == (
        "Qwen/Qwen2.5-7B-Instruct",
        "qwen",
        False,
    )
    assert model["must_exist"] == []
    named = serve_model(_ask(model="tiny"), CATALOGUE, name="assistant")
    assert named["name"] == "assistant"


def test_an_export_directory_is_served_with_the_template_given():
    model = serve_model(_ask(export_dir="/data/m/", model_template="qwen"), CATALOGUE)
    assert (model["path"], model["template"], model["name"]) == ("/data/m/", "qwen", "m")


# ---------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("requested", "accelerator", "vllm", "backend"),
    [
        ("auto", "cpu", "", "huggingface"),
        ("auto", "cpu", "0.20.2", "huggingface"),
        ("auto", "nvidia", "0.20.2", "vllm"),
        ("auto", "nvidia", "", "huggingface"),
        ("huggingface", "nvidia", "0.20.2", "huggingface"),
        ("vllm", "nvidia", "0.20.2", "vllm"),
    ],
)
def test_the_backend_follows_the_accelerator_and_what_is_installed(
    requested, accelerator, vllm, backend
):
    assert serve_backend(requested, accelerator, vllm)["backend"] == backend


def test_vllm_is_refused_on_a_cpu_node_and_where_it_is_not_installed():
    with pytest.raises(ServeError, match="CPU-only"):
        serve_backend("vllm", "cpu", "0.20.2")
    with pytest.raises(ServeError, match="add vllm to llamafactory_extras"):
        serve_backend("vllm", "nvidia", "")
    assert "add vllm to llamafactory_extras" in serve_backend("auto", "nvidia", "")["reason"]


# ---------------------------------------------------------------------------------------------
# Who may reach a service, and where
# ---------------------------------------------------------------------------------------------
def test_the_default_sources_are_the_nodes_and_the_controller():
    sources = service_sources([], ["10.0.0.1", "10.0.0.2", "10.0.0.1"], "10.0.0.9")
    assert sources == ["10.0.0.1", "10.0.0.2", "10.0.0.9"]
    assert service_sources(["192.168.0.0/24"], ["10.0.0.1"], "10.0.0.9") == ["192.168.0.0/24"]
    assert service_sources([], ["10.0.0.1"], "") == ["10.0.0.1"]
    with pytest.raises(ServeError, match="set serve_sources"):
        service_sources([], [], "")


def test_the_controller_is_where_the_node_sees_its_ssh_come_from_else_its_route():
    assert controller_address("203.0.113.7 52144 10.0.0.1 22", "") == "203.0.113.7"
    route = "172.18.0.3 dev br-1a2b src 172.18.0.1 uid 0 \\    cache"
    assert controller_address("", route) == "172.18.0.1"
    assert controller_address("", "") == ""


def test_services_listen_on_the_cluster_address_and_the_url_follows_it():
    ssh = {"ansible_host": "gpu1.example.org", "cluster_address": "10.1.0.1"}
    assert service_listen_address(ssh) == "10.1.0.1"
    # The URL is where the service listens, not where SSH connects.
    assert service_url_host(ssh) == "10.1.0.1"
    docker = {"ansible_connection": "community.docker.docker", "cluster_address": "172.18.0.3"}
    assert service_url_host(docker) == "172.18.0.3"
    # service_address: an address that leads there (NAT), where the controller reaches it.
    assert service_url_host({**ssh, "service_address": "public.example.org"}) == (
        "public.example.org"
    )
    assert service_listen_address({**ssh, "service_address": "public.example.org"}) == "10.1.0.1"


@pytest.mark.parametrize("address", ["", "0.0.0.0", "::", None])
def test_a_node_without_a_cluster_address_is_refused_not_opened_to_every_interface(address):
    node = {"inventory_hostname": "gpu1", "cluster_address": address}
    with pytest.raises(ServeError, match="gpu1 has no cluster_address"):
        service_listen_address(node)


def test_a_given_api_key_is_used_and_never_printed():
    chosen = serve_api_key_source(True, False, "/home/me/.cache/llama-cluster/serve_api_key")
    assert chosen["source"] == "given"
    assert chosen["show"] is False
    assert chosen["hint"] == "Authorization: Bearer $LLAMA_SERVE_API_KEY"


def test_without_a_key_one_is_generated_and_shown_once_then_read_from_its_file():
    key_file = "/home/me/.cache/llama-cluster/serve_api_key"
    first = serve_api_key_source(False, False, key_file)
    assert (first["source"], first["show"]) == ("new", True)
    assert key_file in first["note"]
    later = serve_api_key_source(False, True, key_file)
    assert (later["source"], later["show"]) == ("file", False)
    assert later["hint"] == f"Authorization: Bearer $(cat {key_file})"
    assert url("172.18.0.3", 8000) == "http://172.18.0.3:8000"
    assert url("fd00::3", 8000) == "http://[fd00::3]:8000"


# ---------------------------------------------------------------------------------------------
# Experiment tracking
# ---------------------------------------------------------------------------------------------
def test_no_tracker_by_default():
    plan = tracking_plan("none")
    assert (plan["report_to"], plan["modules"], plan["secret_names"]) == ("none", {}, [])


def test_tensorboard_needs_its_package_and_no_key():
    plan = tracking_plan("tensorboard")
    assert (plan["report_to"], plan["modules"]) == ("tensorboard", {"tensorboard": "tensorboard"})


def test_several_trackers_keep_only_their_own_keys():
    given = ["WANDB_API_KEY", "SWANLAB_API_KEY", "MLFLOW_TRACKING_TOKEN"]
    plan = tracking_plan("wandb, mlflow", {"WANDB_PROJECT": "p"}, given)
    assert plan["report_to"] == ["wandb", "mlflow"]
    assert plan["secret_names"] == ["MLFLOW_TRACKING_TOKEN", "WANDB_API_KEY"]
    assert plan["environment"] == {"WANDB_PROJECT": "p"}
    assert plan["modules"] == {"wandb": "wandb", "mlflow": "mlflow-skinny"}


def test_a_tracker_without_its_key_is_refused_unless_it_logs_offline():
    with pytest.raises(ServeError, match="report_to=wandb needs WANDB_API_KEY"):
        tracking_plan("wandb")
    assert tracking_plan("wandb", {"WANDB_MODE": "offline"})["secret_names"] == []
    with pytest.raises(ServeError, match="report_to=swanlab needs SWANLAB_API_KEY"):
        tracking_plan(["swanlab"])
    assert tracking_plan("swanlab", {"SWANLAB_MODE": "local"})["trackers"] == ["swanlab"]


def test_a_key_among_the_settings_and_an_unknown_tracker_are_refused():
    with pytest.raises(ServeError, match="tracking_environment holds WANDB_API_KEY"):
        tracking_plan("tensorboard", {"WANDB_API_KEY": "k"})
    with pytest.raises(ServeError, match="report_to comet"):
        tracking_plan("comet")


def test_tensorboard_true_adds_tensorboard_to_report_to():
    assert tracking_plan("none", tensorboard="true")["report_to"] == "tensorboard"
    assert tracking_train_args({}, "", True) == {"report_to": "tensorboard"}
    assert tracking_train_args({"report_to": "wandb"}, "", True)["report_to"] == [
        "wandb",
        "tensorboard",
    ]
    assert tracking_train_args({"lr": 1}, "mlflow", False) == {"lr": 1, "report_to": "mlflow"}
    assert tracking_train_args({"report_to": "none"}, "", False) == {"report_to": "none"}


def test_train_args_that_are_no_mapping_are_left_to_the_planner():
    # train.yml's planner names the problem ("train_args must be a mapping"); no filter traceback.
    assert tracking_train_args("fast", "wandb", True) == "fast"
    assert tracking_train_args(None, "", False) == {}


# ---------------------------------------------------------------------------------------------
# The playbooks refuse on the controller
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("playbook", "extra", "message"),
    [
        ("playbooks/serve.yml", ["-e", "serve_port=29500"], "serve_port=29500 is master_port"),
        ("playbooks/serve.yml", ["-e", "model=llama-9"], "Unknown model 'llama-9'"),
        ("playbooks/serve.yml", ["-e", "serve_node=c"], "serve_node=c is not a host of"),
        (
            "playbooks/tensorboard.yml",
            ["-e", "tensorboard_port=29499"],
            "tensorboard_port=29499 is watchdog_port",
        ),
        ("train.yml", ["-e", "model=tiny", "-e", "report_to=wandb"], "needs WANDB_API_KEY"),
        ("train.yml", ["-e", "model=tiny", "-e", "report_to=comet"], "report_to comet"),
        (
            "playbooks/export.yml",
            ["-e", "checkpoint=../../../../etc/cron.d/x", "-e", "export_dir=/"],
            "Cannot export: - checkpoint='../../../../etc/cron.d/x': write checkpoint-<step> - "
            "export_dir='/': an absolute path on the node, not /",
        ),
    ],
)
def test_a_bad_request_fails_before_any_node_is_contacted(tmp_path, playbook, extra, message):
    nodes = _inventory(tmp_path, {"a": _node("192.0.2.1")}, {"b": _node("192.0.2.2")})
    rc, out = _train(nodes, *extra, playbook=playbook)
    assert rc != 0, out[-2000:]
    assert message in out, out[-2000:]
    assert "UNREACHABLE" not in out


ROOT = Path(__file__).resolve().parents[3]
KEY_PLAYBOOK = """
- name: Choose the serving key on the controller
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Run the serve role's key tasks
      ansible.builtin.include_role:
        name: serve
        tasks_from: api_key
    - name: Keep what was chosen, for the test
      ansible.builtin.copy:
        dest: "{{ out }}"
        content: "{{ {'plan': __serve_key, 'key': __serve_api_key} | to_json }}"
        mode: "0600"
      no_log: true
"""


def _choose_key(tmp_path: Path, key_file: Path, given: str = "") -> dict:
    playbook = tmp_path / "key.yml"
    playbook.write_text(KEY_PLAYBOOK)
    out = tmp_path / "chosen.json"
    env = {**os.environ, "LLAMA_SERVE_API_KEY": given, "ANSIBLE_NOCOLOR": "1"}
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("ansible-playbook")),
            str(playbook),
            "-e",
            f"out={out} serve_api_key_file={key_file}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    chosen = json.loads(out.read_text())
    assert chosen["key"] not in done.stdout  # the key tasks print nothing of it
    return chosen


def test_the_serving_key_is_generated_once_0600_on_the_controller_and_reused(tmp_path: Path):
    key_file = tmp_path / "cache" / "serve_api_key"
    first = _choose_key(tmp_path, key_file)
    assert first["plan"]["source"] == "new"
    assert first["plan"]["show"] is True
    assert len(first["key"]) == 40
    assert first["key"].isalnum()
    assert key_file.read_text().strip() == first["key"]
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert key_file.parent.stat().st_mode & 0o777 == 0o700
    again = _choose_key(tmp_path, key_file)
    assert again["plan"]["source"] == "file"
    assert again["plan"]["show"] is False
    assert again["key"] == first["key"]
    given = _choose_key(tmp_path, tmp_path / "unused", given="my-own-key-123")
    assert given["plan"]["source"] == "given"
    assert given["key"] == "my-own-key-123"
    assert not (tmp_path / "unused").exists()
