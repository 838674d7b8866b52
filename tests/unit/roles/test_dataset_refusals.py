"""A bad dataset is refused by train.yml on the controller, before any node is touched, with the
reason (the llama_dataset_check module through the plan: module_utils/dataset_check.py); with
dataset_skip_invalid the run trains on the valid records alone."""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import DATA

# One worker takes the whole module, so its module-scoped fixture (ansible-playbook runs)
# runs once, not once per worker.
pytestmark = pytest.mark.xdist_group("dataset-refusals")

ROOT = Path(__file__).resolve().parents[3]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
NODE = '{"ansible_host": "%s", "cluster_accelerator": "cpu", "nproc_per_node": 1}'
INVENTORY = f"""all:
  children:
    cluster:
      children:
        master:
          hosts:
            a: {NODE % "192.0.2.1"}
        workers:
          hosts:
            b: {NODE % "192.0.2.2"}
"""
HISTORY_ENTRY = {
    "datasets_catalogue": {
        "with_history": {
            "file": str(DATA / "alpaca_bad_history.json"),
            "formatting": "alpaca",
            "columns": {
                "prompt": "instruction",
                "query": "input",
                "response": "output",
                "history": "history",
            },
        }
    }
}
TYPO_ENTRY = {
    "datasets_catalogue": {
        "typo": {
            "file": str(DATA / "sharegpt_good.json"),
            "formatting": "sharegpt",
            "tags": {"role": "from", "content_tag": "value"},
        }
    }
}


DEEP = '[{"instruction": ' + "[" * 100_000 + "]" * 100_000 + ', "output": "x"}]'


def _file(name: str, fmt: str = "alpaca") -> list[str]:
    return ["-e", f"dataset_file={DATA / name}", "-e", f"dataset_format={fmt}"]


# name: (extra arguments, what the failure says)
DATASET_CASES: dict[str, tuple[list[str], list[str]]] = {
    "sharegpt message without value": (
        _file("sharegpt_no_value.json", "sharegpt"),
        [
            f"Dataset user_data: 1 of 4 records in {DATA}/sharegpt_no_value.json are not valid "
            'sharegpt records (indexes count from 0): record 1 (line 14): message 1 has no "value"',
        ],
    ),
    "sharegpt role robot": (
        _file("sharegpt_robot.json", "sharegpt"),
        ['record 2 (line 26): message 1 has the role "robot", which is not a role of this dataset'],
    ),
    "sharegpt wrong order": (
        _file("sharegpt_order.json", "sharegpt"),
        ['record 0 (line 2): message 0 is "gpt" where LLaMA-Factory expects a user turn'],
    ),
    "sharegpt empty content": (
        _file("sharegpt_empty_content.json", "sharegpt"),
        ['record 3 (line 38): message 1 has an empty "value"'],
    ),
    "alpaca instruction not a string": (
        _file("alpaca_instruction_number.json"),
        ['record 2 (line 12): "instruction" is a number, not a string'],
    ),
    "alpaca bad history": (
        ["-e", json.dumps(HISTORY_ENTRY), "-e", "dataset=with_history"],
        ['record 1 (line 13): "history" item 0 is ["Hello."], not a [query, response] pair'],
    ),
    "alpaca without input anywhere": (
        _file("alpaca_no_input.json"),
        ['no record has "input", which the entry maps as the query column', "KeyError: 'input'"],
    ),
    "empty file": (_file("empty.json"), [f"{DATA}/empty.json is empty: it holds no records"]),
    "not a list": (
        _file("not_a_list.json"),
        [
            f"{DATA}/not_a_list.json is neither a JSON list of records",
            "A JSON file must hold a list of records",
        ],
    ),
    "json lines with a broken line": (
        _file("alpaca_broken_line.jsonl"),
        [
            "(read as JSON Lines: one record per line)",
            "record 3 (line 4): is not valid JSON (Expecting value at column 68)",
        ],
    ),
    "missing file": (
        _file("nowhere.json"),
        [f"{DATA}/nowhere.json does not exist on the controller"],
    ),
    # A FIFO was "does not exist"; a record nested 100,000 deep was "the check failed" (the
    # module died of RecursionError and its reason was lost) (issue 48).
    "a named pipe": (
        _file("fifo.json"),
        [f"{DATA}/fifo.json is a named pipe (FIFO), not a file", "Give the dataset's file"],
    ),
    "a record nested 100,000 deep": (
        _file("deep.json"),
        [
            f"{DATA}/deep.json has a value nested deeper than a JSON reader follows",
            "LLaMA-Factory could not load it either (record 0, from line 1 column 2)",
        ],
    ),
    "mixed good and bad": (
        _file("sharegpt_mixed.json", "sharegpt"),
        [
            "2 of 14 records",
            "record 3 (line 38): message 1 has the role",
            'record 9 (line 122): message 1 has no "value"',
            "train on the 12 valid records with -e dataset_skip_invalid=true",
        ],
    ),
    "entry with a misspelt tag": (
        ["-e", json.dumps(TYPO_ENTRY), "-e", "dataset=typo"],
        ["Dataset typo: tags has 'role', which LLaMA-Factory does not read"],
    ),
}


def _run(args: list[str], cwd: Path, playbook: str = "train.yml") -> tuple[int, str]:
    done = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), playbook, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={"ANSIBLE_NOCOLOR": "1", "PATH": "/usr/bin:/bin", "HOME": str(cwd)},
    )
    return done.returncode, " ".join((done.stdout + done.stderr).split())


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, Path]]:
    """Every case's exit status, output and controller runs directory."""
    tmp = tmp_path_factory.mktemp("bad-datasets")
    if not (DATA / "fifo.json").exists():
        os.mkfifo(DATA / "fifo.json")
    (DATA / "deep.json").write_text(DEEP)
    inventory = tmp / "inventory.yml"
    inventory.write_text(INVENTORY)
    # The controller has made the tiny model before (scripts/make_tiny_model.py, in the plan of
    # train.yml's first play: a cache of the controller, no node's): made here once, so that each
    # case's recap counts what the bad dataset changed, which must be nothing.
    made = ["-e", f"controller_runs_dir={tmp / 'runs'}"]  # the plan claims its run there
    made += ["-e", "plan_free_memory=false"]  # the nodes answer nothing: plan from their facts
    rc, out = _run(["-i", str(inventory), "-e", "model=tiny", "--tags", "none", *made], tmp)
    assert rc == 0, out[-3000:]

    def one(name: str) -> tuple[int, str, Path]:
        runs = tmp / re.sub(r"\W+", "-", name)
        extra = ["-i", str(inventory), "-e", "model=tiny", "-e", f"controller_runs_dir={runs}"]
        rc, out = _run([*extra, *DATASET_CASES[name][0]], tmp)
        return rc, out, runs

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(DATASET_CASES, pool.map(one, DATASET_CASES), strict=True))


@pytest.mark.parametrize("case", DATASET_CASES)
def test_a_bad_dataset_fails_on_the_controller_with_the_reason(outcomes, case: str) -> None:
    rc, out, runs = outcomes[case]
    assert rc != 0, out[-2000:]
    for said in DATASET_CASES[case][1]:
        assert said in out, f"{said!r} not in:\n{out[-3000:]}"
    assert "Train | Prepare every node" not in out, "a node was contacted"
    assert "UNREACHABLE" not in out
    recap = dict(re.findall(r"(\S+) : ok=\d+ changed=(\d+)", out))
    assert set(recap) == {"localhost"}, f"the play ran on {sorted(recap)}"
    assert recap["localhost"] == "0"
    assert not runs.exists(), f"{runs} was written"


def test_skip_invalid_trains_on_the_valid_records_and_says_which_were_left_out(
    tmp_path: Path,
) -> None:
    """With the opt-in, the run directory a node gets holds the 12 valid records only."""
    inventory = tmp_path / "inventory.yml"
    user = pwd.getpwuid(os.getuid()).pw_name
    group = grp.getgrgid(os.getgid()).gr_name
    node = (
        f'{{"ansible_connection": "local", "ansible_python_interpreter": "{sys.executable}", '
        f'"cluster_accelerator": "cpu", "nproc_per_node": 1, "cluster_address": "10.0.0.1", '
        f'"cluster_user": "{user}", "cluster_group": "{group}"}}'
    )
    inventory.write_text(
        INVENTORY.replace(NODE % "192.0.2.1", node).replace(NODE % "192.0.2.2", node)
    )
    rc, out = _run(
        [
            "-i",
            str(inventory),
            "-l",
            "localhost,a",
            "-e",
            "model=tiny",
            *_file("sharegpt_mixed.json", "sharegpt"),
            "-e",
            "dataset_skip_invalid=true",
            "-e",
            f"controller_runs_dir={tmp_path / 'runs'}",
            "-e",
            f"render_root={tmp_path / 'nodes'}",
        ],
        tmp_path,
        playbook="tests/playbooks/render_run.yml",
    )
    assert rc == 0, out[-3000:]
    assert "2 of 14 records in " + str(DATA / "sharegpt_mixed.json") in out, out[-3000:]
    assert "Training on the 12 valid records; 2 left out (first indexes: 3, 9)." in out
    (rendered,) = (tmp_path / "nodes" / "a").glob("train-*/data/user_data.json")
    records = [json.loads(line) for line in rendered.read_text().splitlines()]
    source = json.loads((DATA / "sharegpt_mixed.json").read_text())
    assert records == [r for i, r in enumerate(source) if i not in (3, 9)]
