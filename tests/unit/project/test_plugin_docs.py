"""Every plugin of the collection is documented the way Ansible users read it (`make lint`).

ansible-doc renders each module (DOCUMENTATION, EXAMPLES and RETURN; the action run_plan through
its module stub, as ansible-core documents its own actions), each filter (its YAML file beside
the plugin, plugins/filter/<name>.yml), the lookup, the callbacks and the vars plugins, with no
warning. A filter's documented options are its function's parameters, so that its
documentation cannot drift from its code.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible_collections.llama.cluster.plugins.filter import (
    cluster,
    job,
    links,
    model_stage,
    nvidia_driver,
    preflight,
    python_env,
    run_config,
    serve,
    tracking,
)

ROOT = Path(__file__).resolve().parents[3]
PLUGINS = ROOT / "collections" / "ansible_collections" / "llama" / "cluster" / "plugins"
ANSIBLE_DOC = str(Path(sys.executable).with_name("ansible-doc"))
FILTER_FILES = (cluster, job, links, model_stage, nvidia_driver, preflight, python_env)
FILTER_FILES += (run_config, serve, tracking)


def _names(kind: str) -> list[str]:
    folder = PLUGINS / kind
    return sorted(p.stem for p in folder.glob("*.py") if p.name != "__init__.py")


def _filters() -> dict[str, object]:
    found: dict[str, object] = {}
    for plugin in FILTER_FILES:
        found.update(plugin.FilterModule().filters())
    return found


def test_every_filter_file_is_one_this_test_reads():
    assert sorted(p.__name__.rsplit(".", 1)[1] for p in FILTER_FILES) == _names("filter")


def _doc(kind: str, names: list[str]) -> dict[str, dict]:
    """ansible-doc's JSON for plugins of one type, in one call (the project's ansible.cfg)."""
    done = subprocess.run(
        [ANSIBLE_DOC, "-t", kind, "--json", *(f"llama.cluster.{n}" for n in names)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_DEPRECATION_WARNINGS": "0"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert not said, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    ("kind", "needs"),
    [
        ("module", ("doc", "examples", "return")),
        ("filter", ("doc", "examples", "return")),
        ("lookup", ("doc", "examples", "return")),
        ("callback", ("doc",)),
        ("vars", ("doc",)),
    ],
)
def test_ansible_doc_renders_every_plugin_of_the_collection(kind: str, needs: tuple[str, ...]):
    names = (
        sorted(_filters()) if kind == "filter" else _names(f"{kind}s" if kind == "module" else kind)
    )
    assert names
    shown = _doc(kind, names)
    for name in names:
        entry = shown.get(f"llama.cluster.{name}")
        assert entry, f"ansible-doc -t {kind} shows nothing for llama.cluster.{name}"
        empty = [part for part in needs if not entry.get(part)]
        assert not empty, f"llama.cluster.{name} ({kind}) has no {', '.join(empty)}"
        assert entry["doc"].get("short_description"), name
        if kind == "filter":  # `ansible-doc -t filter -l` shows no UNDOCUMENTED line
            assert entry["doc"].get("description"), name


def test_the_action_run_plan_is_documented_by_its_module_stub():
    assert (PLUGINS / "action" / "run_plan.py").is_file()
    assert "run_plan" in _names("modules")


def _signature_options(function: object) -> tuple[list[str], list[str], bool]:
    """The documented names a filter function takes: positional (its input first, as _input),
    every option, and whether it also takes any keyword (**options)."""
    params = list(inspect.signature(function).parameters.values())  # type: ignore[arg-type]
    names = ["_input", *(p.name for p in params[1:] if p.kind is not p.VAR_KEYWORD)]
    positional = [
        "_input",
        *(p.name for p in params[1:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)),
    ]
    return positional, names, any(p.kind is p.VAR_KEYWORD for p in params)


@pytest.mark.parametrize("name", sorted(_filters()))
def test_a_filters_documented_options_are_its_parameters(name: str):
    doc = yaml.safe_load((PLUGINS / "filter" / f"{name}.yml").read_text(encoding="utf-8"))
    documentation = doc["DOCUMENTATION"]
    assert documentation["name"] == name
    positional, names, any_keyword = _signature_options(_filters()[name])
    options = list(documentation.get("options") or {})
    documented = [p.strip() for p in str(documentation.get("positional", "")).split(",")]
    if any_keyword:  # filter(input, **options): the options are the decision's keywords
        assert documented == ["_input"]
        assert set(names) <= set(options), name
        return
    assert documented == positional, f"{name}: positional {documented}, the function's {positional}"
    assert sorted(options) == sorted(names), f"{name}: options {options}, parameters {names}"


def test_every_filter_doc_file_documents_a_filter():
    files = sorted(p.stem for p in (PLUGINS / "filter").glob("*.yml"))
    assert files == sorted(_filters())
