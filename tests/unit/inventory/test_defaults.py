"""Every default in one place (CONTRIBUTING.md, "Where a default lives").

A variable's default is written once: in the project's `group_vars/all/*.yml`, in one role's
`defaults/main.yml`, or (a constant) in one role's `vars/`. A second copy is dead (group_vars/all
sits above every role default, a role's vars/ above both) and drifts, so any key in two of those
files fails here, naming the key and the files.

`default:` in a role's `meta/argument_specs.yml` is documentation: ansible-core's
validate_argument_spec checks the variables the play already has and sets none of them. Where a
spec keeps a `default:`, it must equal the one real default, wherever that lives; a template
default is left out of the spec and described instead.

YAML only: nothing here runs Ansible.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
YAML = ("yml", "yaml")


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads Ansible's tags (!unsafe, !vault) as their plain values."""


def _untagged(loader: yaml.SafeLoader, _suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.ScalarNode):
        return loader.construct_scalar(node)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_mapping(node, deep=True)


_Loader.add_multi_constructor("!", _untagged)


def _load(path: Path) -> dict[str, Any]:
    # A SafeLoader: Ansible's tags become plain values, nothing is constructed.
    data = yaml.load(path.read_text(), Loader=_Loader)
    if data is None:
        return {}
    assert isinstance(data, dict), f"{path}: not a mapping"
    return data


def _glob(root: Path, *patterns: str) -> list[Path]:
    found = {p for pattern in patterns for ext in YAML for p in root.glob(f"{pattern}.{ext}")}
    return sorted(p for p in found if p.is_file())


def default_files(root: Path = ROOT) -> list[Path]:
    """Every file that defines defaults: group_vars/all, each role's defaults/ and vars/."""
    return _glob(
        root,
        "group_vars/all",
        "group_vars/all/**/*",
        "roles/*/defaults/main",
        "roles/*/defaults/main/**/*",
        "roles/*/vars/**/*",
    )


def definitions(root: Path = ROOT) -> dict[str, list[tuple[str, Any]]]:
    """Each key, with every (file relative to root, value) that defines it."""
    found: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for path in default_files(root):
        for key, value in _load(path).items():
            found[key].append((str(path.relative_to(root)), value))
    return dict(found)


def spec_defaults(root: Path = ROOT) -> list[tuple[str, str, Any]]:
    """(key, "<argument_specs file>:<entry point>", default) for each option with a default."""
    found = []
    for path in _glob(root, "roles/*/meta/argument_specs"):
        entry_points = _load(path).get("argument_specs") or {}
        for entry_point, spec in entry_points.items():
            for key, option in ((spec or {}).get("options") or {}).items():
                if isinstance(option, dict) and "default" in option:
                    where = f"{path.relative_to(root)}:{entry_point}"
                    found.append((key, where, option["default"]))
    return found


def _same(a: Any, b: Any) -> bool:
    """Equal as YAML values (true is not 1, 8000 is not "8000")."""
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def duplicates(root: Path = ROOT) -> list[str]:
    """One line per key defined in more than one file."""
    problems = []
    for key, places in sorted(definitions(root).items()):
        if len(places) > 1:
            files = " and ".join(path for path, _ in places)
            same = all(_same(value, places[0][1]) for _, value in places)
            problems.append(
                f"{key} is defined in {files} ({'same' if same else 'different'} values)"
            )
    return problems


def disagreements(root: Path = ROOT) -> list[str]:
    """One line per argument spec default that is not the key's one real default."""
    real = definitions(root)
    problems = []
    for key, where, default in spec_defaults(root):
        if key not in real:
            problems.append(
                f"{key}: {where} has default {default!r} but no defaults file defines {key} "
                "(the spec's default never reaches the variable)"
            )
            continue
        for path, value in real[key]:
            if not _same(default, value):
                problems.append(f"{key}: {where} says default {default!r}, {path} sets {value!r}")
    return problems


def test_no_key_is_defined_in_two_places() -> None:
    problems = duplicates()
    assert not problems, "a default in two places (keep one):\n" + "\n".join(problems)


def test_argument_spec_defaults_are_the_one_default() -> None:
    problems = disagreements()
    assert not problems, "argument_specs.yml disagrees with the default:\n" + "\n".join(problems)


def test_every_place_is_read() -> None:
    files = {str(p.relative_to(ROOT)) for p in default_files()}
    assert "group_vars/all/serve.yml" in files
    assert "roles/firewall/defaults/main.yml" in files
    assert "roles/firewall/vars/main.yml" in files
    found = definitions()
    assert [path for path, _ in found["serve_port"]] == ["group_vars/all/serve.yml"]
    assert [path for path, _ in found["firewall_ssh_ports"]] == ["roles/firewall/defaults/main.yml"]
    assert any(key == "serve_port" for key, _, _ in spec_defaults())


def _write(root: Path, path: str, text: str) -> None:
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A project with one key in group_vars/all, in a role's defaults and in its argument spec."""
    _write(tmp_path, "group_vars/all/demo.yml", "demo_port: 8000\ndemo_secret: !unsafe '{{ x }}'\n")
    _write(tmp_path, "roles/demo/defaults/main.yml", "demo_port: 8000\ndemo_own: true\n")
    _write(tmp_path, "roles/demo/vars/main.yml", "demo_const: 1\n")
    _write(
        tmp_path,
        "roles/demo/meta/argument_specs.yml",
        "argument_specs:\n  main:\n    options:\n"
        "      demo_port: {type: int, default: 8001}\n"
        "      demo_own: {type: bool, default: 1}\n"
        "      demo_const: {type: int, default: 1}\n"
        "      demo_gone: {type: str, default: ''}\n"
        "      demo_secret: {type: str}\n",
    )
    return tmp_path


def test_a_copy_fails_naming_the_key_and_both_files(tree: Path) -> None:
    assert duplicates(tree) == [
        "demo_port is defined in group_vars/all/demo.yml and roles/demo/defaults/main.yml"
        " (same values)"
    ]
    (tree / "roles/demo/defaults/main.yml").write_text("demo_own: true\n")
    assert duplicates(tree) == []


def test_a_spec_default_that_is_not_the_default_fails(tree: Path) -> None:
    (tree / "roles/demo/defaults/main.yml").write_text("demo_own: true\n")
    spec = "roles/demo/meta/argument_specs.yml:main"
    assert disagreements(tree) == [
        f"demo_port: {spec} says default 8001, group_vars/all/demo.yml sets 8000",
        f"demo_own: {spec} says default 1, roles/demo/defaults/main.yml sets True",
        f"demo_gone: {spec} has default '' but no defaults file defines demo_gone"
        " (the spec's default never reaches the variable)",
    ]
