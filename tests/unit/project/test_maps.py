"""The maps of the code, checked against the code so that they cannot drift from it (`make lint`).

- The collection's README is a room list: one line per plugin and module_utils file, each
  file of the tree listed once and every listed file in the tree.
- The README's "How it works" table answers each question with `path:function` pointers: each
  file exists and defines the function (or class, or constant) it names.
- The import rules: the planner and the supervisor import nothing outside themselves but the
  shared modules named here; a plugin type does not import another type; code that runs on the
  nodes never imports the controller's.
- A job's phases and failure kinds are spelt once, in llama_job/protocol.py's enums: no string
  of theirs is compared with a phase or a kind anywhere else (Python or the playbooks' Jinja).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
COLLECTION = ROOT / "collections" / "ansible_collections" / "llama" / "cluster"
PLUGINS = COLLECTION / "plugins"
PACKAGE = "ansible_collections.llama.cluster.plugins"
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


# ---- the collection's room list ------------------------------------------------------------
ROOM = re.compile(r"^\|\s*`(plugins/[^`]+\.py)`\s*\|", re.MULTILINE)


def _rooms() -> list[str]:
    return ROOM.findall((COLLECTION / "README.md").read_text(encoding="utf-8"))


def _tree() -> list[str]:
    return sorted(
        str(path.relative_to(COLLECTION))
        for path in PLUGINS.rglob("*.py")
        if path.name != "__init__.py" and "__pycache__" not in path.parts
    )


def test_the_collection_readme_lists_every_plugin_and_module_utils_file_once():
    listed = _rooms()
    twice = sorted({room for room in listed if listed.count(room) > 1})
    assert not twice, f"listed more than once in the collection's README: {twice}"
    missing = sorted(set(_tree()) - set(listed))
    gone = sorted(set(listed) - set(_tree()))
    assert not missing, f"files the collection's README does not list (add a line each): {missing}"
    assert not gone, f"the collection's README lists files that are not in the tree: {gone}"


# ---- the README's "How it works" pointers ----------------------------------------------------
POINTER = re.compile(r"`((?:llama\.cluster/)?[\w./-]+\.(?:py|yml|md|cfg|j2))(?::([\w.]+))?`")


def _how_it_works() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## How it works")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _rows() -> list[str]:
    """The table's rows, its header left out."""
    return [line for line in _how_it_works().splitlines() if line.startswith("| ")][1:]


def _pointers() -> list[tuple[str, str | None]]:
    return [(path, name or None) for row in _rows() for path, name in POINTER.findall(row)]


def _path(pointer: str) -> Path:
    if pointer.startswith("llama.cluster/"):
        return COLLECTION / pointer.removeprefix("llama.cluster/")
    return ROOT / pointer


def _defines(path: Path, dotted: str) -> bool:
    """Whether a Python file defines `dotted` (a function, class or constant; Class.method)."""
    scope: list[ast.stmt] = ast.parse(path.read_text(encoding="utf-8")).body
    for name in dotted.split("."):
        found = None
        for node in scope:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if node.name == name:
                    found = node
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found = node
        if found is None:
            return False
        scope = found.body if isinstance(found, ast.ClassDef) else []
    return True


def test_every_answer_of_how_it_works_points_at_code_that_is_there():
    pointers = _pointers()
    assert len(pointers) >= 10, "the How it works table lost its pointers"
    broken = []
    for pointer, name in pointers:
        path = _path(pointer)
        if not path.is_file():
            broken.append(f"{pointer}: no such file")
        elif name and path.suffix == ".py" and not _defines(path, name):
            broken.append(f"{pointer}:{name}: {path.name} defines no {name}")
        elif name and path.suffix != ".py":
            broken.append(f"{pointer}:{name}: only a Python file takes a :name")
    assert not broken, "README.md, How it works:\n" + "\n".join(broken)


def test_each_question_of_how_it_works_is_answered_in_code():
    unanswered = [row.split("|")[1].strip() for row in _rows() if not POINTER.search(row)]
    assert not unanswered, f"questions without a file to read: {unanswered}"


# ---- the import rules ----------------------------------------------------------------------
def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT / "collections").with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module a file imports, relative imports made absolute."""
    own = _module(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
                found.update(f"{stem}.{alias.name}" for alias in node.names)
                found.add(stem)
            else:
                found.add(str(node.module))
                if str(node.module).startswith(PACKAGE):  # `from ...module_utils import ufw`
                    found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _ours(name: str) -> str | None:
    """`name` relative to the collection's plugins (module_utils.planner.memory), or None."""
    return name.removeprefix(PACKAGE + ".") if name.startswith(PACKAGE + ".") else None


def _files(folder: str) -> list[Path]:
    return sorted(p for p in (PLUGINS / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _is_module(relative: str) -> bool:
    """Whether a plugins-relative name is a module or package of the tree (not a name in one)."""
    path = PLUGINS / relative.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _violations(files: list[Path], allowed: callable) -> list[str]:
    found = []
    for path in files:
        for name in sorted(_imports(path)):
            ours = _ours(name)
            if ours is not None and not _is_module(ours):
                continue  # a name imported from one of our modules: its module is checked
            if not allowed(name, ours):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


# The planner's one outside import: PlanError is a filter error, so that a play shows its message.
PLANNER_SHARED = {"ansible.errors"}


def test_the_planner_imports_nothing_outside_itself_but_named_shared_modules():
    def allowed(name: str, ours: str | None) -> bool:
        if ours is not None:
            return ours.startswith("module_utils.planner")
        return name.split(".", maxsplit=1)[0] in STDLIB or name in PLANNER_SHARED

    assert not _violations(_files("module_utils/planner"), allowed)


def test_the_supervisor_imports_nothing_outside_itself():
    def allowed(name: str, ours: str | None) -> bool:
        if ours is not None:
            return ours.startswith("module_utils.llama_job")
        return name.split(".", maxsplit=1)[0] in STDLIB

    assert not _violations(_files("module_utils/llama_job"), allowed)


PLUGIN_TYPES = ("action", "callback", "filter", "lookup", "modules", "vars")


@pytest.mark.parametrize("kind", PLUGIN_TYPES)
def test_a_plugin_type_imports_module_utils_but_no_other_plugin_type(kind: str):
    def allowed(_name: str, ours: str | None) -> bool:
        return ours is None or ours.startswith(("module_utils", kind))

    assert not _violations(_files(kind), allowed)


def _node_side() -> list[Path]:
    """What runs on the nodes: the modules, the module_utils they import (and what those import),
    the supervisor's zipapp (llama_job and the planner's checkpoint rule)."""
    todo = [*_files("modules"), *_files("module_utils/llama_job")]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            ours = _ours(name)
            if ours and ours.startswith("module_utils") and _is_module(ours):
                target = PLUGINS / ours.replace(".", "/")
                todo.append(
                    target.with_suffix(".py")
                    if target.with_suffix(".py").is_file()
                    else target / "__init__.py"
                )
    return sorted(seen)


def test_code_that_runs_on_the_nodes_never_imports_the_controllers():
    def allowed(name: str, ours: str | None) -> bool:
        if ours is not None:
            return ours.startswith("module_utils")
        top = name.split(".", maxsplit=1)[0]
        return top in STDLIB or name.startswith("ansible.module_utils")

    node = _node_side()
    assert PLUGINS / "module_utils" / "llama_job" / "resume.py" in node
    assert PLUGINS / "module_utils" / "job_view.py" not in node
    assert not [p for p in node if "planner" in p.parts]
    assert not _violations(node, allowed)


def test_the_roles_node_scripts_import_no_project_code():
    scripts = [p for p in (ROOT / "roles").glob("*/files/*") if p.is_file()]
    scripts = [
        p
        for p in scripts
        if p.suffix == ".py" or p.read_text(errors="replace").startswith("#!/usr/bin/env python")
    ]
    assert scripts
    banned = ("ansible", "ansible_collections", "llama_runner", "train_runner")
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in scripts
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [str(node.module)]
        )
        if name.split(".")[0] in banned
    ]
    assert not found, found


# ---- one spelling of a job's phases and failure kinds ---------------------------------------
PROTOCOL = PLUGINS / "module_utils" / "llama_job" / "protocol.py"
STATUS_WORDS = re.compile(r"\b(phase|kind)\b")


def _status_values() -> set[str]:
    """The values of Phase and FailureKind, read from protocol.py's source."""
    tree = ast.parse(PROTOCOL.read_text(encoding="utf-8"))
    values = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ("Phase", "FailureKind"):
            for item in node.body:
                if isinstance(item, ast.Assign) and isinstance(item.value, ast.Constant):
                    values.add(str(item.value.value))
    return values


def _python_sources() -> list[Path]:
    found = [
        *PLUGINS.rglob("*.py"),
        *(ROOT / "llama_runner").rglob("*.py"),
        ROOT / "train_runner.py",
    ]
    return [p for p in found if p != PROTOCOL and "__pycache__" not in p.parts]


def test_a_phase_or_failure_kind_is_spelt_only_in_protocol_py() -> None:
    # Issue 41: every comparison with a job's phase or failure kind goes through the enums (one
    # grep for `Phase.`/`FailureKind.` finds every use); no string of theirs is compared with a
    # phase or kind anywhere else, in Python or in the playbooks' Jinja.
    values = _status_values()
    assert {"running", "failed", "vanished", "stalled"} <= values
    found = []
    for path in _python_sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            words = [s.value for s in sides if isinstance(s, ast.Constant)]
            for s in sides:
                if isinstance(s, ast.Tuple | ast.List | ast.Set):
                    words += [e.value for e in s.elts if isinstance(e, ast.Constant)]
            text = ast.unparse(node)
            if STATUS_WORDS.search(text) and values & {w for w in words if isinstance(w, str)}:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    jinja = re.compile(r"\b(phase|kind)\b\s*(==|!=|in)\s*\(?\[?\s*['\"](\w+)['\"]")
    for path in [
        *ROOT.glob("*.yml"),
        *(ROOT / "playbooks").rglob("*.yml"),
        *ROOT.glob("roles/*/*/*.yml"),
    ]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            hit = jinja.search(line)
            if hit and hit.group(3) in values:
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
