#!/usr/bin/python
"""Ansible module: a node's directories and small files, written in one call, never through a
link that another account could have planted.

A run directory is a handful of directories and rendered files (the plan, dataset_info.json,
accelerate.yaml, train.yaml, the job's environment and specification); one ansible.builtin.file,
copy or template task each costs a round trip to every node, and train.yml paid about ten of them
before a run could start. The texts are rendered on the controller (the `template` lookup, the
same Jinja templates), and this module writes them in one call: directories first, then empty
files that must exist (never truncated), then the removals, then the files, each replaced
atomically and only when its content differs, with owner, group and mode set as asked.

It runs as root and writes where the training account writes too (a run's directory is that
account's), so no path is taken on trust (module_utils/safe_paths.py: walked one directory at a
time, a link followed only where root alone could have made it, everything done through
descriptors). A directory marked `new` is created exclusively, in a directory only root can
write: one that exists already, as a directory or as a link, is refused.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from contextlib import suppress
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.llama.cluster.plugins.module_utils.safe_paths import (
    DIRECTORY,
    Missing,
    Refused,
    Walk,
    differs,
    directory,
    linked_elsewhere,
    octal_mode,
    set_attributes,
    split_path,
    trusted,
    who_can_write,
)

DOCUMENTATION = r"""
module: llama_files
short_description: Directories, files that must exist and files with content, in one call
description:
  - Creates O(directories), then the empty files of O(touch) that do not exist yet (an existing
    one keeps its content and times), then removes O(absent), then writes each of O(files) whose
    content differs (atomically, through a temporary file beside it). Owner, group and mode are
    set on each.
  - No link is followed unless it sits in a directory that only root (or the module's own user)
    can write, where only root could have made it; a link anywhere else on a path, or at the path
    of a file to touch, fails the task naming it. Everything is created and changed through file
    descriptors, so a path swapped for a link while the module runs is never followed either.
  - A regular file with more than one hard link never gets its owner or mode changed (its other
    name could be any file of the filesystem); one to touch fails the task naming it, one to
    write is replaced by a new file, its other names left as they are.
  - A directory with C(new) is created here and now, in a directory only root can write; one
    that exists already (a directory, a link, anything) fails the task before anything is written.
options:
  directories:
    description:
      - Directories; each has path and optional owner, group, mode, and new (true - create it
        exclusively, refusing one that exists). Missing parents are made (0755).
    type: list
    elements: dict
    default: []
  touch:
    description: Files that must exist; each has path and optional owner, group, mode.
    type: list
    elements: dict
    default: []
  absent:
    description: Files (or links) to remove where they exist (paths).
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
    description: The owner of an entry that names none (none - the module's user keeps it).
    type: str
  group:
    description: The group of an entry that names none.
    type: str
  directory_mode:
    description: The mode of a directory that names none (octal, e.g. C(0750)).
    type: str
  file_mode:
    description: The mode of a file (touch or files) that names none (octal).
    type: str
author: llama-cluster
"""

EXAMPLES = r"""
- name: Write a run's directories, its log and its files in one call
  llama.cluster.llama_files:
    directories:
      - path: /opt/llama-cluster/runs/r1
        new: true
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

ENTRY_KEYS = {"path", "owner", "group", "mode", "content", "json", "new"}


def check(params: dict[str, list[dict[str, Any]]]) -> str:
    """'' when every entry can be written, else what is wrong with the first that cannot."""
    for kind in ("directories", "touch", "files"):
        for entry in params[kind]:
            problem = _entry_problem(kind, entry)
            if problem:
                return problem
    return ""


def _entry_problem(kind: str, entry: dict[str, Any]) -> str:
    """What is wrong with one entry ('' when nothing)."""
    unknown = set(entry) - ENTRY_KEYS
    path = str(entry.get("path", ""))
    mode = entry.get("mode")
    problems = (
        (unknown, f"{kind}: {entry.get('path')}: unknown keys {sorted(unknown)}"),
        (not path.startswith("/"), f"{kind}: every path must be absolute, got {path!r}"),
        (".." in path.split("/"), f"{kind}: {path}: a path with '..' is not written to"),
        (
            kind == "files" and not isinstance(entry.get("content"), str),
            f"files: {path} needs a content (a string)",
        ),
        (
            mode is not None and not octal_mode(mode),
            f"{kind}: {path}: mode {mode!r} must be octal, such as '0750'",
        ),
    )
    found = next((said for wrong, said in problems if wrong), "")
    if found or kind != "files" or not entry.get("json"):
        return found
    try:
        json.loads(entry["content"])
    except ValueError as err:
        return f"files: {path} is not valid JSON: {err}"
    return ""


def make_directory(entry: dict[str, Any], check_mode: bool) -> bool:
    """Create (or check) one directory and set its attributes; whether it changed."""
    path = entry["path"].rstrip("/") or "/"
    if entry.get("new"):
        return _new_directory(entry, path, check_mode)
    with directory(path, make=True, check_mode=check_mode) as walk:
        if walk.missing:
            return True
        if check_mode:
            return differs(walk.fd, entry)
        return set_attributes(walk.fd, entry) or bool(walk.made)


def _new_directory(entry: dict[str, Any], path: str, check_mode: bool) -> bool:
    """A directory made here and now, exclusively, in a directory only root can write."""
    parent, name = split_path(path)
    with directory(parent, make=True, check_mode=check_mode) as walk:
        if walk.missing:
            return True
        where = os.fstat(walk.fd)
        if not trusted(where):
            raise Refused(
                f"{path} must be made in a directory only root can write, and "
                f"{who_can_write(where)} can write {parent}: give it to root (ansible-playbook "
                "provision.yml --tags cluster_user does), then start again"
            )
        try:
            found = os.stat(name, dir_fd=walk.fd, follow_symlinks=False)
        except FileNotFoundError:
            found = None
        if found is not None:
            what = "a link" if stat.S_ISLNK(found.st_mode) else "a directory"
            if not stat.S_ISLNK(found.st_mode) and not stat.S_ISDIR(found.st_mode):
                what = "a file"
            raise Refused(
                f"{path} exists already ({what}): a new run's directory is never reused; nothing "
                "was written there"
            )
        if check_mode:
            return True
        mode = octal_mode(entry.get("mode") or "0700") or 0o700
        try:
            os.mkdir(name, 0o700, dir_fd=walk.fd)
        except FileExistsError as err:
            raise Refused(f"{path} appeared while it was being made: refused") from err
        fd = os.open(name, DIRECTORY, dir_fd=walk.fd)
        try:
            set_attributes(fd, {**entry, "mode": f"{mode:o}"})
        finally:
            os.close(fd)
        return True


def touch_file(entry: dict[str, Any], check_mode: bool) -> bool:
    """Create an empty file where none is (never truncating one); set its attributes."""
    parent, name = split_path(entry["path"])
    with directory(parent, check_mode=check_mode) as walk:
        if walk.missing:
            return True
        try:
            fd = os.open(
                name,
                os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                dir_fd=walk.fd,
            )
            created = False
        except FileNotFoundError:
            if check_mode:
                return True
            fd = os.open(
                name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=walk.fd,
            )
            created = True
        except OSError as err:
            raise _refusal(entry["path"], err) from err
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise Refused(f"{entry['path']} is not a regular file")
            if check_mode:
                return differs(fd, entry)
            return set_attributes(fd, entry) or created
        finally:
            os.close(fd)


def _refusal(path: str, err: OSError) -> Refused:
    if err.errno == errno.ELOOP:
        return Refused(f"{path} is a link: refused, never followed (remove it)")
    return Refused(f"{path}: {err.strerror}")


def remove(path: str, check_mode: bool) -> bool:
    """Remove a file or a link (never what it points to) where one is."""
    parent, name = split_path(path)
    try:
        walk = Walk(parent, make=False, check_mode=check_mode).open()
    except Missing:
        return False
    try:
        if walk.missing:
            return False
        try:
            info = os.stat(name, dir_fd=walk.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(info.st_mode):
            raise Refused(f"{path} is a directory, not a file to remove")
        if not check_mode:
            os.unlink(name, dir_fd=walk.fd)
        return True
    finally:
        walk.close()


def _holds(folder: int, name: str, content: bytes) -> tuple[int | None, bool]:
    """The regular file `name` opened (not followed; None for anything else) and whether it
    holds `content` (read no further than that)."""
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder
        )
    except OSError:
        return None, False
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        return None, False
    if info.st_size != len(content):
        return fd, False
    held = b""
    while len(held) < len(content) and (chunk := os.read(fd, len(content) - len(held))):
        held += chunk
    return fd, held == content


def write_file(entry: dict[str, Any], check_mode: bool) -> bool:
    """Replace the file when its content differs (or it is no regular file), then set its
    attributes; whether it changed."""
    content = entry["content"].encode()
    parent, name = split_path(entry["path"])
    with directory(parent, check_mode=check_mode) as walk:
        if walk.missing:
            return True
        fd, same = _holds(walk.fd, name, content)
        if fd is not None and linked_elsewhere(fd):
            same = False  # a hard link's other names are left as they are: a new file here
        if fd is not None and same:
            try:
                return differs(fd, entry) if check_mode else set_attributes(fd, entry)
            finally:
                os.close(fd)
        if fd is not None:
            os.close(fd)
        if check_mode:
            return True
        temporary = f".llama_files.{secrets.token_hex(8)}"
        out = os.open(
            temporary,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=walk.fd,
        )
        try:
            with os.fdopen(out, "wb", closefd=False) as handle:
                handle.write(content)
            # Owner and mode before the rename: never readable by more than asked.
            set_attributes(out, {**entry, "mode": entry.get("mode") or "0600"})
            os.replace(temporary, name, src_dir_fd=walk.fd, dst_dir_fd=walk.fd)
        except BaseException:
            os.close(out)
            with suppress(OSError):
                os.unlink(temporary, dir_fd=walk.fd)
            raise
        os.close(out)
        return True


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


def apply(params: dict[str, Any], check_mode: bool) -> list[str]:
    """Everything asked, in order (a `new` directory is checked before anything is written);
    the paths changed."""
    entries = with_defaults(params)
    changed: list[str] = []
    for entry in entries["directories"]:
        if entry.get("new"):  # refused before anything is written
            make_directory(entry, check_mode=True)
    for entry in entries["directories"]:
        if make_directory(entry, check_mode):
            changed.append(entry["path"])
    for entry in entries["touch"]:
        if touch_file(entry, check_mode):
            changed.append(entry["path"])
    for path in params["absent"]:
        if remove(path, check_mode):
            changed.append(path)
    for entry in entries["files"]:
        if write_file(entry, check_mode):
            changed.append(entry["path"])
    return changed


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
    try:
        changed_paths = apply(module.params, module.check_mode)
    except Refused as err:
        module.fail_json(msg=f"llama_files: {err}")
    except OSError as err:
        module.fail_json(msg=f"llama_files: {err.filename or ''}: {err.strerror}")
    module.exit_json(changed=bool(changed_paths), changed_paths=changed_paths)


if __name__ == "__main__":
    main()
