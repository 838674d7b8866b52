"""Every file rendered from a user's or a hub's values is written by a serializer (issue 45): each
YAML and JSON template is rendered with values holding newlines, colons, quotes, `#` and `{{`
(tests/playbooks/render_values.yml, a real ansible-playbook run), and what YAML or JSON parses
back equals what was given. Before, serve.yml wrote model_template and model_path raw into
api.yaml (a newline added `trust_remote_code: true`), and a hub model's layer class reached
accelerate.yaml raw. train.yaml is written by Python (`filter/run_config.py: train_yaml`): the same
values go through it here too."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_collections.llama.cluster.plugins.filter.run_config import train_yaml
from ansible_collections.llama.cluster.plugins.filter.serve import ServeError, serve_request
from ansible_collections.llama.cluster.plugins.module_utils.planner.plan import Stage

from llama_runner.extravars import unsafe_yaml
from tests.support.planning import make_plan, nodes

# One worker takes the whole module, so its module-scoped fixture (ansible-playbook runs)
# runs once, not once per worker.
pytestmark = pytest.mark.xdist_group("template-values")

ROOT = Path(__file__).resolve().parents[3]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
# What a value must survive: a line break (YAML's every kind), a key of its own, quotes, a
# comment, a flow collection, a template.
HOSTILE = [
    "a\ntrust_remote_code: true",
    "x: y # z",
    "'single' \"double\" \\back",
    "{{ lookup('env', 'HOME') }} {% raw %}",
    "[1, {a: b}] &anchor *alias !tag",
    "line\rbreak\x85next\u2028sep\u2029end",
    "- item\n  - nested",
]
TEMPLATES = {
    "api.yaml": "templates/llamafactory_api.yaml.j2",
    "export.yaml": "templates/llamafactory_export.yaml.j2",
    "accelerate_fsdp.yaml": "templates/accelerate_multinode.yaml.j2",
    "fsdp_config.json": "templates/fsdp_config.json.j2",
    "deepspeed.json": "templates/deepspeed.json.j2",
    "condarc": "roles/python_env/templates/condarc.j2",
    "environment.yml": "roles/python_env/templates/environment.yml.j2",
}


def _variables(value: str) -> dict[str, Any]:
    """Every template's variables, each string `value` (numbers stay numbers)."""
    return {
        "__serve_model": {
            "what": value, "path": value, "adapter": value, "template": value,
            "trust_remote_code": False,
        },
        "__serve": {"port": 8000},
        "__serve_dir": value,
        "__serve_backend": {"backend": "huggingface", "reason": value},
        "serve_vllm_gpu_util": 0.9,
        "serve_vllm_maxlen": 4096,
        "export_run_id": value, "export_config": value, "export_adapter": value,
        "export_model": {"path": value, "template": value, "trust_remote_code": False},
        "export_dir": value, "export_size": 5,
        "run_config_id": value, "run_config_node_rank": 1, "run_config_nnodes": 2,
        "run_config_dir": value, "run_config_stage": Stage.FSDP.properties(),
        "run_config_accelerator": "nvidia",
        "run_config_master_addr": value, "run_config_master_port": 29500,
        "run_config_world_size": 16, "run_config_train_args": {"bf16": True},
        "run_config_layer_class": value,
        "run_config_ds_zero": {"stage": 3, "note": value},
        "python_env_conda_channel": value, "pip_cert": value,
        "python_env_conda_python_version": value, "python_env_conda_pip_version": value,
    }  # fmt: skip


def _expected(value: str) -> dict[str, Any]:
    """What each rendered file must hold, parsed: the given values where they were put."""
    return {
        "api.yaml": {"model_name_or_path": value, "adapter_name_or_path": value,
                     "template": value, "infer_backend": "huggingface"},
        "export.yaml": {"model_name_or_path": value, "adapter_name_or_path": value,
                        "template": value, "export_dir": value},
        "accelerate_fsdp.yaml": {"main_process_ip": value, "machine_rank": 1},
        "fsdp_config.json": {"transformer_layer_cls_to_wrap": [value]},
        "deepspeed.json": {"zero_optimization": {"stage": 3, "note": value}},
        "condarc": {"channels": [value], "ssl_verify": value},
        "environment.yml": {"channels": [value, "nodefaults"],
                            "dependencies": [f"python={value}", f"pip={value}"]},
    }  # fmt: skip


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every template rendered once per hostile value (one playbook run), parsed:
    {value index: {file: data}}."""
    out = tmp_path_factory.mktemp("values")
    variables = {
        "render_values": [_variables(value) for value in HOSTILE],
        "render_out": str(out / "rendered.json"),
        "render_templates": [{"name": n, "src": s} for n, s in TEMPLATES.items()],
    }
    (out / "values.yml").write_text(unsafe_yaml(variables, one_line=False))
    given = f"@{out / 'values.yml'}"
    done = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "tests/playbooks/render_values.yml", "-e", given],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    texts = json.loads((out / "rendered.json").read_text())
    return {
        index: {
            name: (json.loads if name.endswith(".json") else yaml.safe_load)(text)
            for name, text in files.items()
        }
        for index, files in texts.items()
    }


@pytest.mark.parametrize("index", range(len(HOSTILE)), ids=[repr(v)[:24] for v in HOSTILE])
@pytest.mark.parametrize("name", TEMPLATES)
def test_every_template_parses_back_to_the_values_given(
    rendered: dict[str, dict[str, Any]], index: int, name: str
) -> None:
    value = HOSTILE[index]
    parsed = rendered[str(index)][name]
    for key, expected in _expected(value)[name].items():
        if name == "accelerate_fsdp.yaml" and key == "fsdp":
            continue
        assert parsed[key] == expected, (name, key)
    if name == "accelerate_fsdp.yaml":
        assert parsed["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == value
    assert "trust_remote_code" not in parsed  # no value added a key of its own


@pytest.mark.parametrize("value", HOSTILE, ids=[repr(v)[:24] for v in HOSTILE])
def test_train_yaml_parses_back_to_the_values_given(value: str) -> None:
    planned = make_plan("qwen2.5-0.5b", cluster=nodes(2))
    batch = replace(planned.batch, why=value, checkpointing_why=value)
    plan = replace(planned, batch=batch).to_dict()
    args = {"template": value, "model_name_or_path": value, "per_device_train_batch_size": 2,
            "disable_gradient_checkpointing": False, "report_to": [value]}  # fmt: skip
    parsed = yaml.safe_load(train_yaml(args, plan, "/opt/run", "10.0.0.1", 29500))
    assert parsed == args


@pytest.mark.parametrize(
    ("asked", "said"),
    [
        ({"model": "m", "model_path": "org/m", "model_template": "qwen\ntrust_remote_code: true"},
         "model_template = 'qwen\\ntrust_remote_code: true' is not a template of LLaMA-Factory"),
        ({"model": "m", "model_path": "/data/m\nadapter_name_or_path: evil/x",
          "model_template": "qwen"}, "model_path="),
        ({"model": "m", "model_path": "../../etc", "model_template": "qwen"}, "model_path="),
        ({"export_dir": "/data/m", "model_template": "qwen3x"}, "(closest: qwen3"),
    ],
)  # fmt: skip
def test_serve_checks_model_template_and_model_path_as_train_does(
    asked: dict[str, str], said: str
) -> None:
    with pytest.raises(ServeError) as refused:
        serve_request({"state": "present", "port": 8000, **asked}, {})
    assert said in str(refused.value)
    fine = {"state": "present", "port": 8000, "model": "m", "model_template": "qwen"}
    assert serve_request({**fine, "model_path": "Qwen/Qwen2.5-0.5B"}, {})["model_path"]
    assert serve_request({**fine, "model_path": "/data/models/m"}, {})["model_path"]
