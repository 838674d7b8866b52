"""The maps of the code, checked against the code so that they cannot drift from it (`make lint`).

- The collection's README is a room list: one line per plugin and module_utils file, each
  file of the tree listed once and every listed file in the tree.
- The README's "How it works" table answers each question with `path:function` pointers: each
  file exists and defines the function (or class, or constant) it names.
- The import rules: the planner and the supervisor import nothing outside themselves but the
  shared modules named here; a plugin type does not import another type; code that runs on the
  nodes never imports the controller's.
- A job's phases and failure kinds are spelt once, in llama_job/protocol.py's enums: no string
  of theirs is compared with a phase or a kind anywhere else (Python, built strings included, or
  the playbooks', roles' and templates' Jinja, selectattr included).
- A stage is spelt once, in planner/plan.py's Stage: no other code names one (Python, YAML, Jinja).
- Every rule checks a file set that is not empty.
"""

from __future__ import annotations

import ast
import json
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


# A newcomer's six questions (issue 47), the table's first six rows, in that order.
NEWCOMER = ("rank", "stops every rank", "stage", "firewall", "hub model", "checkpoint")


def test_a_newcomers_six_questions_are_answered_from_at_most_8_files():
    rows = _rows()[: len(NEWCOMER)]
    asked = [row.split("|")[1] for row in rows]
    assert all(word in question for word, question in zip(NEWCOMER, asked, strict=True)), asked
    files = {path for row in rows for path, _ in POINTER.findall(row)}
    assert len(files) <= 8, sorted(files)


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
    assert files, "no files to check: the rule would pass on nothing"
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


# What llama_runner (and train_runner.py) may import besides the standard library and itself: the
# controller's own packages (ansible-core among them: its collection finder, inventory reader),
# and of the collection its module_utils only (the status and plan types, the trainer log),
# never a plugin: those are Ansible's to load.
RUNNER_SHARED = ("ansible_runner", "rich", "yaml", "ansible.")


def _absolute_imports(path: Path) -> set[str]:
    """Every module a file outside the collection imports (llama_runner imports absolutely)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: a relative import"
            found.add(str(node.module))
    return found


def test_llama_runner_imports_the_collections_module_utils_and_no_plugin():
    files = [*sorted((ROOT / "llama_runner").glob("*.py")), ROOT / "train_runner.py"]
    assert len(files) > 5
    bad = []
    for path in files:
        for name in sorted(_absolute_imports(path)):
            ours = _ours(name)
            top = name.split(".", maxsplit=1)[0]
            fine = (
                top in STDLIB
                or top == "llama_runner"
                or name.startswith(RUNNER_SHARED)
                or (ours is not None and ours.startswith("module_utils"))
            )
            if not fine:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


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


def _texts(side: ast.expr) -> list[str]:
    """The strings a side of a comparison spells: a constant, a collection's constants, and the
    literal parts of a string built from pieces (an f-string, a concatenation)."""
    if isinstance(side, ast.Constant) and isinstance(side.value, str):
        return [side.value]
    if isinstance(side, ast.Tuple | ast.List | ast.Set):
        return [t for e in side.elts for t in _texts(e)]
    if isinstance(side, ast.JoinedStr):
        return ["".join(t for e in side.values for t in _texts(e))]
    if isinstance(side, ast.BinOp) and isinstance(side.op, ast.Add):
        return ["".join(_texts(side.left) + _texts(side.right))]
    return []


def _jinja_sources() -> list[Path]:
    """Every file with the project's Jinja: the playbooks, the roles (tasks, vars, defaults,
    templates), group_vars and templates/."""
    return [
        *ROOT.glob("*.yml"),
        *(ROOT / "playbooks").rglob("*.yml"),
        *ROOT.glob("roles/*/*/*.yml"),
        *ROOT.glob("roles/*/templates/*.j2"),
        *(ROOT / "group_vars").rglob("*.yml"),
        *(ROOT / "templates").glob("*.j2"),
    ]


def test_a_phase_or_failure_kind_is_spelt_only_in_protocol_py() -> None:
    # Issue 41: every comparison with a job's phase or failure kind goes through the enums (one
    # grep for `Phase.`/`FailureKind.` finds every use); no string of theirs is compared with a
    # phase or kind anywhere else, in Python (built strings included) or in Jinja (selectattr
    # and the templates included).
    values = _status_values()
    assert {"running", "failed", "vanished", "stalled"} <= values
    found = []
    sources = _python_sources()
    assert sources
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            words = {t for side in [node.left, *node.comparators] for t in _texts(side)}
            text = ast.unparse(node)
            if STATUS_WORDS.search(text) and (values & words or _built(node, values)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    jinja = [
        re.compile(r"\b(phase|kind)\b\s*(==|!=|in)\s*\(?\[?\s*['\"](\w+)['\"]"),
        re.compile(
            r"(select|reject)attr\(\s*['\"][\w.]*\b(phase|kind)['\"]\s*,\s*['\"]\w+['\"]\s*,"
            r"\s*\[?\s*['\"](\w+)['\"]"
        ),
    ]
    files = _jinja_sources()
    assert files
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            hits = [hit for rule in jinja for hit in rule.finditer(line)]
            if any(hit.group(3) in values for hit in hits):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def _built(node: ast.Compare, values: set[str]) -> bool:
    """Whether a comparison builds one of `values` from pieces (f"run{x}", "fail" + "ed")."""
    sides = [node.left, *node.comparators]
    built = [s for s in sides if isinstance(s, ast.JoinedStr | ast.BinOp)]
    return any(
        value.startswith(text) and text
        for side in built
        for text in _texts(side)
        for value in values
    )


# ---- one spelling of the stages ------------------------------------------------------------
PLAN = PLUGINS / "module_utils" / "planner" / "plan.py"
STAGE_WORDS = re.compile(r"\b(stage|deepspeed)\b", re.IGNORECASE)


def _stage_values() -> tuple[set[str], set[str]]:
    """Stage's values, read from plan.py's source: those that are nothing but a stage's name, and
    those that are also a word of their own (none; fsdp, a LLaMA-Factory argument), which count
    only where a stage is being compared."""
    tree = ast.parse(PLAN.read_text(encoding="utf-8"))
    (stage,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Stage"]
    values = {
        str(item.value.value)
        for item in stage.body
        if isinstance(item, ast.Assign) and isinstance(item.value, ast.Constant)
    }
    arguments = set(json.loads(NAMES_JSON.read_text(encoding="utf-8"))["train_args"])
    words = {v for v in values if v == "none" or v in arguments}
    return values - words, words


NAMES_JSON = PLUGINS / "module_utils" / "planner" / "llamafactory_names.json"


def _docstrings(tree: ast.AST) -> set[int]:
    bodies = [
        n for n in ast.walk(tree) if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef)
    ]
    return {
        id(n.body[0].value)
        for n in bodies
        if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
    }


def _python_stage_spellings(path: Path, names: set[str], words: set[str]) -> list[str]:
    """Where a Python file names a stage: any string of one of `names` (or a piece that builds
    one), and a comparison of a stage with one of `words`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.JoinedStr | ast.BinOp) and _built_name(node, names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Compare) and STAGE_WORDS.search(ast.unparse(node)):
            said = {t for side in [node.left, *node.comparators] for t in _texts(side)}
            if said & words:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def _built_name(node: ast.JoinedStr | ast.BinOp, names: set[str]) -> bool:
    """Whether a string built from pieces starts like a stage's name and leaves the rest to a
    value (f"zero{n}", "zero" + str(n))."""
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        head = first.value if isinstance(first, ast.Constant) else ""
        rest = len(node.values) > 1
    elif isinstance(node.op, ast.Add) and isinstance(node.left, ast.Constant):
        head, rest = str(node.left.value), True
    else:
        return False
    return bool(head) and rest and any(n.startswith(head) and n != head for n in names)


def test_a_stage_is_spelt_only_in_plan_py() -> None:
    # Issue 47: a stage is one of plan.Stage's members; what a stage is (its ZeRO stage, what it
    # offloads, FSDP, hybrid, its files) is the member's to say. Jinja reads those properties
    # from the plan's JSON (plan.stage.zero, .fsdp, .hybrid, ...), never a stage's name.
    names, words = _stage_values()
    assert {"zero3", "zero3_offload", "hsdp"} <= names
    assert "none" in words
    found = []
    sources = [p for p in [*_python_sources(), *(ROOT / "scripts").glob("*.py")] if p != PLAN]
    assert sources
    for path in sources:
        found += _python_stage_spellings(path, names, words)
    alternatives = "|".join(sorted(names))
    quoted = re.compile(rf"""['"]({alternatives})['"]""")
    keyed = re.compile(rf"^\s*-?\s*({alternatives})\s*:")
    either = "|".join(sorted(words))
    compared = re.compile(
        rf"\b(stage|deepspeed)\b[\w.]*\s*(==|!=|in)\s*\(?\[?\s*['\"]({either})['\"]"
    )
    for path in _jinja_sources():
        jinja = path.suffix == ".j2" or "group_vars" not in path.parts
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0] if path.suffix == ".yml" else line
            if not jinja and "{{" not in code and "{%" not in code:
                continue
            if quoted.search(code) or keyed.search(code) or compared.search(code):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
