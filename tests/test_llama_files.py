"""The llama_files module (plugins/modules/llama_files.py), run for real on this machine
(ad-hoc, local connection), and the run_config_files filter that feeds it the run directory's
texts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ansible_collections.llama.cluster.plugins.module_utils.planner.render import run_files

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE = Path(sys.executable).with_name("ansible")


def llama_files(args: dict, *, check: bool = False) -> dict:
    """Run the module on localhost; its result."""
    done = subprocess.run(
        [str(ANSIBLE), "-i", "localhost,", "-c", "local", "localhost",
         "-m", "llama.cluster.llama_files", "-a", json.dumps(args), "-o",
         *(["--check"] if check else [])],
        cwd=ROOT, capture_output=True, text=True, check=False,
        env={"ANSIBLE_NOCOLOR": "1", "ANSIBLE_STDOUT_CALLBACK": "minimal", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    result = done.stdout.split("=>", 1)[-1]
    return {"failed": "FAILED" in done.stdout, **json.loads(result)}


def test_directories_files_and_removals_in_one_call_then_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (tmp_path / "old_token").write_text("x")
    log = run / "node.log"
    args = {
        "directories": [{"path": str(run)}, {"path": str(run / "tmp"), "mode": "0700"}],
        "touch": [{"path": str(log)}],
        "absent": [str(tmp_path / "old_token"), str(tmp_path / "never_there")],
        "files": [{"path": str(run / "plan.json"), "content": '{"a": 1}\n', "json": True}],
        "directory_mode": "0750",
        "file_mode": "0640",
    }
    assert llama_files(args, check=True)["changed"] is True
    assert not run.exists(), "check mode wrote"
    first = llama_files(args)
    assert first["changed"] is True
    assert (run / "plan.json").read_text() == '{"a": 1}\n'
    assert not (tmp_path / "old_token").exists()
    modes = {p: oct(p.stat().st_mode & 0o777) for p in (run, run / "tmp", log, run / "plan.json")}
    assert modes == {run: "0o750", run / "tmp": "0o700", log: "0o640", run / "plan.json": "0o640"}
    log.write_text("kept\n")
    again = llama_files(args)
    assert again["changed"] is False, again
    assert log.read_text() == "kept\n", "an existing file that must exist was truncated"
    changed = llama_files({**args, "files": [{**args["files"][0], "content": '{"a": 2}\n'}]})
    assert changed["changed_paths"] == [str(run / "plan.json")]


def test_bad_json_or_a_relative_path_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    bad = llama_files(
        {
            "directories": [{"path": str(tmp_path / "d")}],
            "files": [{"path": str(tmp_path / "d/x.json"), "content": "{", "json": True}],
        }
    )
    assert bad["failed"]
    assert "is not valid JSON" in bad["msg"]
    assert not (tmp_path / "d").exists()
    relative = llama_files({"directories": [{"path": "d"}]})
    assert relative["failed"]
    assert "every path must be absolute" in relative["msg"]


def test_run_config_files_skips_unused_configurations_and_ends_texts_with_a_newline() -> None:
    files = run_files({"train.yaml": "a: 1", "ds_config.json": "", "plan.json": "{}\n"}, "/r")
    assert files == [
        {"path": "/r/train.yaml", "content": "a: 1\n", "json": False},
        {"path": "/r/plan.json", "content": "{}\n", "json": True},
    ]
