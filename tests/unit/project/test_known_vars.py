"""Every extra variable is known (issue 48): a name that no playbook, role, template or plan
reads is refused on the controller, before any node is touched, with the closest known names;
the list of known names is generated from the project (scripts/known-vars.py) and this test
fails when a variable is read that the list lacks."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.known_vars import (
    NAMES_FILE,
    document_names,
    unknown_vars,
)

from tests.unit.inventory.test_inventory_check import ghost, run, yaml_inventory

ROOT = Path(__file__).resolve().parents[3]


def _script() -> object:
    spec = importlib.util.spec_from_file_location(
        "known_vars_script", ROOT / "scripts/known-vars.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_known_names_are_what_the_project_reads():
    # A playbook, role or template that reads a new variable changes what the script finds:
    # the committed list must follow (run scripts/known-vars.py), or the variable is refused.
    script = _script()
    assert NAMES_FILE.read_text(encoding="utf-8") == script.render(script.known_names()), (
        "module_utils/known_vars.json is out of date: run scripts/known-vars.py"
    )


def test_the_names_a_playbook_reads_are_found_in_templates_and_bare_conditions(tmp_path: Path):
    playbook = tmp_path / "mine.yml"
    task = {"when": "fresh_flag | bool", "debug": {"msg": "{{ other | default(1) + item }}"}}
    playbook.write_text(json.dumps([{"hosts": "all", "tasks": [task]}]))
    assert document_names(playbook) == {"fresh_flag", "other"}
    # A playbook being run may read its own: they are known for that run.
    given = {"extra_vars": ["fresh_flag", "stale_flag"], "playbooks": [str(playbook)]}
    assert unknown_vars(given) == unknown_vars({"extra_vars": ["stale_flag"]})
    # What users pass most, and what the Python reads from a host's variables, are known.
    names = set(json.loads(NAMES_FILE.read_text())["names"])
    for name in ("model", "dataset", "train_args", "resume", "run_id", "max_restarts", "detach"):
        assert name in names
    for name in ("gpu_memory_gib", "host_memory_gib", "link_gbps", "nproc_per_node", "node_rank"):
        assert name in names


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("modle", "Did you mean model?"),
        ("learning_rate", """-e '{"train_args": {"learning_rate": ...}}'"""),
        ("output_dir", "LLaMA-Factory's output_dir is the plan's: every run writes to"),
        ("nnodes", "The nodes are the inventory's: train on fewer with"),
        ("zzqx", "The variables users set: README.md"),
    ],
)
def test_an_unknown_name_gets_the_closest_known_one(name: str, hint: str):
    (problem,) = unknown_vars({"extra_vars": [name]})
    assert problem.startswith(f"-e {name}: nothing in this project reads a variable of that name")
    assert hint in problem


def test_known_names_and_ansibles_own_pass():
    given = ["model", "train_args", "ansible_python_interpreter"]
    assert unknown_vars({"extra_vars": given, "playbooks": ["train.yml"]}) == []


def test_train_refuses_the_issues_unread_names_before_any_node(tmp_path: Path):
    # `-e learning_rate=-1 -e num_train_epochs=1e12 -e output_dir=/etc -e nnodes=0` trained
    # with LLaMA-Factory's defaults, the user believing they took effect.
    inventory = {
        "all": {
            "children": {
                "master": {"hosts": {"a": ghost(1)}},
                "workers": {"hosts": {"b": ghost(2)}},
            }
        }
    }
    rc, out = run(
        "train.yml", yaml_inventory(tmp_path, inventory),
        "-e", "model=tiny", "-e", "learning_rate=-1", "-e", "num_train_epochs=1e12",
        "-e", "output_dir=/etc", "-e", "nnodes=0",
    )  # fmt: skip
    text = " ".join(out.split())
    assert rc != 0
    for name in ("learning_rate", "num_train_epochs", "output_dir", "nnodes"):
        assert f"-e {name}: nothing in this project reads a variable of that name" in text
    assert "train_args.num_train_epochs" in text
    assert "UNREACHABLE" not in out
    assert "Check the request" not in out
    assert not (tmp_path / "runs").exists()
