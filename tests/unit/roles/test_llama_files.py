"""The llama_files module (plugins/modules/llama_files.py, module_utils/safe_paths.py), run for
real on this machine (ad-hoc, local connection): directories, files that must exist and files
with content in one call, and never a write, chmod or chown through a link that another account
could have planted.

Issue 40's probe: the runs directory was the training account's (0775), run ids are
predictable, and llama_files followed links, so a link planted at the next run's path turned a
root-owned 1777 directory into the planter's 0700. Here the links and an existing directory are
planted at the next run's path for real, in a directory others can write and in one they cannot.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ANSIBLE_ADHOC = Path(sys.executable).with_name("ansible")


def llama_files(args: dict, *, check: bool = False) -> dict:
    """Run the module on localhost; its result."""
    done = subprocess.run(
        [str(ANSIBLE_ADHOC), "-i", "localhost,", "-c", "local", "localhost",
         "-m", "llama.cluster.llama_files", "-a", json.dumps(args), "-o",
         *(["--check"] if check else [])],
        cwd=ROOT, capture_output=True, text=True, check=False,
        env={"ANSIBLE_NOCOLOR": "1", "ANSIBLE_STDOUT_CALLBACK": "minimal", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    result = done.stdout.split("=>", 1)[-1]
    return {"failed": "FAILED" in done.stdout, **json.loads(result)}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


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


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """A runs directory as provisioning leaves it: writable by its owner (root) alone."""
    path = tmp_path / "runs"
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    return path


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """What a planted link points at: a 1777 directory (as /tmp is) holding a file."""
    path = tmp_path / "victim"
    path.mkdir()
    path.chmod(0o1777)
    (path / "secret").write_text("keep me\n")
    (path / "secret").chmod(0o600)
    return path


def _untouched(victim: Path) -> None:
    assert _mode(victim) == 0o1777, "the link's target was chmodded"
    assert sorted(p.name for p in victim.iterdir()) == ["secret"], "written through the link"
    assert (victim / "secret").read_text() == "keep me\n"
    assert _mode(victim / "secret") == 0o600


NEW_RUN = {"directory_mode": "0700", "file_mode": "0640"}


@pytest.mark.parametrize("planted", ["link", "directory", "link to nothing"])
def test_a_new_runs_directory_that_exists_already_is_refused_and_nothing_is_written(
    runs: Path, victim: Path, planted: str
) -> None:
    run = runs / "train-20261204-101500-tiny"
    if planted == "link":
        run.symlink_to(victim)
    elif planted == "directory":
        run.mkdir()
    else:
        run.symlink_to(runs / "absent")
    args = {
        **NEW_RUN,
        "directories": [{"path": str(run), "new": True}, {"path": str(run / "output")}],
        "files": [{"path": str(run / "train.yaml"), "content": "a: 1\n"}],
    }
    for check in (True, False):
        done = llama_files(args, check=check)
        assert done["failed"], done
        kind = "a link" if planted.startswith("link") else "a directory"
        said = f"{run} exists already ({kind}): a new run's directory is never reused"
        assert said in done["msg"], done["msg"]
    _untouched(victim)
    assert not (runs / "absent").exists()
    if planted == "directory":
        assert list(run.iterdir()) == [], "written into the directory that was there"


def test_a_new_runs_directory_is_made_by_this_call_with_the_mode_asked(runs: Path) -> None:
    run = runs / "train-20261204-101501-tiny"
    args = {
        **NEW_RUN,
        "directories": [{"path": str(runs), "mode": "0755"}, {"path": str(run), "new": True}],
    }
    assert llama_files(args, check=True)["changed"] is True
    assert not run.exists()
    assert llama_files(args)["changed_paths"] == [str(run)]
    assert _mode(run) == 0o700
    again = llama_files(args)
    assert again["failed"], "a second call reused the run's directory"


def test_a_new_directory_is_refused_where_others_can_write_its_parent(tmp_path: Path) -> None:
    # The runs directory of a cluster provisioned before issue 40: the training account's, 0775.
    shared = tmp_path / "runs"
    shared.mkdir()
    shared.chmod(0o775)
    done = llama_files({"directories": [{"path": str(shared / "r1"), "new": True}]})
    assert done["failed"]
    assert f"{shared / 'r1'} must be made in a directory only root can write" in done["msg"]
    assert "provision.yml --tags cluster_user" in done["msg"]
    assert not (shared / "r1").exists()


def test_no_link_is_followed_in_a_directory_that_others_can_write(
    tmp_path: Path, victim: Path
) -> None:
    # A run's directory is the training account's: it can plant a link at any path root then
    # writes to, chmods or chowns. Every kind of entry refuses it, or replaces the link itself.
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)
    (run / "logs").symlink_to(victim)
    (run / "node.log").symlink_to(victim / "secret")
    (run / "plan.json").symlink_to(victim / "secret")
    (run / "old").symlink_to(victim / "secret")
    cases = [
        ({"directories": [{"path": str(run / "logs"), "mode": "0700"}]}, f"{run}/logs is a link"),
        ({"touch": [{"path": str(run / "logs" / "n.log")}]}, f"{run}/logs is a link"),
        ({"touch": [{"path": str(run / "node.log"), "mode": "0666"}]}, f"{run}/node.log is a link"),
        ({"files": [{"path": str(run / "logs" / "x"), "content": "x"}]}, f"{run}/logs is a link"),
    ]
    for args, said in cases:
        done = llama_files({**args, "owner": str(os.getuid())})
        assert done["failed"], (args, done)
        assert said in done["msg"], done["msg"]
        assert "never followed" in done["msg"]
    # A file's content replaces the link itself; a removal removes the link, not its target.
    done = llama_files(
        {
            "files": [{"path": str(run / "plan.json"), "content": "{}\n", "mode": "0640"}],
            "absent": [str(run / "old")],
        }
    )
    assert not done["failed"], done
    assert not (run / "plan.json").is_symlink()
    assert (run / "plan.json").read_text() == "{}\n"
    assert not (run / "old").exists()
    _untouched(victim)


def test_a_link_that_only_root_could_make_is_followed(tmp_path: Path) -> None:
    # /opt/llama-cluster/runs -> /data/runs, made by root in a directory only root writes.
    base, disk = tmp_path / "base", tmp_path / "disk"
    base.mkdir(mode=0o755)
    disk.mkdir(mode=0o755)
    (disk / "runs").mkdir()
    (base / "runs").symlink_to("../disk/runs")
    done = llama_files(
        {"directories": [{"path": str(base / "runs" / "r1"), "new": True, "mode": "0750"}]}
    )
    assert not done["failed"], done
    assert (disk / "runs" / "r1").is_dir()
    assert _mode(disk / "runs" / "r1") == 0o750


def test_root_never_changes_the_owner_or_mode_of_a_hard_linked_file(tmp_path: Path) -> None:
    # Issue 45's probe: a hard link planted at a path llama_files touches got root's chown and
    # chmod (a 0600 file became 0644). The job's directory is another account's to write.
    secret = tmp_path / "secret"
    secret.write_text("root's only\n")
    secret.chmod(0o600)
    run = tmp_path / "run"
    run.mkdir()
    os.link(secret, run / "node.log")
    os.link(secret, run / "plan.json")
    touched = llama_files({"touch": [{"path": str(run / "node.log"), "mode": "0644",
                                      "owner": "nobody"}]})  # fmt: skip
    assert touched["failed"]
    assert (
        f"{run / 'node.log'} has 3 links (names): root never changes the owner or mode"
        in (touched["msg"])
    )
    written = llama_files(
        {"files": [{"path": str(run / "plan.json"), "content": "{}\n", "mode": "0644"}]}
    )
    assert not written["failed"], written
    assert (run / "plan.json").read_text() == "{}\n"  # a new file of its own
    assert _mode(run / "plan.json") == 0o644
    assert (secret.read_text(), _mode(secret), secret.stat().st_uid) == ("root's only\n", 0o600, 0)
    assert secret.stat().st_nlink == 2  # node.log still names it: refused, never changed
