#!/usr/bin/python
"""Ansible module: a node's directories and small files, written in one call.

A run directory is a handful of directories and rendered files (the plan, dataset_info.json,
accelerate.yaml, train.yaml, the job's environment and specification); one ansible.builtin.file,
copy or template task each costs a round trip to every node, and train.yml paid about ten of them
before a run could start. The texts are rendered on the controller (the `template` lookup, the
same Jinja templates), and this module writes them in one call: directories first, then empty
files that must exist (never truncated), then the removals, then the files, each replaced
atomically and only when its content differs, with owner, group and mode set as asked.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: llama_files
short_description: Directories, files that must exist and files with content, in one call
description:
  - Creates O(directories), then the empty files of O(touch) that do not exist yet (an existing
    one keeps its content and times), then writes each of O(files) whose content differs
    (atomically, through a temporary file beside it). Owner, group and mode are set on each.
options:
  directories:
    description: Directories; each has path and optional owner, group, mode.
    type: list
    elements: dict
    default: []
  touch:
    description: Files that must exist; each has path and optional owner, group, mode.
    type: list
    elements: dict
    default: []
  absent:
    description: Files to remove where they exist (paths).
    type: list
    elements: path
    default: []
  files:
    description:
      - Files; each has path, content and optional owner, group, mode, and json (true when the
        content must parse as JSON, checked before anything is written).
    type: list
    elements: dict
    default: []
  owner:
    description: The owner of an entry that names none.
    type: str
  group:
    description: The group of an entry that names none.
    type: str
  directory_mode:
    description: The mode of a directory that names none.
    type: str
  file_mode:
    description: The mode of a file (touch or files) that names none.
    type: str
author: llama-cluster
"""

EXAMPLES = r"""
- name: Write a run's directories, its log and its files in one call
  llama.cluster.llama_files:
    directories:
      - path: /opt/llama-cluster/runs/r1
      - path: /opt/llama-cluster/runs/r1/tmp
        mode: "0700"
    touch:
      - path: /opt/llama-cluster/runs/r1/logs/node1.log
    files:
      - path: /opt/llama-cluster/runs/r1/plan.json
        content: '{"run_id": "r1"}'
        json: true
    owner: llama
    group: llama
    directory_mode: "0750"
    file_mode: "0640"
"""

RETURN = r"""
changed_paths:
  description: The paths created or changed (in check mode, that would be).
  type: list
  returned: always
"""

ENTRY_KEYS = {"path", "owner", "group", "mode", "content", "json"}


def check(params: dict[str, list[dict[str, Any]]]) -> str:
    """'' when every entry can be written, else what is wrong with the first that cannot."""
    for kind in ("directories", "touch", "files"):
        for entry in params[kind]:
            unknown = set(entry) - ENTRY_KEYS
            if unknown:
                return f"{kind}: {entry.get('path')}: unknown keys {sorted(unknown)}"
            if not str(entry.get("path", "")).startswith("/"):
                return f"{kind}: every path must be absolute, got {entry.get('path')!r}"
            if kind == "files" and not isinstance(entry.get("content"), str):
                return f"files: {entry['path']} needs a content (a string)"
            if kind == "files" and entry.get("json"):
                try:
                    json.loads(entry["content"])
                except ValueError as err:
                    return f"files: {entry['path']} is not valid JSON: {err}"
    return ""


def content_differs(path: str, content: bytes) -> bool:
    """Whether the file is missing or holds other bytes."""
    try:
        with open(path, "rb") as handle:
            return handle.read() != content
    except FileNotFoundError:
        return True


def attributes(module: AnsibleModule, entry: dict[str, Any], changed: bool) -> bool:
    """Set owner, group and mode as asked; whether anything was (or would be) changed."""
    args = {
        "path": entry["path"],
        "owner": entry.get("owner"),
        "group": entry.get("group"),
        "mode": entry.get("mode"),
        "attributes": None,
        "seuser": None,
        "serole": None,
        "setype": None,
        "selevel": None,
        "secontext": [None, None, None],
    }
    if module.check_mode and not os.path.exists(entry["path"]):
        return True
    return module.set_fs_attributes_if_different(args, changed)


def write_file(module: AnsibleModule, entry: dict[str, Any]) -> bool:
    """Replace the file when its content differs, then set its attributes; whether it changed."""
    content = entry["content"].encode()
    written = content_differs(entry["path"], content)
    if written and not module.check_mode:
        fd, temporary = tempfile.mkstemp(dir=os.path.dirname(entry["path"]), prefix=".llama_files.")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(content)
            # Owner and mode before the rename: never readable by more than asked.
            attributes(module, {**entry, "path": temporary}, True)
            os.replace(temporary, entry["path"])
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise
    return attributes(module, entry, written) or written


def with_defaults(params: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Every entry with the module's owner, group and mode where it names none."""
    out = {}
    for kind, mode in (
        ("directories", "directory_mode"),
        ("touch", "file_mode"),
        ("files", "file_mode"),
    ):
        defaults = {"owner": params["owner"], "group": params["group"], "mode": params[mode]}
        out[kind] = [
            {**entry, **{k: v for k, v in defaults.items() if entry.get(k) is None}}
            for entry in params[kind]
        ]
    return out


def main() -> None:
    """Write what differs; report which paths changed."""
    spec = {"type": "list", "elements": "dict", "default": []}
    text = {"type": "str"}
    module = AnsibleModule(
        argument_spec={
            "directories": spec,
            "touch": spec,
            "files": spec,
            "absent": {"type": "list", "elements": "path", "default": []},
            "owner": text,
            "group": text,
            "directory_mode": text,
            "file_mode": text,
        },
        supports_check_mode=True,
    )
    problem = check(module.params)
    if problem:
        module.fail_json(msg=f"llama_files: {problem}")
    params = with_defaults(module.params)
    changed_paths: list[str] = []

    for entry in params["directories"]:
        created = not os.path.isdir(entry["path"])
        if created and not module.check_mode:
            os.makedirs(entry["path"], exist_ok=True)
        if attributes(module, entry, created) or created:
            changed_paths.append(entry["path"])

    for entry in params["touch"]:
        created = not os.path.exists(entry["path"])
        if created and not module.check_mode:
            with open(entry["path"], "ab"):
                pass
        if attributes(module, entry, created) or created:
            changed_paths.append(entry["path"])

    for path in module.params["absent"]:
        if os.path.lexists(path):
            if not module.check_mode:
                os.unlink(path)
            changed_paths.append(path)

    for entry in params["files"]:
        if write_file(module, entry):
            changed_paths.append(entry["path"])

    module.exit_json(changed=bool(changed_paths), changed_paths=changed_paths)


if __name__ == "__main__":
    main()
